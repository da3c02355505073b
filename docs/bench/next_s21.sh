#!/usr/bin/env bash
# Written in session 20 for session 21's first device call (kind nvidia-h200; H100 or H200 both useful: say
# which card it landed on). Issue #17, qwen2.5-0.5b batch 256 >= 55% of roofline: 54.1-54.5% on an H100,
# 42-44% on an H200. Run from the repository root: OUT=... bash docs/bench/next_s21.sh (about 520 s).
#  1. GPU tests of the head-major KV cache (GRAPHRUNNER_KV_LAYOUT=HND, session 20: not yet run natively);
#  2. decode attention time against context at 256 rows (decode_fusion/attn_context_s21.py): a fixed cost per
#     launch (intercept) or slow streaming (slope)? It picks the next attention change;
#  3. the whole step head-major vs token-major, interleaved (attention alone: 43.7 -> 42.6 µs on an H200);
#  4. both with the greedy LM head at 256 rows on 4 stages instead of 3 (H100 sweep: 153.8 -> 150.0 µs), interleaved
#     with the defaults. The first run of each tree compiles: a warm-up run comes first.
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
source tools/device_env.sh >/dev/null
lat() { timeout 100 python3 -c "$grc" bench latency --model builtin:qwen2.5-0.5b --batch-sizes "$1" --context 1024 \
   --modes FULL; }
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kv_layout.py tests/test_attention_rope.py \
   tests/test_hf_e2e.py > "$OUT/gpu_tests.log" 2>&1; echo "tests rc=$? $((SECONDS-t0))s"; tail -1 "$OUT/gpu_tests.log"
timeout 100 python3 docs/bench/decode_fusion/attn_context_s21.py --rows 256 > "$OUT/attn_context.txt" 2>&1
echo "context rc=$? $((SECONDS-t0))s"; cat "$OUT/attn_context.txt"
lat 256 > "$OUT/warmup.md" 2>&1; echo "warm-up rc=$? $((SECONDS-t0))s"  # compiles every kernel once (call 8 lost a run)
for layout in HND NHD HND NHD; do
  echo "### GRAPHRUNNER_KV_LAYOUT=$layout" >> "$OUT/lat_layout_ab.md"
  GRAPHRUNNER_KV_LAYOUT=$layout lat 1,256 >> "$OUT/lat_layout_ab.md" 2>&1
  echo "$layout rc=$? $((SECONDS-t0))s"; grep -E '^FULL +(1|256) ' "$OUT/lat_layout_ab.md" | tail -2
done
for combo in both default both default; do  # the two together (the H100 is 0.5-0.9 points short of 55%)
  echo "### $combo (both: GRAPHRUNNER_KV_LAYOUT=HND GRAPHRUNNER_GREEDY_HEAD_TILES=128,256,64,8,4)" >> "$OUT/lat_combo_ab.md"
  if [ $combo = default ]; then lat 256; else GRAPHRUNNER_KV_LAYOUT=HND GRAPHRUNNER_GREEDY_HEAD_TILES=128,256,64,8,4 lat 256; fi \
     >> "$OUT/lat_combo_ab.md" 2>&1
  echo "$combo rc=$? $((SECONDS-t0))s"; grep -E '^FULL +256 ' "$OUT/lat_combo_ab.md" | tail -1
done
