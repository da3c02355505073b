#!/usr/bin/env bash
# Distributed GPU tests and benchmark (issues #5, #19), for a 2- or 4-GPU device call.
#   tools/gpu_dist.sh [tests|bench|all]     (default all; logs and JSON under $OUT)
#   tools/gpu_dist.sh tests4                (four-GPU layouts first, then PCP x TP, then TP2 and TP2 x DCP2)
#   tools/gpu_dist.sh bench4                (issue #19's llama-3.1-8b figures: TP1/2/4 latency, throughput)
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
if [[ "$what" == tests4 ]]; then
  nvidia-smi topo -m | tee -a "$OUT/gpu_dist_gpus.txt"
  t=tests/test_dist_gpu.py
  timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider $t::test_four_gpu_layouts_match_one_gpu -rs \
    2>&1 | tee "$OUT/dist_gpu_tests4.log" | tail -15 || rc=1
  timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider "$t::test_prefill_context_parallel_matches_one_gpu" \
    -k pcp2tp2 -rs 2>&1 | tee "$OUT/dist_gpu_tests_pcp2tp2.log" | tail -5 || rc=1
  timeout 80 python3 -m pytest -q -m gpu -p no:cacheprovider "$t::test_two_gpu_layouts_match_one_gpu[tp2]" \
    "$t::test_two_gpu_layouts_match_one_gpu[tp2dcp2]" -rs 2>&1 | tee "$OUT/dist_gpu_tests_tp2.log" | tail -5 || rc=1
fi
if [[ "$what" == bench4 ]]; then
  timeout 590 python3 -m graphrunner_tools.bench.dist_bench --out "$OUT" --timeout 240 \
    --configs "${CONFIGS:-tp1,tp4,tp2pp2,pp4,dp4,tp2}" --batch-sizes 1 --decode-steps 64 \
    --throughput-requests 256 --prompt-len 512 --output-len 256 --num-kv-blocks 13000 \
    2>&1 | grep -v "capturing graphs" | tee "$OUT/dist_bench.log" | tail -40 || rc=1
fi
if [[ "$what" == bench || "$what" == all ]]; then
  timeout 1500 python3 -m graphrunner_tools.bench.dist_bench --out "$OUT" --timeout 420 \
    2>&1 | tee "$OUT/dist_bench.log" | tail -40 || rc=1
fi
exit $rc
