#!/usr/bin/env bash
# Graph vs eager at scale (issue #12): the hypothesis workloads of tests/test_graph_modes.py
# that compare NONE, FULL, FULL_DECODE_ONLY, PIECEWISE and FULL_AND_PIECEWISE, on the GPU
# (real CUDA graphs, debug checks on) with the `scale` profile (2,000 workloads per
# property), then the poisoned-buffer tests. The workload count is in the statistics.
#   tools/graph_vs_eager.sh [SECONDS]        (logs under $OUT)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export GRAPHRUNNER_GRAPH_TEST_DEVICE=cuda
timeout "${1:-560}" python3 -m pytest -q -p no:cacheprovider --hypothesis-profile scale --hypothesis-show-statistics \
  tests/test_graph_modes.py -k "all_modes_produce_identical_tokens or poisoned" 2>&1 \
  | tee "$OUT/graph_vs_eager.log" | grep -E "passing|failing|passed|failed|Stopped because" | tail -12
