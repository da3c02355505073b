#!/usr/bin/env bash
# Session 22, call 7: splitk_norm_s22.py over every model's o / down shape at 2 .. 256 rows.
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
source tools/device_env.sh >/dev/null
timeout 400 python3 docs/bench/decode_fusion/splitk_norm_s22.py --rows 2,8,16,32,64,128,256 \
  --shapes qwen-down,qwen-o,l1b-down,l1b-o,l8b-down,l8b-o > "$OUT/splitk_norm_sweep.txt" 2>&1
echo "rc=$? $((SECONDS-t0))s"; cat "$OUT/splitk_norm_sweep.txt"
