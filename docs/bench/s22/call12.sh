#!/usr/bin/env bash
# Session 22, call 12. The decode attention launch with its first key block issued before the rotary work and the
# KV write (full first block, the partial block last: the first block is traffic during the prologue), against
# `.s22gpu/base` (git archive dc9a2cc graphrunner): the per-program timeline (256 / 64 / 1 rows); unless
# PART=timeline, the qwen2.5-0.5b step at batch 1 / 64 / 256, interleaved.
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
source tools/device_env.sh >/dev/null
root=$PWD
s=$root/docs/bench/decode_fusion/attn_timeline_s22.py
for rows in 256 64 1; do
  for tree in new base; do
    dir=$root; [ $tree = base ] && dir=$root/.s22gpu/base
    timeout 60 python3 $s --name "$tree-rows$rows" --tree "$dir" --rows $rows >> "$OUT/timeline.txt" 2>&1
  done
done
echo "timeline $((SECONDS-t0))s"; grep -E "^## .*rep 0|median" "$OUT/timeline.txt" | head -24
[ "${PART:-}" = timeline ] && exit 0
for tree in new base new base; do
  dir=$root; [ $tree = base ] && dir=$root/.s22gpu/base
  echo "### $tree" >> "$OUT/lat_qwen_ab.md"
  (cd "$dir" && PYTHONPATH="$dir:$PYTHONPATH" timeout 100 python3 -c "$grc" bench latency \
     --model builtin:qwen2.5-0.5b --batch-sizes 1,64,256 --context 1024 --modes FULL) >> "$OUT/lat_qwen_ab.md" 2>&1
  echo "$tree rc=$? $((SECONDS-t0))s"; grep -E 'FULL +bs=' "$OUT/lat_qwen_ab.md" | tail -3
done
