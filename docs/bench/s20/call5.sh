#!/usr/bin/env bash
# Session 20, call 5 (kind nvidia-h200): issue #16's benchmark on this tree (argmax at 16 warps, evict_first,
# in-launch combine), the argmax old / new A/B, and qwen2.5-0.5b batch 1 / 256 on this tree and on b84153b
# (session 19's last tree, `.s20gpu/base`), interleaved. Expects `.s20gpu/base` beside the working tree.
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
source tools/device_env.sh >/dev/null
root=$PWD
timeout 200 python3 -c "$grc" bench sampler --num-reqs 1,64,256 > "$OUT/sampler.md" 2>&1
echo "sampler rc=$? $((SECONDS-t0))s"; grep -E '\| (greedy|sampled \| bisect|all_on \| bisect) .*\| graph \|' "$OUT/sampler.md"
timeout 90 python3 docs/bench/sampler_s20/argmax_ab_s20.py > "$OUT/argmax_ab.txt" 2>&1
echo "ab rc=$? $((SECONDS-t0))s"; cat "$OUT/argmax_ab.txt"
for tree in new base new base; do
  dir=$root; [ $tree = base ] && dir=$root/.s20gpu/base
  echo "### $tree" >> "$OUT/lat_qwen_ab.md"
  (cd "$dir" && PYTHONPATH="$dir:${PYTHONPATH:-}" timeout 80 python3 -c "$grc" bench latency \
     --model builtin:qwen2.5-0.5b --batch-sizes 1,256 --context 1024 --modes FULL) >> "$OUT/lat_qwen_ab.md" 2>&1
  echo "$tree rc=$? $((SECONDS-t0))s"; grep -E '^FULL +(1|256) ' "$OUT/lat_qwen_ab.md" | tail -2
done
