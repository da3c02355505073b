#!/usr/bin/env bash
# Session 21, call 4 (kind nvidia-h200; say which card it landed on). Issue #17's benchmark for qwen2.5-0.5b on
# this tree (head-major KV cache and the persistent tensor-descriptor greedy head by default) against
# `.s21gpu/s20` (9253102, session 20's last tree), after / before / after / before, plus the GPU tests that run
# the new defaults end to end (HF parity, the layouts, the greedy head).
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
source tools/device_env.sh >/dev/null
root=$PWD
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kv_layout.py tests/test_greedy_head.py \
   tests/test_hf_e2e.py > "$OUT/gpu_tests.log" 2>&1; echo "tests rc=$? $((SECONDS-t0))s"; tail -1 "$OUT/gpu_tests.log"
for tree in after before after before; do
  dir=$root; [ $tree = before ] && dir=$root/.s21gpu/s20
  echo "### $tree" >> "$OUT/lat_qwen_issue17.md"
  (cd "$dir" && PYTHONPATH="$dir:$PYTHONPATH" timeout 100 python3 -c "$grc" bench latency \
     --model builtin:qwen2.5-0.5b --batch-sizes 1,8,64,256 --context 1024 --modes FULL) >> "$OUT/lat_qwen_issue17.md" 2>&1
  echo "$tree rc=$? $((SECONDS-t0))s"; grep -E '^FULL +(1|8|64|256) ' "$OUT/lat_qwen_issue17.md" | tail -4
done
