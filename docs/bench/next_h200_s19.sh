#!/usr/bin/env bash
# Written in session 18 for session 19's first device call (kind nvidia-h200; check which card it lands on and say so).
# The H200-specific questions left open by session 18 (docs/bench/README.md, "Session 18"), in one call:
#  1. qwen2.5-0.5b / llama-3.2-1b one-row GEMVs: sweep + batch 1 / 8 A/B against a tuned copy (issue #17, qwen batch 1
#     0.766 ms on an H200 against the 0.7 target);
#  2. decode attention launch plans at 64 / 256 rows (qwen batch 256: attention 45 µs a layer, ~70% of the KV floor);
#  3. the greedy argmax's launch grid at 256 / 64 rows (issue #16: 49.1 µs against the 40 µs target, floor 37.8).
# Run from the repository root: OUT=... bash docs/bench/next_h200_s19.sh
set -uo pipefail
t0=$SECONDS
OUT=$OUT bash docs/bench/decode_fusion/gemv_tune_small_s19.sh
source tools/device_env.sh >/dev/null
timeout 120 python3 -m graphrunner_tools.bench.attn_sweep --rope --batch-sizes 64,256 > "$OUT/attn_sweep_h200.txt" 2>&1
echo "attn sweep rc=$? $((SECONDS-t0))s"; head -20 "$OUT/attn_sweep_h200.txt"
timeout 100 python3 docs/bench/sampler_s17/argmax_sweep.py --rows 256,64 > "$OUT/argmax_sweep_h200.txt" 2>&1
echo "argmax sweep rc=$? $((SECONDS-t0))s"; head -24 "$OUT/argmax_sweep_h200.txt"
