#!/usr/bin/env bash
# Session 21, call 9 (kind nvidia-h200): the block-id prefetch (165aa80, two K / V buffers) measured slower on an
# H100 (call 7); on an H200, whose bandwidth wants more bytes in flight per SM, it might not be. Runs only on an
# H200 (exits at once on an H100): this tree vs `.s21gpu/prefetch` (165aa80's graphrunner), the launch vs
# context at 256 / 64 rows, then the qwen2.5-0.5b step at batch 64 / 256, interleaved.
set -uo pipefail
t0=$SECONDS; gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
case "$gpu" in *H200*) ;; *) echo "not an H200: nothing run"; exit 0;; esac
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
source tools/device_env.sh >/dev/null
root=$PWD
for tree in prefetch main prefetch main; do
  dir=$root; [ $tree = prefetch ] && dir=$root/.s21gpu/prefetch
  for rows in 256 64; do
    echo "### $tree rows $rows" >> "$OUT/attn_ab.txt"
    (cd "$dir" && PYTHONPATH="$dir:$PYTHONPATH" timeout 60 python3 "$root/docs/bench/decode_fusion/attn_context_s21.py" \
       --rows $rows --shapes qwen) >> "$OUT/attn_ab.txt" 2>&1
  done
  echo "attn $tree rc=$? $((SECONDS-t0))s"; grep -E "^14/2x64 rope" "$OUT/attn_ab.txt" | tail -2
done
for tree in prefetch main prefetch main; do
  dir=$root; [ $tree = prefetch ] && dir=$root/.s21gpu/prefetch
  echo "### $tree" >> "$OUT/lat_qwen_ab.md"
  (cd "$dir" && PYTHONPATH="$dir:$PYTHONPATH" timeout 90 python3 -c "$grc" bench latency \
     --model builtin:qwen2.5-0.5b --batch-sizes 64,256 --context 1024 --modes FULL) >> "$OUT/lat_qwen_ab.md" 2>&1
  echo "$tree rc=$? $((SECONDS-t0))s"; grep -E '^FULL +(64|256) ' "$OUT/lat_qwen_ab.md" | tail -2
done
