#!/usr/bin/env bash
# Session 20, call 6 (kind nvidia-h200): issue #17, decode attention over a head-major KV cache
# (docs/bench/decode_fusion/kv_layout_s20.py): three head shapes at batch 1 / 64 / 256, and a plan grid at 256.
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
source tools/device_env.sh >/dev/null
timeout 400 python3 docs/bench/decode_fusion/kv_layout_s20.py > "$OUT/kv_layout.txt" 2>&1
echo "kv layout rc=$? $((SECONDS-t0))s"; cat "$OUT/kv_layout.txt"
