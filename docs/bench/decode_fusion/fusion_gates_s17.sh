#!/usr/bin/env bash
# Session 17, call 5 (tree .s17gpu/cur = main + the MAX_K gates): which one-row fusion slows llama-3.1-8b at batch 1.
set -uo pipefail
t0=$SECONDS
cd .s17gpu/cur
source tools/device_env.sh >/dev/null
nvidia-smi --query-gpu=name --format=csv,noheader
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
LOG=$OUT/lat_fusion_gates_s17.md; : > "$LOG"
run() { local name=$1 model=$2; shift 2; left=$((585-SECONDS+t0)); [ $left -lt 40 ] && return
  echo "### $model $name" >> "$LOG"; env "$@" timeout $left python3 -c "$grc" bench latency --model builtin:$model \
    --batch-sizes 1 --context 1024 --modes FULL >> "$LOG" 2>&1
  echo "$model $name rc=$? $((SECONDS-t0))s"; grep -E '^FULL +1 ' "$LOG" | tail -1; }
C=GRAPHRUNNER_ATTN_PLAN_MAX_SPLITS=16
run fused+cap16 llama-3.1-8b $C
run norm_off llama-3.1-8b $C GRAPHRUNNER_NORM_GEMV_MAX_K=2048
run swiglu_off llama-3.1-8b $C GRAPHRUNNER_SWIGLU_GEMV_MAX_K=8192
run both_off llama-3.1-8b $C GRAPHRUNNER_NORM_GEMV_MAX_K=2048 GRAPHRUNNER_SWIGLU_GEMV_MAX_K=8192
run fused+cap32 llama-3.1-8b X=1
run fused+cap16 llama-3.2-1b $C
run swiglu_off llama-3.2-1b $C GRAPHRUNNER_SWIGLU_GEMV_MAX_K=4864
run norm_off llama-3.2-1b $C GRAPHRUNNER_NORM_GEMV_MAX_K=1024
run fused+cap16_b llama-3.1-8b $C
