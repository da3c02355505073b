#!/usr/bin/env bash
# Device A/B for branch s17-newkey (a one-token request's fused attention launch reads the cache first and
# folds its own key from registers, then writes it). Run from the repository root with the branch checked
# out. Written in session 17 (no device time was left to run it).
set -uo pipefail
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
source tools/device_env.sh >/dev/null
t0=$SECONDS
T=$OUT/gpu_tests_newkey.log
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_rope.py tests/test_hf_e2e.py > "$T" 2>&1
echo "tests rc=$? $((SECONDS-t0))s"; grep -E "passed|failed" "$T" | tail -1
timeout 90 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_attention_rope.py >> "$T" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$T" | tail -2
LOG=$OUT/lat_newkey_ab.md; : > "$LOG"
lat() { echo "### $1 $2" >> "$LOG"; GRAPHRUNNER_ATTN_NEW_KEY_LAST=$2 timeout 100 python3 -c "$grc" bench latency \
  --model builtin:$1 --batch-sizes ${BS:-1,256} --context 1024 --modes FULL >> "$LOG" 2>&1
  echo "$1 new_key_last=$2 rc=$? $((SECONDS-t0))s"; grep -E '^FULL +[0-9]+ ' "$LOG" | tail -4; }
for rep in 1 2; do for k in 1 0; do lat qwen2.5-0.5b $k; done; done
for k in 1 0; do BS=1,256 lat llama-3.2-1b $k; done
timeout 70 python3 -m graphrunner_tools.bench.attn_sweep --rope --quick --batch-sizes 1,8,64,256 \
  > "$OUT/attn_newkey_isolated.txt" 2>&1; echo "isolated rc=$?"; grep "RopeKV launch" "$OUT/attn_newkey_isolated.txt"
GRAPHRUNNER_PDL=0 timeout 80 python3 -c "$grc" bench kernels --batch-sizes 1,256 --top 8 > "$OUT/kernels_newkey.md" 2>&1
grep -E "ms/step|_paged_attn" "$OUT/kernels_newkey.md"
