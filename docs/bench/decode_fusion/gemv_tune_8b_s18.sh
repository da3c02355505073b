#!/usr/bin/env bash
# Session 18, call 4: llama-3.1-8b batch 1 (78.4% of roofline on an H200 in call 3): the GEMV sweep on its shapes,
# then this tree vs a copy whose gemv_plan takes each shape's winner, interleaved.
set -uo pipefail
root=$PWD; TUNED=$root/.tuned
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
rm -rf "$TUNED"; mkdir -p "$TUNED"; cp -r graphrunner capture tools pyproject.toml "$TUNED"/
source tools/device_env.sh >/dev/null
TUNED=$TUNED timeout 150 python3 docs/bench/decode_fusion/gemv_tune_8b_s18.py > "$OUT/gemv_tune_8b.txt" 2>&1; echo "sweep rc=$? $((SECONDS-t0))s"
cat "$OUT/gemv_tune_8b.txt"
LOG=$OUT/lat_8b_tuned.md; : > "$LOG"
for rep in 1 2; do for side in main tuned; do dir=$root; [ $side = tuned ] && dir=$TUNED
  (cd "$dir" && source tools/device_env.sh >/dev/null && echo "### llama-3.1-8b $side" >> "$LOG" && timeout 70 python3 -c "$grc" \
   bench latency --model builtin:llama-3.1-8b --batch-sizes 1 --context 1024 --modes FULL >> "$LOG" 2>&1
   echo "$side rc=$? $((SECONDS-t0))s"; grep -E '^FULL +1 ' "$LOG" | tail -1); done; done
