#!/usr/bin/env bash
# Written in session 20 for session 21's first two device calls (kind nvidia-h200; an H100 or an H200 both serve:
# say which card each landed on). Issue #17, qwen2.5-0.5b batch 256 >= 55% of roofline: 54.1-54.5% on an H100,
# 42-44% on an H200. From the repository root: OUT=... PART=1 bash docs/bench/next_s21.sh, then PART=2
# (about 330 s and 450 s).
# PART=1:
#  1. GPU tests of session 20's code that never ran on a GPU: the head-major KV cache (GRAPHRUNNER_KV_LAYOUT=HND)
#     and the greedy head's tensor-descriptor kernels (GRAPHRUNNER_GREEDY_HEAD_LOADS=tma|tma_persistent), with
#     memcheck over the second;
#  2. decode attention time against context at 256 rows (decode_fusion/attn_context_s21.py): a fixed cost per
#     launch (intercept) or slow streaming (slope)? It picks the next attention change;
#  3. the greedy head's loads x tiles at 256 / 64 rows (decode_fusion/greedy_head_sweep_s20.py --near), next to cuBLAS.
# PART=2 (set LOADS=tma|tma_persistent and TILES=BM,BN,BK,warps,stages from part 1's winner, if any):
#  4. the whole step head-major vs token-major at batch 1 / 256, interleaved (attention alone: 43.7 -> 42.6 µs on
#     an H200);
#  5. head-major + the greedy head's winner vs the defaults at batch 256, interleaved.
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
source tools/device_env.sh >/dev/null
lat() { timeout 100 python3 -c "$grc" bench latency --model builtin:qwen2.5-0.5b --batch-sizes "$1" --context 1024 \
   --modes FULL; }
if [ "${PART:-1}" = 1 ]; then
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kv_layout.py tests/test_greedy_head.py \
   tests/test_attention_rope.py > "$OUT/gpu_tests.log" 2>&1; echo "tests rc=$? $((SECONDS-t0))s"; tail -1 "$OUT/gpu_tests.log"
timeout 120 compute-sanitizer --tool memcheck python3 -m pytest -q -m gpu -p no:cacheprovider \
   tests/test_greedy_head.py -k "tma and 256" > "$OUT/memcheck_greedy_head.log" 2>&1
echo "memcheck rc=$? $((SECONDS-t0))s"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_greedy_head.log" | tail -2
timeout 100 python3 docs/bench/decode_fusion/attn_context_s21.py --rows 256 > "$OUT/attn_context.txt" 2>&1
echo "context rc=$? $((SECONDS-t0))s"; cat "$OUT/attn_context.txt"
timeout 150 python3 docs/bench/decode_fusion/greedy_head_sweep_s20.py --rows 256,64 --near \
   --loads pointer,tma,tma_persistent > "$OUT/greedy_head_loads.txt" 2>&1
echo "greedy head rc=$? $((SECONDS-t0))s"; cat "$OUT/greedy_head_loads.txt"
else
winner=(GRAPHRUNNER_KV_LAYOUT=HND GRAPHRUNNER_GREEDY_HEAD_LOADS="${LOADS:-pointer}")
[ -n "${TILES:-}" ] && winner+=(GRAPHRUNNER_GREEDY_HEAD_TILES="$TILES")
lat 256 > "$OUT/warmup.md" 2>&1; echo "warm-up rc=$? $((SECONDS-t0))s"  # compiles every kernel once
for layout in HND NHD HND NHD; do
  echo "### GRAPHRUNNER_KV_LAYOUT=$layout" >> "$OUT/lat_layout_ab.md"
  GRAPHRUNNER_KV_LAYOUT=$layout lat 1,256 >> "$OUT/lat_layout_ab.md" 2>&1
  echo "$layout rc=$? $((SECONDS-t0))s"; grep -E '^FULL +(1|256) ' "$OUT/lat_layout_ab.md" | tail -2
done
for combo in winner default winner default; do
  echo "### $combo (winner: ${winner[*]})" >> "$OUT/lat_combo_ab.md"
  if [ $combo = default ]; then lat 256; else (export "${winner[@]}"; lat 256); fi >> "$OUT/lat_combo_ab.md" 2>&1
  echo "$combo rc=$? $((SECONDS-t0))s"; grep -E '^FULL +256 ' "$OUT/lat_combo_ab.md" | tail -1
done
fi
