#!/usr/bin/env bash
# Session 22, call 6: splitk_norm_s22.py (o / down projections as strided-batched split-K GEMMs with fp32
# partials, summed by the add + RMSNorm kernel) at 256 and 64 rows.
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
source tools/device_env.sh >/dev/null
for rows in 256 64; do
  timeout 120 python3 docs/bench/decode_fusion/splitk_norm_s22.py --rows $rows >> "$OUT/splitk_norm.txt" 2>&1
  echo "$rows rc=$? $((SECONDS-t0))s"
done
cat "$OUT/splitk_norm.txt"
