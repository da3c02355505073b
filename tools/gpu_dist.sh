#!/usr/bin/env bash
# Distributed GPU tests and benchmark (issue #5), for a 2- or 4-GPU device call.
#   tools/gpu_dist.sh [tests|bench|all]     (default all; logs and JSON under $OUT)
# Every step has a time limit, so a hung NCCL world cannot eat the device budget.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu_dist_gpus.txt"
python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())' | tee -a "$OUT/gpu_dist_gpus.txt"
what="${1:-all}"
rc=0
if [[ "$what" == tests || "$what" == all ]]; then
  # The CPU (gloo) suite first: quick, and it catches breakage before NCCL is involved.
  timeout 300 python3 -m pytest -q -p no:cacheprovider --hypothesis-profile ci tests/test_dist_engine.py \
    2>&1 | tee "$OUT/dist_cpu_tests.log" | tail -5 || rc=1
  timeout 1500 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_dist_gpu.py -x -rs \
    2>&1 | tee "$OUT/dist_gpu_tests.log" | tail -30 || rc=1
fi
if [[ "$what" == bench || "$what" == all ]]; then
  timeout 1500 python3 -m graphrunner_tools.bench.dist_bench --out "$OUT" --timeout 420 \
    2>&1 | tee "$OUT/dist_bench.log" | tail -40 || rc=1
fi
exit $rc
