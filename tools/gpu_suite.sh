#!/usr/bin/env bash
# The GPU checks of a source checkout, run from the repository root on a machine with CUDA GPUs.
#   tools/gpu_suite.sh tests           every test marked gpu (multi-GPU tests skip with fewer GPUs)
#   tools/gpu_suite.sh dist            distributed tests: gloo worlds on the CPU, then NCCL on 2 or 4 GPUs
#   tools/gpu_suite.sh scale [SECONDS] graph modes vs eager over 2,000 hypothesis workloads, real CUDA graphs
#   tools/gpu_suite.sh bench           the single-GPU benchmarks of docs/benchmarks.md (qwen2.5-0.5b)
# Logs, JSON and markdown go under $OUT (default ./out). Every step has a time limit, so a hung
# NCCL world cannot stall the run; the exit status is non-zero if any step failed.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
gr() { local t="$1"; shift; timeout "$t" python3 -m graphrunner "$@"; }
pyt() { local t="$1"; shift; timeout "$t" python3 -m pytest -q -p no:cacheprovider "$@"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpus.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
  "gpus", torch.cuda.device_count())' | tee -a "$OUT/gpus.txt"
rc=0
M=builtin:qwen2.5-0.5b
case "${1:-tests}" in
  tests)
    pyt 1800 -m gpu --hypothesis-profile gpu tests -rs 2>&1 | tee "$OUT/gpu_tests.log" | tail -20 || rc=1
    ;;
  dist)
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
    # The CPU (gloo) suite first: quick, and it catches breakage before NCCL is involved.
    pyt 300 --hypothesis-profile ci tests/distributed/test_dist_engine.py 2>&1 | tee "$OUT/dist_cpu_tests.log" | tail -5 || rc=1
    pyt 1500 -m gpu tests/distributed/test_dist_gpu.py -rs 2>&1 | tee "$OUT/dist_gpu_tests.log" | tail -30 || rc=1
    ;;
  scale)
    # tests/capture/test_graph_modes.py compares NONE, FULL, FULL_DECODE_ONLY, PIECEWISE and
    # FULL_AND_PIECEWISE on the GPU with debug checks on; the `scale` profile runs 2,000
    # workloads per property, and the statistics print the count that ran.
    export GRAPHRUNNER_GRAPH_TEST_DEVICE=cuda
    pyt "${2:-900}" --hypothesis-profile scale --hypothesis-show-statistics tests/capture/test_graph_modes.py \
      -k "all_modes_produce_identical_tokens or poisoned" 2>&1 | tee "$OUT/graph_vs_eager.log" \
      | grep -E "passing|failing|passed|failed|Stopped because" | tail -12 || rc=1
    ;;
  bench)
    gr 600 bench latency --model $M --batch-sizes 1,8,64,256 --context 1024 --modes FULL \
      --json "$OUT/latency.json" --markdown "$OUT/latency.md" 2>&1 | tail -12 || rc=1
    gr 300 bench sampler --num-reqs 1,64,256 --json "$OUT/sampler.json" --markdown "$OUT/sampler.md" 2>&1 \
      | tail -30 || rc=1
    gr 300 bench host --batch-sizes 1,64,256 --json "$OUT/host.json" --markdown "$OUT/host.md" 2>&1 | tail -10 || rc=1
    gr 600 bench capture --model $M --json "$OUT/capture.json" 2>&1 | tail -4 || rc=1
    gr 300 bench throughput --model $M --num-prompts 64 --input-len 128 --output-len 64 \
      --json "$OUT/throughput.json" 2>&1 | tail -12 || rc=1
    ;;
  *)
    echo "usage: tools/gpu_suite.sh tests|dist|scale [SECONDS]|bench" >&2; exit 2
    ;;
esac
exit $rc
