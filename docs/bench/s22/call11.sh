#!/usr/bin/env bash
# Session 22, call 11 (experiment): FULL graphs capturing the eager module (GRAPHRUNNER_FULL_EAGER=1, a temporary
# switch) so that split-K's per-size choice applies, vs the compiled body (split-K inert there) vs `.s22gpu/base`.
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
source tools/device_env.sh >/dev/null
root=$PWD
for tree in eager compiled base eager compiled base; do
  dir=$root; [ $tree = base ] && dir=$root/.s22gpu/base
  fe=0; [ $tree = eager ] && fe=1
  echo "### $tree" >> "$OUT/lat_qwen_eager_ab.md"
  (cd "$dir" && GRAPHRUNNER_FULL_EAGER=$fe PYTHONPATH="$dir:$PYTHONPATH" timeout 100 python3 -c "$grc" bench latency \
     --model builtin:qwen2.5-0.5b --batch-sizes 1,8,64,256 --context 1024 --modes FULL) >> "$OUT/lat_qwen_eager_ab.md" 2>&1
  echo "$tree rc=$? $((SECONDS-t0))s"; grep -E 'FULL +bs=' "$OUT/lat_qwen_eager_ab.md" | tail -4
done
