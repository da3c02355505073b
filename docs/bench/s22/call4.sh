#!/usr/bin/env bash
# Session 22, call 4: kv_l2_prefetch_s22.py (the next layer's first KV pages prefetched into L2 on a side stream
# beside this layer's GEMMs), 256 and 64 rows; then the GPU attention tests call 3 cut off.
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
source tools/device_env.sh >/dev/null
timeout 150 python3 docs/bench/decode_fusion/kv_l2_prefetch_s22.py --rows 256 > "$OUT/l2_prefetch.txt" 2>&1
echo "256 rc=$? $((SECONDS-t0))s"
timeout 90 python3 docs/bench/decode_fusion/kv_l2_prefetch_s22.py --rows 64 --pages 0,4,8,16 >> "$OUT/l2_prefetch.txt" 2>&1
echo "64 rc=$? $((SECONDS-t0))s"; cat "$OUT/l2_prefetch.txt" | tail -40
