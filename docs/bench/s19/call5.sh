#!/usr/bin/env bash
# session 19 call 5: GPU tests + memcheck of the in-launch argmax combine; greedy sampler COMBINE_LAST 1/0/1/0; qwen sanity
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
source tools/device_env.sh >/dev/null
timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sample_argmax.py tests/test_greedy_head.py \
   tests/test_sampler_processors.py tests/test_sampler_bench.py tests/test_hf_e2e.py > "$OUT/gpu_tests_s19_call5.log" 2>&1
echo "tests rc=$? $((SECONDS-t0))s"; tail -2 "$OUT/gpu_tests_s19_call5.log"
timeout 60 compute-sanitizer --tool memcheck python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sample_argmax.py \
   tests/test_greedy_head.py > "$OUT/memcheck_argmax_s19.log" 2>&1
echo "memcheck rc=$? $((SECONDS-t0))s"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_argmax_s19.log" | tail -3
for on in 1 0 1 0; do
  echo "### GRAPHRUNNER_ARGMAX_COMBINE_LAST=$on" >> "$OUT/sampler_combine_s19.md"
  GRAPHRUNNER_ARGMAX_COMBINE_LAST=$on timeout 40 python3 -c "$grc" bench sampler --num-reqs 1,64,256 --variants greedy --iters 50 >> "$OUT/sampler_combine_s19.md" 2>&1
  echo "combine_last=$on rc=$? $((SECONDS-t0))s"; grep -E '\| graph \|' "$OUT/sampler_combine_s19.md" | tail -3
done
timeout 60 python3 -c "$grc" bench latency --model builtin:qwen2.5-0.5b --batch-sizes 1,256 --context 1024 --modes FULL > "$OUT/lat_qwen_s19_call5.md" 2>&1
echo "qwen rc=$? $((SECONDS-t0))s"; grep -E '^FULL +[0-9]+ ' "$OUT/lat_qwen_s19_call5.md"
