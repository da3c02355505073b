#!/usr/bin/env bash
# Session 21, call 7 (kind nvidia-h200). The decode attention's key loop read K / V at one block of depth:
# each K / V address depended on a block-table load of the same iteration, so Triton's pipeliner gave the
# K / V copies one buffer whatever num_stages (20.7 KB of shared memory, ncu call 6; compiled TTGIR:
# memdesc<1x64x64>). This tree prefetches the next iteration's block ids as a loop-carried value: at the
# plan's 3 stages K and V get two buffers (36.9 KB), at 4 three. A/B against `.s21gpu/base` (the tree
# before, 798327c's code): GPU tests; the launch alone vs context at 256 / 64 rows (qwen heads; this tree also
# at 4 stages); the whole qwen2.5-0.5b step at batch 1 / 64 / 256, interleaved.
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
source tools/device_env.sh >/dev/null
root=$PWD
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_rope.py tests/test_kv_layout.py \
   tests/test_attention.py > "$OUT/gpu_tests.log" 2>&1; echo "tests rc=$? $((SECONDS-t0))s"; tail -1 "$OUT/gpu_tests.log"
for tree in new base new4 new base; do
  dir=$root; [ $tree = base ] && dir=$root/.s21gpu/base
  extra=(); [ $tree = new4 ] && extra=(--stages 4)
  for rows in 256 64; do
    echo "### $tree rows $rows" >> "$OUT/attn_ab.txt"
    (cd "$dir" && PYTHONPATH="$dir:$PYTHONPATH" timeout 60 python3 "$root/docs/bench/decode_fusion/attn_context_s21.py" \
       --rows $rows --shapes qwen "${extra[@]}") >> "$OUT/attn_ab.txt" 2>&1
  done
  echo "attn $tree rc=$? $((SECONDS-t0))s"; grep -E "^14/2x64 rope" "$OUT/attn_ab.txt" | tail -2
done
for tree in new base new base; do
  dir=$root; [ $tree = base ] && dir=$root/.s21gpu/base
  echo "### $tree" >> "$OUT/lat_qwen_ab.md"
  (cd "$dir" && PYTHONPATH="$dir:$PYTHONPATH" timeout 100 python3 -c "$grc" bench latency \
     --model builtin:qwen2.5-0.5b --batch-sizes 1,64,256 --context 1024 --modes FULL) >> "$OUT/lat_qwen_ab.md" 2>&1
  echo "$tree rc=$? $((SECONDS-t0))s"; grep -E '^FULL +(1|64|256) ' "$OUT/lat_qwen_ab.md" | tail -3
done
