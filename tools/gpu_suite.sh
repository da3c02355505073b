#!/usr/bin/env bash
# The GPU test suite and the benchmarks of the closing notes, in one device call.
#   tools/gpu_suite.sh tests|bench-small|bench-8b   (writes logs and JSON under $OUT)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
gr() { python3 -c 'import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))' "$@"; }
# gr with a time limit in seconds: grt SECONDS ARGS...
grt() { local t="$1"; shift; timeout "$t" python3 -c 'import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))' "$@"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"
case "${1:-tests}" in
  tests)
    python3 -m pytest -q -m gpu -p no:cacheprovider --hypothesis-profile gpu tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
    python3 - "$OUT" <<'PY'
import sys
from graphrunner import LLM
llm = LLM("builtin:tiny-llama", device="cuda", enforce_eager=True, max_num_seqs=4, num_kv_blocks=64)
from graphrunner.step.graphs import StepGraphs
import dataclasses
from graphrunner.config import CompilationConfig
llm.runner.config = dataclasses.replace(llm.runner.config, compilation=CompilationConfig(cudagraph_mode="FULL_DECODE_ONLY", cudagraph_capture_sizes=(1,)))
llm.runner.graphs = StepGraphs(llm.runner)
report = llm.runner.capture_model(inspect_nodes=True, progress=False)
print(report)
print(sorted(report.kernel_histogram().items(), key=lambda kv: -kv[1])[:15])
graph = next(iter(llm.runner.graphs.full_graphs.values()))
graph.write_dot(sys.argv[1] + "/sample.dot")
PY
    ;;
  bench-small)
    [ -n "${EAGER_GENERATE:-}" ] && gr generate --model builtin:qwen2.5-0.5b --num-prompts 256 --prompt-len 128 --max-tokens 128 --temperature 0 \
      --ignore-eos --max-num-seqs 256 --max-num-batched-tokens 2048 --enforce-eager 2>&1 | head -14 | tee "$OUT/generate_eager.txt"
    gr generate --model builtin:qwen2.5-0.5b --num-prompts 256 --prompt-len 128 --max-tokens 128 --temperature 0 \
      --ignore-eos --max-num-seqs 256 --max-num-batched-tokens 2048 > "$OUT/generate_graphs.txt" 2>&1; grep -v "capturing graphs" "$OUT/generate_graphs.txt" | tail -25
    gr bench capture --model builtin:qwen2.5-0.5b --inspect-nodes --json "$OUT/capture_qwen.json" 2>&1 | tail -8
    gr bench latency --model builtin:qwen2.5-0.5b --batch-sizes 1,8,32,128,256 --context 1024 \
      --modes NONE,PIECEWISE,FULL --json "$OUT/latency_qwen.json" --markdown "$OUT/latency_qwen.md" 2>&1 | tail -22
    ;;
  generate)
    gr generate --model builtin:qwen2.5-0.5b --num-prompts 256 --prompt-len 128 --max-tokens 128 --temperature 0 \
      --ignore-eos --max-num-seqs 256 --max-num-batched-tokens 2048 > "$OUT/generate_graphs.txt" 2>&1; grep -v "capturing graphs" "$OUT/generate_graphs.txt" | tail -25
    ;;
  inspect|inspect-gpu)
    M=builtin:qwen2.5-0.5b
    if [ "$1" = inspect ]; then
    gr inspect table --model $M --max-num-seqs 256 --max-num-batched-tokens 2048 2>&1 | head -30 | tee "$OUT/inspect_table.txt"
    gr inspect explain --model $M --max-num-seqs 256 --max-num-batched-tokens 2048 --num-reqs 3 --query-lens 1,1,7 2>&1 | tee "$OUT/inspect_explain.txt"
    gr inspect simulate --model $M --max-num-seqs 256 --max-num-batched-tokens 2048 --workload mixed 2>&1 | tee "$OUT/inspect_simulate.txt"
    fi
    grt 120 inspect capture --model $M --dot "FULL(t=1,r=1,q=1)[greedy]" "$OUT/full_bs1.dot" 2>&1 | grep -v "capturing graphs" | tail -40 > "$OUT/inspect_capture.txt"; tail -25 "$OUT/inspect_capture.txt"
    grt 100 inspect replay --model $M --sizes 1,8,32,128 2>&1 | grep -v "capturing graphs" | tail -12 | tee "$OUT/inspect_replay.txt"
    grt 200 bench throughput --model $M --num-prompts 64 --input-len 128 --output-len 64 --peer 2>&1 | grep -v "capturing graphs" | tail -16 | tee "$OUT/bench_throughput.txt"
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_models.py -k bf16 2>&1 | tail -2
    ;;
  sampling)
    # Issue #4: every GPU test (one GPU: the multi-GPU ones skip), host time per step sync vs
    # async, sampler cost greedy vs all features, and generate with async scheduling.
    timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider --hypothesis-profile gpu tests -rs 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
    grt 150 bench host --batch-sizes 1,64,256 --json "$OUT/host_qwen.json" --markdown "$OUT/host_qwen.md" 2>&1 | grep -v "capturing graphs" | tail -14
    grt 90 bench sampler --num-reqs 1,64,256 --json "$OUT/sampler.json" --markdown "$OUT/sampler.md" 2>&1 | tail -40
    ;;
  generate-async)
    for sched in "" --async-scheduling; do
      grt 150 generate --model builtin:qwen2.5-0.5b --num-prompts 256 --prompt-len 128 --max-tokens 128 --temperature 0 \
        --ignore-eos --max-num-seqs 256 --max-num-batched-tokens 2048 $sched 2>&1 | grep -v "capturing graphs" | tail -6
    done | tee "$OUT/generate_sync_async.txt"
    ;;
  bench-8b)
    gr bench latency --model builtin:llama-3.1-8b --batch-sizes 1,8,32,128,256 --context 1024 \
      --modes NONE,PIECEWISE,FULL --json "$OUT/latency_8b.json" --markdown "$OUT/latency_8b.md" 2>&1 | tail -22
    ;;
esac
