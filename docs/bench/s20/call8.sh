#!/usr/bin/env bash
# Session 20, call 8 (kind nvidia-h200): the argmax long-chunk warp rule (GPU tests, old / new A/B), and
# qwen2.5-0.5b batch 1 / 256 on this tree and on b84153b (session 19's last tree, `.s20gpu/base`), interleaved:
# call 7 measured batch 256 at 2.404 ms on an H200 against 2.264-2.276 in session 19 (other machines).
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
source tools/device_env.sh >/dev/null
root=$PWD
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sample_argmax.py tests/test_greedy_head.py \
   > "$OUT/gpu_tests.log" 2>&1; echo "tests rc=$? $((SECONDS-t0))s"; tail -1 "$OUT/gpu_tests.log"
timeout 60 python3 docs/bench/sampler_s20/argmax_ab_s20.py > "$OUT/argmax_ab.txt" 2>&1
echo "ab rc=$? $((SECONDS-t0))s"; cat "$OUT/argmax_ab.txt"
for tree in new base new base; do
  dir=$root; [ $tree = base ] && dir=$root/.s20gpu/base
  echo "### $tree" >> "$OUT/lat_qwen_ab.md"
  (cd "$dir" && PYTHONPATH="$dir:${PYTHONPATH:-}" timeout 70 python3 -c "$grc" bench latency \
     --model builtin:qwen2.5-0.5b --batch-sizes 1,256 --context 1024 --modes FULL) >> "$OUT/lat_qwen_ab.md" 2>&1
  echo "$tree rc=$? $((SECONDS-t0))s"; grep -E '^FULL +(1|256) ' "$OUT/lat_qwen_ab.md" | tail -2
done
