#!/usr/bin/env bash
# Session 20, call 3 (kind nvidia-h200): issue #16's greedy argmax, load strategies of the partial kernel
# (docs/bench/sampler_s20/argmax_variants_s20.py), then `bench sampler` of this tree (COMBINE_LAST on by default).
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
source tools/device_env.sh >/dev/null
timeout 330 python3 docs/bench/sampler_s20/argmax_variants_s20.py --rows 256,64 > "$OUT/argmax_variants.txt" 2>&1
echo "variants rc=$? $((SECONDS-t0))s"; cat "$OUT/argmax_variants.txt"
timeout 150 python3 -c "$grc" bench sampler --num-reqs 1,64,256 > "$OUT/sampler.md" 2>&1
echo "sampler rc=$? $((SECONDS-t0))s"; grep -E '\| graph \|' "$OUT/sampler.md"
