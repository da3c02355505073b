#!/usr/bin/env bash
# session 19 call 2: GPU tests of the new plans, then base (d7ddc84) vs this tree interleaved: latency + greedy sampler
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
root=$PWD; BASE=$root/.s19gpu/base
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
(source tools/device_env.sh >/dev/null && timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider \
   tests/test_decode_linear.py tests/test_norm_linear.py tests/test_sample_argmax.py tests/test_greedy_head.py tests/test_hf_e2e.py \
   > "$OUT/gpu_tests_s19_call2.log" 2>&1; echo "tests rc=$? $((SECONDS-t0))s"; tail -3 "$OUT/gpu_tests_s19_call2.log")
lat() {  # side model batch-sizes
  local dir=$root; [ "$1" = base ] && dir=$BASE
  (cd "$dir" && source tools/device_env.sh >/dev/null && echo "### $2 $1" >> "$OUT/lat_ab_s19.md" && timeout 90 python3 -c "$grc" \
   bench latency --model builtin:$2 --batch-sizes $3 --context 1024 --modes FULL >> "$OUT/lat_ab_s19.md" 2>&1
   echo "$2 $1 rc=$? $((SECONDS-t0))s"; grep -E '^FULL +[0-9]+ ' "$OUT/lat_ab_s19.md" | tail -2)
}
smp() {
  local dir=$root; [ "$1" = base ] && dir=$BASE
  (cd "$dir" && source tools/device_env.sh >/dev/null && echo "### sampler $1" >> "$OUT/sampler_ab_s19.md" && timeout 60 python3 -c "$grc" \
   bench sampler --num-reqs 64 256 --variants greedy --iters 50 >> "$OUT/sampler_ab_s19.md" 2>&1
   echo "sampler $1 rc=$? $((SECONDS-t0))s"; grep -E '\| graph \|' "$OUT/sampler_ab_s19.md" | tail -2)
}
for side in base new base new; do lat $side qwen2.5-0.5b 1,8; done
for side in new base; do smp $side; done
for side in base new; do lat $side llama-3.2-1b 1; done
for side in new base; do smp $side; done
for side in base new; do lat $side llama-3.1-8b 1; done
source tools/device_env.sh >/dev/null
timeout 90 python3 -m graphrunner_tools.bench.attn_sweep --rope --batch-sizes 256 > "$OUT/attn_sweep_h200.txt" 2>&1
echo "attn sweep rc=$? $((SECONDS-t0))s"; head -20 "$OUT/attn_sweep_h200.txt"
