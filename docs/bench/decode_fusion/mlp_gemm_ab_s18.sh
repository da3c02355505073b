#!/usr/bin/env bash
# Session 18, call 2: the batched MLP GEMMs (layers/mlp_gemm.py, mlp_block.py): GPU tests, memcheck,
# the kernel sweep, and in-model latency with GRAPHRUNNER_MLP_GEMM=1 / 0 interleaved.
set -uo pipefail
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
source tools/device_env.sh >/dev/null
t0=$SECONDS
T=$OUT/gpu_tests_mlp.log
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_mlp_gemm.py tests/test_hf_e2e.py > "$T" 2>&1
echo "tests rc=$? $((SECONDS-t0))s"; grep -E "passed|failed|Error" "$T" | tail -4
timeout 70 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_mlp_gemm.py -k "bf16_mlp_gemms" >> "$T" 2>&1
echo "memcheck rc=$? $((SECONDS-t0))s"; grep -E "ERROR SUMMARY|passed|failed" "$T" | tail -2
timeout 140 python3 docs/bench/decode_fusion/mlp_gemm_s18.py 256 64 > "$OUT/mlp_gemm_sweep.txt" 2>&1
echo "sweep rc=$? $((SECONDS-t0))s"
LOG=$OUT/lat_mlp_ab.md; : > "$LOG"
lat() { echo "### $1 MLP_GEMM=$2" >> "$LOG"; GRAPHRUNNER_MLP_GEMM=$2 timeout 90 python3 -c "$grc" bench latency \
  --model builtin:$1 --batch-sizes ${BS:-64,256} --context 1024 --modes FULL >> "$LOG" 2>&1
  echo "$1 MLP_GEMM=$2 rc=$? $((SECONDS-t0))s"; grep -E '^FULL +[0-9]+ ' "$LOG" | tail -${NB:-2}; }
for rep in 1 2; do for k in 1 0; do lat qwen2.5-0.5b $k; done; done
for k in 1 0; do BS=256 NB=1 lat llama-3.2-1b $k; done
GRAPHRUNNER_PDL=0 timeout 60 python3 -c "$grc" bench kernels --batch-sizes 256 --top 12 > "$OUT/kernels_mlp.md" 2>&1
echo "kernels rc=$? $((SECONDS-t0))s"; grep -E "ms/step|_kernel|nvjet" "$OUT/kernels_mlp.md" | head -16
