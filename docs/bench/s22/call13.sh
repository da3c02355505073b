#!/usr/bin/env bash
# Session 22, call 13: the final tree's GPU tests for what sessions 21-22 touched: the head-major KV layout, the
# greedy head's load strategies, the attention launch (with the register-cap test) and the rotary-in-attention.
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
source tools/device_env.sh >/dev/null
timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kv_layout.py tests/test_greedy_head.py \
   tests/test_attention.py tests/test_attention_rope.py > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$? $((SECONDS-t0))s"; tail -3 "$OUT/gpu_tests.log"
