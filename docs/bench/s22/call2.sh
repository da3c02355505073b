#!/usr/bin/env bash
# Session 22, call 2: per-iteration timeline of the decode attention launch (attn_timeline_s22.py), head-major
# (the runner's default) and token-major cache, context 1024 and 4096, 256 rows of qwen heads.
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader | head -1
source tools/device_env.sh >/dev/null
s=docs/bench/decode_fusion/attn_timeline_s22.py
for a in "--name hnd" "--name nhd --layout NHD" "--name hnd-4096 --context 4096" "--name hnd-rows64 --rows 64"; do
  timeout 90 python3 $s $a >> "$OUT/timeline.txt" 2>&1; echo "$a rc=$? $((SECONDS-t0))s"
done
grep -v "running per" "$OUT/timeline.txt"
