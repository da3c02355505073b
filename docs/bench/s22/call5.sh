#!/usr/bin/env bash
# Session 22, call 5: H200 only (exits at once elsewhere). The decode attention on the machine: the
# per-program timeline (attn_timeline_s22.py) of this tree and of the block-id prefetch (165aa80, in
# .s21gpu/prefetch); then session 21's call 11 (KV splits x register cap sweep; prefetch vs this tree, launch vs
# context at 256 / 64 rows, interleaved).
set -uo pipefail
t0=$SECONDS; gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
case "$gpu" in *H200*) ;; *) echo "not an H200: nothing run"; exit 0;; esac
source tools/device_env.sh >/dev/null
root=$PWD
s=$root/docs/bench/decode_fusion/attn_timeline_s22.py
for rows in 256 64; do
  for tree in main prefetch; do
    dir=$root; [ $tree = prefetch ] && dir=$root/.s21gpu/prefetch
    timeout 60 python3 $s --name "$tree-rows$rows" --tree "$dir" --rows $rows >> "$OUT/timeline.txt" 2>&1
  done
done
echo "timeline $((SECONDS-t0))s"; grep -E "^## .*rep 0|median" "$OUT/timeline.txt" | head -16
OUT="$OUT" bash docs/bench/s21/call11.sh
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
timeout 120 python3 -c "$grc" bench latency --model builtin:qwen2.5-0.5b --batch-sizes 1,8,64,256 --context 1024 \
  --modes FULL > "$OUT/lat_qwen_issue17.md" 2>&1; echo "qwen rc=$? $((SECONDS-t0))s"; grep -E 'FULL +bs=' "$OUT/lat_qwen_issue17.md"
