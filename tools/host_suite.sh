#!/usr/bin/env bash
# Issue #4 host-time figures in one device call (about 6 minutes): the CUDA call costs,
# then `bench host` with the defaults (driver fast path, output copy stream), with the
# copies on the compute stream, and with torch's CUDA calls. Run the GPU tests in a
# call of their own (`pytest -m gpu tests`, about 5 minutes).
#   tools/host_suite.sh            (writes logs and JSON under $OUT)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
gr() { timeout "$1" python3 -c 'import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[2:]))' "$@"; }
python3 -m graphrunner_tools.bench.api_costs 2>&1 | tee "$OUT/api_costs.txt" | tail -15
gr 170 bench host --batch-sizes 1,64,256 --json "$OUT/host_qwen.json" --markdown "$OUT/host_qwen.md" 2>&1 \
  | grep -v "capturing graphs" | tail -8
GRAPHRUNNER_OUTPUT_COPY_STREAM=0 gr 150 bench host --batch-sizes 1,64,256 --settle-s 5 \
  --json "$OUT/host_qwen_compute_stream_copy.json" --markdown "$OUT/host_qwen_compute_stream_copy.md" 2>&1 \
  | grep -v "capturing graphs" | tail -8
GRAPHRUNNER_CUDA_DRIVER=0 gr 150 bench host --batch-sizes 1,64,256 --settle-s 5 --json "$OUT/host_qwen_torch_calls.json" \
  --markdown "$OUT/host_qwen_torch_calls.md" 2>&1 | grep -v "capturing graphs" | tail -8
