#!/usr/bin/env bash
# Issue #4 host-time work in one device call: the GPU tests of the touched paths, the
# CUDA call costs, and `bench host` with the driver fast path on and off.
#   tools/host_suite.sh [quick]      (writes logs and JSON under $OUT)
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-out}"; mkdir -p "$OUT"
gr() { timeout "$1" python3 -c 'import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[2:]))' "$@"; }
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda_driver.py tests/test_async_output.py \
  tests/test_runner.py tests/test_async_scheduling.py tests/test_graph_modes.py tests/test_capture_gpu.py 2>&1 | tee "$OUT/gpu_tests_host.log" | tail -6
python3 -m tools.bench.api_costs 2>&1 | tee "$OUT/api_costs.txt"
gr 200 bench host --batch-sizes 1,64,256 --json "$OUT/host_qwen.json" --markdown "$OUT/host_qwen.md" 2>&1 | grep -v "capturing graphs" | tail -8
GRAPHRUNNER_CUDA_DRIVER=0 gr 200 bench host --batch-sizes 1,64,256 --json "$OUT/host_qwen_torch_calls.json" \
  --markdown "$OUT/host_qwen_torch_calls.md" 2>&1 | grep -v "capturing graphs" | tail -8
