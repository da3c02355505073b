#!/usr/bin/env bash
# Session 21, call 11 (kind nvidia-h200), H200 only (exits at once elsewhere): the two attention ideas that lost on
# an H100 (where the launch already streams at 96% of copy bandwidth) but might win where more bytes must be in
# flight per SM: (1) attn_occupancy_s21.py (KV splits x register cap); (2) the block-id prefetch (165aa80,
# `.s21gpu/prefetch`) vs this tree, the launch alone vs context at 256 / 64 rows, interleaved.
set -uo pipefail
t0=$SECONDS; gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
case "$gpu" in *H200*) ;; *) echo "not an H200: nothing run"; exit 0;; esac
source tools/device_env.sh >/dev/null
root=$PWD
timeout 150 python3 docs/bench/decode_fusion/attn_occupancy_s21.py > "$OUT/attn_occupancy.txt" 2>&1
echo "occupancy rc=$? $((SECONDS-t0))s"; cat "$OUT/attn_occupancy.txt"
for tree in prefetch main prefetch main; do
  dir=$root; [ $tree = prefetch ] && dir=$root/.s21gpu/prefetch
  for rows in 256 64; do
    echo "### $tree rows $rows" >> "$OUT/attn_prefetch_ab.txt"
    (cd "$dir" && PYTHONPATH="$dir:$PYTHONPATH" timeout 60 python3 "$root/docs/bench/decode_fusion/attn_context_s21.py" \
       --rows $rows --shapes qwen) >> "$OUT/attn_prefetch_ab.txt" 2>&1
  done
  echo "attn $tree rc=$? $((SECONDS-t0))s"; grep -E "^14/2x64 rope" "$OUT/attn_prefetch_ab.txt" | tail -2
done
