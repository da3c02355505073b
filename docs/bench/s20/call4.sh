#!/usr/bin/env bash
# Session 20, call 4 (kind nvidia-h200): issue #16's greedy argmax at 16 warps with evict_first (this tree):
# GPU tests and memcheck of the argmax / greedy-head kernels, the old / new launch A/B in one process
# (docs/bench/sampler_s20/argmax_ab_s20.py), `bench sampler --variants greedy`; on an H200 also the decode
# attention plans at 256 rows (issue #17).
set -uo pipefail
t0=$SECONDS; card=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$card"
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
source tools/device_env.sh >/dev/null
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sample_argmax.py tests/test_greedy_head.py \
   > "$OUT/gpu_tests.log" 2>&1; echo "tests rc=$? $((SECONDS-t0))s"; tail -1 "$OUT/gpu_tests.log"
timeout 150 compute-sanitizer --tool memcheck python3 -m pytest -q -m gpu -p no:cacheprovider \
   tests/test_sample_argmax.py > "$OUT/memcheck_argmax.log" 2>&1
echo "memcheck rc=$? $((SECONDS-t0))s"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_argmax.log" | tail -2
timeout 120 python3 docs/bench/sampler_s20/argmax_ab_s20.py > "$OUT/argmax_ab.txt" 2>&1
echo "ab rc=$? $((SECONDS-t0))s"; cat "$OUT/argmax_ab.txt"
timeout 60 python3 -c "$grc" bench sampler --num-reqs 1,64,256 --variants greedy > "$OUT/sampler_greedy.md" 2>&1
echo "sampler rc=$? $((SECONDS-t0))s"; grep -E '\| graph \|' "$OUT/sampler_greedy.md"
if [[ "$card" == *H200* ]]; then
  timeout 200 python3 -m graphrunner_tools.bench.attn_sweep --rope --batch-sizes 256 > "$OUT/attn_sweep_256.txt" 2>&1
  echo "attn sweep rc=$? $((SECONDS-t0))s"; head -10 "$OUT/attn_sweep_256.txt"
fi
