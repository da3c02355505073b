#!/usr/bin/env bash
# Written in session 18 for the next session's first device call (kind nvidia-h200; check the card it lands on):
# the one-row GEMV sweep on qwen2.5-0.5b / llama-3.2-1b shapes, then batch 1 (and 8) on this tree vs the tuned copy,
# interleaved. Run from the repository root.
set -uo pipefail
root=$PWD; TUNED=$root/.tuned
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
rm -rf "$TUNED"; mkdir -p "$TUNED"; cp -r graphrunner capture tools pyproject.toml "$TUNED"/
source tools/device_env.sh >/dev/null
TUNED=$TUNED timeout 240 python3 docs/bench/decode_fusion/gemv_tune_small_s19.py > "$OUT/gemv_tune_small.txt" 2>&1
echo "sweep rc=$? $((SECONDS-t0))s"; cat "$OUT/gemv_tune_small.txt"
LOG=$OUT/lat_small_tuned.md; : > "$LOG"
for model in qwen2.5-0.5b llama-3.2-1b; do for rep in 1 2; do for side in main tuned; do
  dir=$root; [ $side = tuned ] && dir=$TUNED
  (cd "$dir" && source tools/device_env.sh >/dev/null && echo "### $model $side" >> "$LOG" && timeout 60 python3 -c "$grc" \
   bench latency --model builtin:$model --batch-sizes 1,8 --context 1024 --modes FULL >> "$LOG" 2>&1
   echo "$model $side rc=$? $((SECONDS-t0))s"; grep -E '^FULL +[0-9]+ ' "$LOG" | tail -2)
done; done; done
