#!/usr/bin/env bash
# Device A/B for branch s16-greedyhead (plain greedy steps: the LM head GEMM with an argmax epilogue,
# no logits written). Run from the repository root with the branch checked out. Written in session 16
# (no device time was left to run it).
set -uo pipefail
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
source tools/device_env.sh >/dev/null
t0=$SECONDS
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_greedy_head.py tests/test_hf_e2e.py \
  > "$OUT/gpu_tests_greedy_head.log" 2>&1
echo "tests rc=$? $((SECONDS-t0))s"; tail -1 "$OUT/gpu_tests_greedy_head.log"
timeout 80 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_greedy_head.py > "$OUT/memcheck_greedy_head.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_greedy_head.log" | tail -2
LOG=$OUT/lat_greedy_head.md; : > "$LOG"
lat() { echo "### $1" >> "$LOG"; timeout 90 python3 -c "$grc" bench latency --model builtin:qwen2.5-0.5b \
  --batch-sizes 8,64,256 --context 1024 --modes FULL >> "$LOG" 2>&1; echo "$1 rc=$?"; grep -E '^FULL +[0-9]+ ' "$LOG" | tail -3; }
for rep in 1 2; do for g in 1 0; do GRAPHRUNNER_GREEDY_HEAD=$g lat "greedy_head=$g"; done; done
for tiles in 128,128,64,4,4 64,256,64,8,4 128,256,64,8,4; do
  GRAPHRUNNER_GREEDY_HEAD_TILES=$tiles lat "tiles=$tiles"
done
GRAPHRUNNER_PDL=0 timeout 80 python3 -c "$grc" bench kernels --batch-sizes 256 --top 12 > "$OUT/kernels_greedy_head.md" 2>&1
grep -E "ms/step|_head_argmax|_combine|nvjet_sm90_tss" "$OUT/kernels_greedy_head.md"
echo "done $((SECONDS-t0))s"
