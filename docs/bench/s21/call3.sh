#!/usr/bin/env bash
# Session 21, call 3 (kind nvidia-h200; say which card it landed on). Issue #17, qwen2.5-0.5b batch 256.
#  1. GPU tests of the rope_kv attention change (new keys from registers, no barrier; e63ea9b) and of the
#     head-major cache, with memcheck over the rope test;
#  2. the attention launch alone, this tree vs `.s21gpu/base` (9e48bda: the same but the old rope_kv launch),
#     time vs context at 256 and 64 rows, interleaved (decode_fusion/attn_context_s21.py);
#  3. the whole step, qwen2.5-0.5b batch 1 / 64 / 256, interleaved: new = this tree with GRAPHRUNNER_KV_LAYOUT=HND,
#     s20 = `.s21gpu/s20` (9253102, session 20's last tree, its defaults), old-attn = `.s21gpu/base` with HND.
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
source tools/device_env.sh >/dev/null
root=$PWD
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_rope.py tests/test_kv_layout.py \
   tests/test_attention.py > "$OUT/gpu_tests.log" 2>&1; echo "tests rc=$? $((SECONDS-t0))s"; tail -1 "$OUT/gpu_tests.log"
timeout 100 compute-sanitizer --tool memcheck python3 -m pytest -q -m gpu -p no:cacheprovider \
   tests/test_attention_rope.py -k "hk0" > "$OUT/memcheck_rope.log" 2>&1
echo "memcheck rc=$? $((SECONDS-t0))s"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_rope.log" | tail -2
tree_dir() { case $1 in s20) echo "$root/.s21gpu/s20";; old-attn) echo "$root/.s21gpu/base";; *) echo "$root";; esac; }
for tree in new old-attn new old-attn; do
  dir=$(tree_dir $tree)
  for rows in 256 64; do
    echo "### $tree rows $rows" >> "$OUT/attn_ab.txt"
    (cd "$dir" && PYTHONPATH="$dir:$PYTHONPATH" timeout 60 python3 "$root/docs/bench/decode_fusion/attn_context_s21.py" \
       --rows $rows) >> "$OUT/attn_ab.txt" 2>&1
  done
  echo "attn $tree rc=$? $((SECONDS-t0))s"; grep -E "^14/2x64 rope" "$OUT/attn_ab.txt" | tail -2
done
for tree in new s20 old-attn new s20 old-attn; do
  dir=$(tree_dir $tree); layout=HND; [ $tree = s20 ] && layout=NHD
  echo "### $tree (GRAPHRUNNER_KV_LAYOUT=$layout)" >> "$OUT/lat_qwen_ab.md"
  (cd "$dir" && PYTHONPATH="$dir:$PYTHONPATH" GRAPHRUNNER_KV_LAYOUT=$layout timeout 110 python3 -c "$grc" bench latency \
     --model builtin:qwen2.5-0.5b --batch-sizes 1,64,256 --context 1024 --modes FULL) >> "$OUT/lat_qwen_ab.md" 2>&1
  echo "$tree rc=$? $((SECONDS-t0))s"; grep -E '^FULL +(1|64|256) ' "$OUT/lat_qwen_ab.md" | tail -3
done
