#!/usr/bin/env bash
# Session 22, call 1: per-program timeline of the decode attention launch (attn_timeline_s22.py): this tree,
# the block-id prefetch tree (.s21gpu/prefetch = git archive 165aa80 graphrunner), and 2 KV splits + a
# 128-register cap; 256 rows, context 1024, qwen heads.
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader | head -1
source tools/device_env.sh >/dev/null
s=docs/bench/decode_fusion/attn_timeline_s22.py
timeout 90 python3 $s --name main > "$OUT/timeline.txt" 2>&1; echo "main rc=$? $((SECONDS-t0))s"
timeout 90 python3 $s --name prefetch --tree .s21gpu/prefetch >> "$OUT/timeline.txt" 2>&1; echo "prefetch rc=$? $((SECONDS-t0))s"
timeout 90 python3 $s --name split2cap --splits 2 --maxnreg 128 >> "$OUT/timeline.txt" 2>&1; echo "split rc=$? $((SECONDS-t0))s"
timeout 90 python3 $s --name main-ctx4096 --context 4096 >> "$OUT/timeline.txt" 2>&1; echo "4096 rc=$? $((SECONDS-t0))s"
cat "$OUT/timeline.txt"
