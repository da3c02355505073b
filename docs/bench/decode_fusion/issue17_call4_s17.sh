#!/usr/bin/env bash
# Session 17, call 4: tree .s17gpu/after (main + greedy head): GPU tests, issue #17's three-model A/B vs f50caea
# (.s17gpu/before, the tree before any #17 work), then batch-1 split cap 16 vs 32.
set -uo pipefail
t0=$SECONDS
cd .s17gpu/after
nvidia-smi --query-gpu=name --format=csv,noheader
(source tools/device_env.sh >/dev/null; timeout 130 python3 -m pytest -q -m gpu -p no:cacheprovider -x \
  tests/test_greedy_head.py tests/test_hf_e2e.py > "$OUT/gpu_tests_s17_call4.log" 2>&1; echo "tests rc=$? $((SECONDS-t0))s")
grep -E "passed|failed|FAIL" "$OUT/gpu_tests_s17_call4.log" | tail -4
BEFORE=$PWD/../before bash ../issue17_full_ab.sh
source tools/device_env.sh >/dev/null
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
LOG=$OUT/lat_split_cap_s17.md; : > "$LOG"
for cap in 16 32 16 32; do
  left=$((590-SECONDS+t0)); [ $left -lt 30 ] && break
  echo "### cap=$cap" >> "$LOG"; GRAPHRUNNER_ATTN_PLAN_MAX_SPLITS=$cap timeout $left python3 -c "$grc" bench latency \
    --model builtin:qwen2.5-0.5b --batch-sizes 1 --context 1024 --modes FULL >> "$LOG" 2>&1
  echo "cap=$cap rc=$? $((SECONDS-t0))s"; grep -E '^FULL +1 ' "$LOG" | tail -1
done
