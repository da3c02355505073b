#!/usr/bin/env bash
# session 19 call 1: GPU tests of the wide-memory GEMV plan + HF parity, greedy argmax sweep, small-model GEMV tune + A/B
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
(source tools/device_env.sh >/dev/null && timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider \
   tests/test_decode_linear.py tests/test_hf_e2e.py > "$OUT/gpu_tests_s19.log" 2>&1; echo "tests rc=$? $((SECONDS-t0))s"; tail -3 "$OUT/gpu_tests_s19.log")
(source tools/device_env.sh >/dev/null && timeout 100 python3 docs/bench/sampler_s17/argmax_sweep.py --rows 256,64 > "$OUT/argmax_sweep_h200.txt" 2>&1
 echo "argmax sweep rc=$? $((SECONDS-t0))s"; head -24 "$OUT/argmax_sweep_h200.txt")
OUT=$OUT bash docs/bench/decode_fusion/gemv_tune_small_s19.sh
echo "total $((SECONDS-t0))s"
