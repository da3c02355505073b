#!/usr/bin/env bash
# Session 22, call 9: split-K o / down projections summed by the next add + RMSNorm (graphrunner/layers/split_k.py).
# GPU tests (split_k, HF parity end to end, the norm / linear kernels); then issue #17's qwen2.5-0.5b benchmark,
# this tree vs `.s22gpu/base` (git archive dc9a2cc graphrunner), interleaved.
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
source tools/device_env.sh >/dev/null
root=$PWD
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_split_k.py tests/test_hf_e2e.py \
   tests/test_models.py tests/test_norm_linear.py > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$? $((SECONDS-t0))s"; tail -3 "$OUT/gpu_tests.log"
for tree in new base new base; do
  dir=$root; [ $tree = base ] && dir=$root/.s22gpu/base
  echo "### $tree" >> "$OUT/lat_qwen_ab.md"
  (cd "$dir" && PYTHONPATH="$dir:$PYTHONPATH" timeout 100 python3 -c "$grc" bench latency \
     --model builtin:qwen2.5-0.5b --batch-sizes 1,8,64,256 --context 1024 --modes FULL) >> "$OUT/lat_qwen_ab.md" 2>&1
  echo "$tree rc=$? $((SECONDS-t0))s"; grep -E 'FULL +bs=' "$OUT/lat_qwen_ab.md" | tail -4
done
for tree in new base; do
  dir=$root; [ $tree = base ] && dir=$root/.s22gpu/base
  echo "### $tree" >> "$OUT/lat_llama1b_ab.md"
  (cd "$dir" && PYTHONPATH="$dir:$PYTHONPATH" timeout 100 python3 -c "$grc" bench latency \
     --model builtin:llama-3.2-1b --batch-sizes 1,8,64,256 --context 1024 --modes FULL) >> "$OUT/lat_llama1b_ab.md" 2>&1
  echo "l1b $tree rc=$? $((SECONDS-t0))s"; grep -E 'FULL +bs=' "$OUT/lat_llama1b_ab.md" | tail -4
done
