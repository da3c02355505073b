#!/usr/bin/env bash
# Device A/B for branch s15-swiglu (the MLP's down projection as graphrunner::swiglu_linear: the
# SwiGLU GEMV at one row, one Triton SiLU·mul + cuBLAS above). Run from the repository root with
# the branch's tree checked out and main's tree unpacked in "$BEFORE"
# (git archive main graphrunner capture tools pyproject.toml | tar -x -C "$BEFORE").
set -uo pipefail
root=$PWD
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
source tools/device_env.sh >/dev/null
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_linear.py tests/test_pdl.py \
    tests/test_hf_e2e.py > "$OUT/gpu_tests_swiglu.log" 2>&1
echo "tests rc=$?"; tail -1 "$OUT/gpu_tests_swiglu.log"
for side in after before after before; do
  dir=$root; [ "$side" = before ] && dir=$BEFORE
  (cd "$dir" && source tools/device_env.sh >/dev/null && timeout 150 python3 -c "$grc" bench latency \
      --model builtin:qwen2.5-0.5b --batch-sizes 1,8,64,256 --context 1024 --modes FULL \
      > "$OUT/lat_qwen_$side.md" 2>&1; echo "$side rc=$?"; grep -E '^FULL +[0-9]+ ' "$OUT/lat_qwen_$side.md")
done
GRAPHRUNNER_PDL=0 timeout 150 python3 -c "$grc" bench kernels --batch-sizes 1,256 --top 12 > "$OUT/kernels_swiglu.md" 2>&1
grep -E "ms/step|_gemv|silu|_silu_mul" "$OUT/kernels_swiglu.md"
