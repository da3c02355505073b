#!/usr/bin/env bash
# Session 20, call 7 (kind nvidia-h200): the closing figures of this tree. Issue #16's `bench sampler
# --num-reqs 1,64,256` (argmax at 16 warps with evict_first and the in-launch combine), the argmax old / new
# A/B, and issue #17's `bench latency` on qwen2.5-0.5b.
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
source tools/device_env.sh >/dev/null
timeout 200 python3 -c "$grc" bench sampler --num-reqs 1,64,256 > "$OUT/sampler.md" 2>&1
echo "sampler rc=$? $((SECONDS-t0))s"; grep -E '\| (greedy|sampled \| bisect|all_on \| bisect) .*\| graph \|' "$OUT/sampler.md"
timeout 90 python3 docs/bench/sampler_s20/argmax_ab_s20.py > "$OUT/argmax_ab.txt" 2>&1
echo "ab rc=$? $((SECONDS-t0))s"; cat "$OUT/argmax_ab.txt"
timeout 120 python3 -c "$grc" bench latency --model builtin:qwen2.5-0.5b --batch-sizes 1,8,64,256 --context 1024 \
   --modes FULL > "$OUT/lat_qwen.md" 2>&1
echo "latency rc=$? $((SECONDS-t0))s"; grep -E '^FULL ' "$OUT/lat_qwen.md"
