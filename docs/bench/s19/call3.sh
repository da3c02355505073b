#!/usr/bin/env bash
# session 19 call 3: sampler table (#16) with the in-graph time; greedy one-wave A/B vs d7ddc84; #17 table qwen / 1b vs f50caea
set -uo pipefail
t0=$SECONDS; nvidia-smi --query-gpu=name --format=csv,noheader
root=$PWD
grc='import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))'
tree() { case $1 in base) echo "$root/.s19gpu/base";; before) echo "$root/.s19gpu/before";; *) echo "$root";; esac; }
(source tools/device_env.sh >/dev/null && timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sampler_bench.py \
   > "$OUT/gpu_tests_s19_call3.log" 2>&1; echo "tests rc=$? $((SECONDS-t0))s"; tail -1 "$OUT/gpu_tests_s19_call3.log")
smp() {  # side args...
  local side=$1; shift
  (cd "$(tree $side)" && source tools/device_env.sh >/dev/null && echo "### sampler $side $*" >> "$OUT/sampler_s19.md" && timeout 150 \
   python3 -c "$grc" bench sampler "$@" >> "$OUT/sampler_s19.md" 2>&1; echo "sampler $side rc=$? $((SECONDS-t0))s")
}
smp new --num-reqs 1,64,256 --variants greedy,sampled,all_on --filters bisect --iters 30
smp base --num-reqs 64,256 --variants greedy --iters 50
smp new --num-reqs 64,256 --variants greedy --iters 50 --graph-calls 0
grep -E '\| graph \|' "$OUT/sampler_s19.md"
lat() {  # side model
  (cd "$(tree $1)" && source tools/device_env.sh >/dev/null && echo "### $2 $1" >> "$OUT/lat_issue17_s19.md" && timeout 120 python3 -c "$grc" \
   bench latency --model builtin:$2 --batch-sizes 1,8,64,256 --context 1024 --modes FULL >> "$OUT/lat_issue17_s19.md" 2>&1
   echo "$2 $1 rc=$? $((SECONDS-t0))s"; grep -E '^FULL +[0-9]+ ' "$OUT/lat_issue17_s19.md" | tail -4)
}
lat new qwen2.5-0.5b; lat before qwen2.5-0.5b; lat new llama-3.2-1b; lat before llama-3.2-1b
echo "total $((SECONDS-t0))s"
