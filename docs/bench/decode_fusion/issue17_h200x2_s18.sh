#!/usr/bin/env bash
# Session 18, final call on a two-GPU host: issue #17's table (this tree on GPU 0, f50caea on GPU 1, in
# parallel), the TP2 NCCL checks, issue #16's sampler bench beside a batch-1 split-cap A/B, then the
# table's qwen rows with the GPUs swapped (GPU bias check).
set -uo pipefail
root=$PWD; BEFORE=${BEFORE:?unpack `git archive f50caea graphrunner capture tools pyproject.toml` and set BEFORE}
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
t0=$SECONDS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
lat() {  # lat TREE GPU MODEL LOGNAME [BATCHES]
  (cd "$1" && source tools/device_env.sh >/dev/null && echo "### $3 $(basename $1) gpu$2 ${SPLITS:-}" >> "$OUT/$4" && \
   CUDA_VISIBLE_DEVICES=$2 timeout ${LT:-170} python3 -c "$grc" bench latency --model "builtin:$3" \
   --batch-sizes ${5:-1,8,64,256} --context 1024 --modes FULL >> "$OUT/$4" 2>&1; echo "$3 $(basename $1) gpu$2 rc=$? $((SECONDS-t0))s")
}
: > "$OUT/lat_after.md"; : > "$OUT/lat_before.md"
(for m in qwen2.5-0.5b llama-3.2-1b llama-3.1-8b; do lat "$root" 0 $m lat_after.md; done) &
(for m in qwen2.5-0.5b llama-3.2-1b llama-3.1-8b; do lat "$BEFORE" 1 $m lat_before.md; done) &
wait
grep -h -E '^###|^FULL +[0-9]+ ' "$OUT/lat_after.md" "$OUT/lat_before.md"
source tools/device_env.sh >/dev/null
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_dist_gpu.py -k "two_gpu_layouts and tp2" \
  > "$OUT/dist_tp2.log" 2>&1; echo "tp2 rc=$? $((SECONDS-t0))s"; tail -3 "$OUT/dist_tp2.log"
(CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -c "$grc" bench sampler --num-reqs 1,64,256 --variants greedy,sampled,all_on \
  --filters bisect --iters 20 > "$OUT/sampler.txt" 2>&1; echo "sampler rc=$? $((SECONDS-t0))s") &
(: > "$OUT/lat_splits.md"; for s in 8 16 8 16; do GRAPHRUNNER_ATTN_PLAN_MAX_SPLITS=$s SPLITS=splits$s LT=60 \
  lat "$root" 1 qwen2.5-0.5b lat_splits.md 1; done) &
wait
grep -E "greedy|sampled|all_on|limit" "$OUT/sampler.txt" | tail -12; grep -h -E '^###|^FULL +[0-9]+ ' "$OUT/lat_splits.md"
: > "$OUT/lat_swap.md"
LT=80 lat "$root" 1 qwen2.5-0.5b lat_swap.md & LT=80 lat "$BEFORE" 0 qwen2.5-0.5b lat_swap.md & wait
grep -h -E '^###|^FULL +[0-9]+ ' "$OUT/lat_swap.md"; echo "done $((SECONDS-t0))s"
