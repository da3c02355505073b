#!/usr/bin/env bash
# compute-sanitizer over the GPU tests of every Triton kernel, then over one FULL-graph replay per
# sampling variant (python -m graphrunner_tools.sanitize_replay). Run from the repository root on
# a CUDA machine with compute-sanitizer on PATH. Logs go under $OUT (default ./out); each run
# prints the tool's summary line ("ERROR SUMMARY: N errors").
#   tools/sanitize.sh [memcheck|racecheck|synccheck|initcheck] [SECONDS]   (default memcheck, 280 s per run)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
tool="${1:-memcheck}"; limit="${2:-280}"
tests=(
  "tests/step/test_block_table.py::test_gpu_triton_matches_torch_large"
  "tests/step/test_input_prep.py::test_gpu_simulation_triton"
  "tests/sample/test_triton_sampling.py::test_gpu_kernels_match_torch_and_capture_in_cuda_graph"
  "tests/spec_decode/test_spec_ngram.py::test_gpu_triton_matches_torch_large"
  "tests/model/test_attention.py::test_gpu_cuda_graph_capture_and_replay"
  "tests/model/test_fused_layer_kernels.py::test_rope_write_kv_native_bf16"
  "tests/model/test_fused_layer_kernels.py::test_add_rms_norm_native_bf16"
  "tests/sample/test_sample_argmax.py::test_gpu_matches_torch_at_scale_and_replays_in_a_cuda_graph"
  "tests/model/test_attention.py::test_gpu_triton_matches_reference"
  "tests/sample/test_fused_process.py::test_native_fused_processing_matches_torch_and_replays_in_a_cuda_graph"
  "tests/sample/test_logprobs_triton.py::test_gpu_matches_torch_at_scale_and_replays_in_a_cuda_graph"
  "tests/sample/test_bitmask.py::test_gpu_kernel_matches_and_replays_in_a_cuda_graph"
  "tests/sample/test_sample_select.py::test_gpu_full_vocab_graph_replay_is_deterministic_and_exact_for_min_p_top_k"
  "tests/sample/test_sample_select.py::test_gpu_flat_full_vocab_rows_are_refined_and_draw_the_fallbacks_tokens"
)
san() { timeout "$limit" compute-sanitizer --tool "$tool" --target-processes all --print-limit 20 "$@"; }
san python3 -m pytest -q -m gpu -p no:cacheprovider --hypothesis-profile ci "${tests[@]}" \
  > "$OUT/sanitize_${tool}_kernels.log" 2>&1
echo "kernels rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitize_${tool}_kernels.log" | tail -3
san python3 -m graphrunner_tools.sanitize_replay > "$OUT/sanitize_${tool}_replay.log" 2>&1
echo "replay rc=$?"; grep -E "ERROR SUMMARY|replayed|never" "$OUT/sanitize_${tool}_replay.log" | tail -3
