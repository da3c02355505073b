#!/usr/bin/env bash
# Written in session 18 for session 19's first device call (kind nvidia-h200; check which card it lands on and say so).
# The H200-specific questions left open by session 18 (docs/bench/README.md, "Session 18"), in one call:
#  1. qwen2.5-0.5b / llama-3.2-1b one-row GEMVs: sweep + batch 1 / 8 A/B against a tuned copy (issue #17, qwen batch 1
#     0.766 ms on an H200 against the 0.7 target);
#  2. decode attention launch plans at 64 / 256 rows (qwen batch 256: attention 45 µs a layer, ~70% of the KV floor);
#  3. the greedy argmax's launch grid at 256 / 64 rows (issue #16: 49.1 µs against the 40 µs target, floor 37.8).
# Run from the repository root: OUT=... bash docs/bench/next_h200_s19.sh
set -uo pipefail
t0=$SECONDS
# 0. The landed wide-memory GEMV plan on this card (test_decode_linear's GPU shapes include N >= K >= 4096).
(source tools/device_env.sh >/dev/null && timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider \
   tests/test_decode_linear.py tests/test_hf_e2e.py > "$OUT/gpu_tests_s19.log" 2>&1; echo "tests rc=$?"; tail -1 "$OUT/gpu_tests_s19.log")
OUT=$OUT bash docs/bench/decode_fusion/gemv_tune_small_s19.sh
source tools/device_env.sh >/dev/null
timeout 120 python3 -m graphrunner_tools.bench.attn_sweep --rope --batch-sizes 64,256 > "$OUT/attn_sweep_h200.txt" 2>&1
echo "attn sweep rc=$? $((SECONDS-t0))s"; head -20 "$OUT/attn_sweep_h200.txt"
timeout 100 python3 docs/bench/sampler_s17/argmax_sweep.py --rows 256,64 > "$OUT/argmax_sweep_h200.txt" 2>&1
echo "argmax sweep rc=$? $((SECONDS-t0))s"; head -24 "$OUT/argmax_sweep_h200.txt"
# 4. Branch s18-merge1pass (the split-KV merge in one pass): MERGE1PASS=<folder with `git archive s18-merge1pass
#    graphrunner capture tools pyproject.toml` unpacked>; qwen batch 1 / 8, main / branch / main / branch.
if [ -n "${MERGE1PASS:-}" ]; then
  grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'; root=$PWD; LOG=$OUT/lat_merge1pass.md
  for rep in 1 2; do for dir in "$root" "$MERGE1PASS"; do
    (cd "$dir" && source tools/device_env.sh >/dev/null && echo "### qwen2.5-0.5b $(basename $dir)" >> "$LOG" && timeout 60 \
     python3 -c "$grc" bench latency --model builtin:qwen2.5-0.5b --batch-sizes 1,8 --context 1024 --modes FULL >> "$LOG" 2>&1
     echo "merge1pass $(basename $dir) rc=$? $((SECONDS-t0))s"; grep -E '^FULL +[0-9]+ ' "$LOG" | tail -2)
  done; done
fi
# 5. Branch s18-mergegemv (the split-KV merge folded into the o GEMV at one row; not wired into the model):
#    MERGEGEMV=<folder with `git archive s18-mergegemv graphrunner capture tools pyproject.toml tests docs/bench`>;
#    its GPU test, then the isolated timing that decides whether the op plumbing is worth building.
if [ -n "${MERGEGEMV:-}" ]; then
  (cd "$MERGEGEMV" && source tools/device_env.sh >/dev/null && timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider \
     tests/test_merge_gemv.py 2>&1 | tail -2 && timeout 120 python3 docs/bench/decode_fusion/merge_gemv_s19.py \
     > "$OUT/merge_gemv_h200.txt" 2>&1; echo "merge_gemv rc=$? $((SECONDS-t0))s"; cat "$OUT/merge_gemv_h200.txt")
fi
