#!/usr/bin/env bash
# Session 22, call 10: where call 9's split-K gain went: `bench kernels` of the qwen2.5-0.5b step at batch 8 / 256,
# this tree vs `.s22gpu/base`.
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
source tools/device_env.sh >/dev/null
root=$PWD
for tree in new base; do
  dir=$root; [ $tree = base ] && dir=$root/.s22gpu/base
  (cd "$dir" && PYTHONPATH="$dir:$PYTHONPATH" timeout 150 python3 -c "$grc" bench kernels \
     --model builtin:qwen2.5-0.5b --batch-sizes 8,256 --context 1024 --modes FULL --top 20 \
     --markdown "$OUT/kernels_qwen_$tree.md") > "$OUT/kernels_$tree.log" 2>&1
  echo "$tree rc=$? $((SECONDS-t0))s"
done
cat "$OUT/kernels_qwen_new.md" "$OUT/kernels_qwen_base.md" | grep -v "^$" | head -150
