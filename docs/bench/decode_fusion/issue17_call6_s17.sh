#!/usr/bin/env bash
# Session 17, call 6: the final tree (.s17gpu/fin): GPU tests of the changed defaults, then issue #17's
# three-model A/B against f50caea (.s17gpu/before) and the batch-1 nodes per layer.
set -uo pipefail
t0=$SECONDS
cd .s17gpu/fin
nvidia-smi --query-gpu=name --format=csv,noheader
(source tools/device_env.sh >/dev/null; timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_norm_linear.py tests/test_decode_linear.py tests/test_attention.py -k "not matches_reference" \
  > "$OUT/gpu_tests_s17_call6.log" 2>&1; echo "tests rc=$? $((SECONDS-t0))s")
grep -E "passed|failed|FAIL" "$OUT/gpu_tests_s17_call6.log" | tail -4
BEFORE=$PWD/../before LAT_TIMEOUT=120 bash ../issue17_full_ab.sh
echo "total $((SECONDS-t0))s"
