#!/usr/bin/env bash
# Issue #17's benchmark in one device call: `bench latency --batch-sizes 1,8,64,256 --context 1024 --modes FULL`
# on the three built-in models, a "before" tree and this tree interleaved, then the batch-1 graph's nodes
# per layer. BEFORE=<folder with `git archive REV graphrunner capture tools pyproject.toml` unpacked>.
# Written in session 16 (before = 316f5c3, the session's start) for the next session's device time.
set -uo pipefail
root=$PWD; BEFORE=${BEFORE:?unpack the before tree and set BEFORE}
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
t0=$SECONDS
LOG=$OUT/lat_issue17_ab.md; : > "$LOG"
for model in qwen2.5-0.5b llama-3.2-1b llama-3.1-8b; do
  for side in after before; do
    dir=$root; [ "$side" = before ] && dir=$BEFORE
    (cd "$dir" && source tools/device_env.sh >/dev/null && echo "### $model $side" >> "$LOG" && timeout ${LAT_TIMEOUT:-150} \
      python3 -c "$grc" bench latency --model "builtin:$model" --batch-sizes 1,8,64,256 --context 1024 \
      --modes FULL >> "$LOG" 2>&1; echo "$model $side rc=$? $((SECONDS-t0))s"; grep -E '^FULL +[0-9]+ ' "$LOG" | tail -4)
  done
done
source tools/device_env.sh >/dev/null
timeout 60 python3 -c "$grc" inspect capture --model builtin:qwen2.5-0.5b --device cuda \
  --cudagraph-mode FULL_DECODE_ONLY --capture-sizes 1 > "$OUT/inspect_nodes_qwen.txt" 2>&1
echo "inspect rc=$?"; grep -i -E "per layer" "$OUT/inspect_nodes_qwen.txt" | head -5
echo "done $((SECONDS-t0))s"
