#!/usr/bin/env bash
# Written in session 19 for session 20's first device call (kind nvidia-h200; say which card it landed on).
# Two calls of under 600 s each, from the repository root: OUT=... PART=1 bash docs/bench/next_h200_s20.sh, then PART=2.
# PART=1: items 0, 1 and the kernel table and TBO probe of 2; PART=2: the attention sweep and the greedy head sweep.
#  0. GPU tests session 19 changed but could not rerun: test_sample_argmax (both combine paths, one-chunk rows),
#     test_norm_linear (the wide-memory plan's identity projection);
#  1. issue #16: does the in-launch argmax combine slow a batch-1 step? qwen2.5-0.5b batch 1 with
#     GRAPHRUNNER_ARGMAX_COMBINE_LAST=1 / 0 / 1 / 0 (session 19 saw 0.697 ms with it on, 0.647-0.659 without, not
#     interleaved), then the greedy sampler rows in-graph, 1 / 0;
#  2. issue #17 batch 256 on an H200 (44% of roofline, target 55%): the attention plans at 256 rows (the sweep needs
#     more than the 90 s session 19 gave it), the kernel table of that step, and the two-batch overlap probe
#     (decode_fusion/tbo_probe_s20.py: full batch vs two halves on one stream vs two halves on two streams), and the
#     greedy LM head's tile sweep at 256 / 64 rows (decode_fusion/greedy_head_sweep_s20.py; 143 µs a step there).
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
source tools/device_env.sh >/dev/null
if [ "${PART:-1}" = 1 ]; then
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sample_argmax.py tests/test_norm_linear.py \
   > "$OUT/gpu_tests_s20.log" 2>&1; echo "tests rc=$? $((SECONDS-t0))s"; tail -1 "$OUT/gpu_tests_s20.log"
for on in 1 0 1 0; do
  echo "### GRAPHRUNNER_ARGMAX_COMBINE_LAST=$on" >> "$OUT/lat_combine_ab.md"
  GRAPHRUNNER_ARGMAX_COMBINE_LAST=$on timeout 60 python3 -c "$grc" bench latency --model builtin:qwen2.5-0.5b \
     --batch-sizes 1 --context 1024 --modes FULL >> "$OUT/lat_combine_ab.md" 2>&1
  echo "combine_last=$on rc=$? $((SECONDS-t0))s"; grep -E '^FULL +1 ' "$OUT/lat_combine_ab.md" | tail -1
done
for on in 1 0; do
  echo "### GRAPHRUNNER_ARGMAX_COMBINE_LAST=$on" >> "$OUT/sampler_combine_ab.md"
  GRAPHRUNNER_ARGMAX_COMBINE_LAST=$on timeout 40 python3 -c "$grc" bench sampler --num-reqs 1,256 --variants greedy \
     >> "$OUT/sampler_combine_ab.md" 2>&1; grep -E '\| graph \|' "$OUT/sampler_combine_ab.md" | tail -2
done
GRAPHRUNNER_PDL=0 timeout 90 python3 -c "$grc" bench kernels --model builtin:qwen2.5-0.5b --batch-sizes 256 \
   > "$OUT/kernels_qwen256_h200.md" 2>&1; echo "kernels rc=$? $((SECONDS-t0))s"; grep -A14 "kernel (top" "$OUT/kernels_qwen256_h200.md"
timeout 150 python3 docs/bench/decode_fusion/tbo_probe_s20.py --rows 256 --context 1024 > "$OUT/tbo_probe_h200.txt" 2>&1
echo "tbo probe rc=$? $((SECONDS-t0))s"; cat "$OUT/tbo_probe_h200.txt"
else
timeout 240 python3 -m graphrunner_tools.bench.attn_sweep --rope --batch-sizes 256 > "$OUT/attn_sweep_256_h200.txt" 2>&1
echo "attn sweep rc=$? $((SECONDS-t0))s"; head -20 "$OUT/attn_sweep_256_h200.txt"
timeout 200 python3 docs/bench/decode_fusion/greedy_head_sweep_s20.py --rows 256,64 > "$OUT/greedy_head_sweep_h200.txt" 2>&1
echo "greedy head sweep rc=$? $((SECONDS-t0))s"; cat "$OUT/greedy_head_sweep_h200.txt"
fi
