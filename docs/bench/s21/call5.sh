#!/usr/bin/env bash
# Session 21, call 5 (kind nvidia-h200): issue #17's benchmark for llama-3.2-1b and llama-3.1-8b, this tree
# against `.s21gpu/s20` (9253102), after / before, and the batch-1 graph's nodes per layer (qwen2.5-0.5b).
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
source tools/device_env.sh >/dev/null
root=$PWD
timeout 60 python3 -c "$grc" inspect capture --model builtin:qwen2.5-0.5b --device cuda \
   --cudagraph-mode FULL_DECODE_ONLY --capture-sizes 1 > "$OUT/inspect_nodes_qwen.txt" 2>&1
echo "inspect rc=$? $((SECONDS-t0))s"; grep -iE "per layer|nodes" "$OUT/inspect_nodes_qwen.txt" | head -3
for model in llama-3.2-1b llama-3.1-8b; do
  for tree in after before; do
    dir=$root; [ $tree = before ] && dir=$root/.s21gpu/s20
    echo "### $model $tree" >> "$OUT/lat_llama_issue17.md"
    (cd "$dir" && PYTHONPATH="$dir:$PYTHONPATH" timeout 150 python3 -c "$grc" bench latency \
       --model builtin:$model --batch-sizes 1,8,64,256 --context 1024 --modes FULL) >> "$OUT/lat_llama_issue17.md" 2>&1
    echo "$model $tree rc=$? $((SECONDS-t0))s"; grep -E '^FULL +(1|8|64|256) ' "$OUT/lat_llama_issue17.md" | tail -4
  done
done
