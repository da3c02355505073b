"""Context-parallel benchmark: TTFT of long prompts under PCP; decode at long context and KV capacity under DCP.

    python -m graphrunner_tools.bench.cp_bench --out OUT_DIR [--model builtin:llama-3.1-8b]
        [--prompt-lens 16384,32768] [--configs pcp1,pcp2]
    python -m graphrunner_tools.bench.cp_bench --out OUT_DIR --configs tp1,tp2,tp2dcp2 --decode-context 32768

Each configuration runs as its own `graphrunner launch` world (one process per GPU, NCCL),
every rank running the engine (SPMD), bf16, dummy weights, the default FULL_AND_PIECEWISE
mode. For each prompt length L the engine takes one prompt of L tokens with max_tokens=1
and a token budget of L (the whole prefill is one step, split over the PCP ranks); the
time to first token is the wall time of that `generate` call (synchronised), after one
untimed warm-up of the same length; the median of `--repeats` runs is reported. The
first token of each run is recorded, so that configurations can be checked to agree.

With `--decode-context C` (the DCP configurations) each world instead sizes its KV cache
from a profile (gpu_memory_utilization 0.9, 256 sequences so that memory, not the block-table
width, bounds the pool) and reports its capacity in tokens (blocks x positions per block,
which DCP multiplies by D), then prefills one prompt of C tokens
(chunked, 8192 per step) and times `--decode-steps` engine steps of batch-1 decode at that
context (FULL graphs; median, synchronised).
Results: OUT_DIR/cp_bench.json and OUT_DIR/cp_bench.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from graphrunner_tools.bench.worlds import add_world_args, all_ok, run_as_worker, run_worlds, write_result

# name -> (tensor_parallel_size, prefill_context_parallel_size, decode_context_parallel_size)
CONFIGS = {"pcp1": (1, 1, 1), "pcp2": (1, 2, 1), "tp1": (1, 1, 1), "tp2": (2, 1, 1), "tp2dcp2": (2, 1, 2)}


def _decode_worker(args, tp: int, dcp: int) -> dict:
    """KV capacity from a profile, then batch-1 decode step time at `--decode-context` tokens."""
    import statistics as stats

    from graphrunner.engine.llm import LLM
    from graphrunner.protocol import SamplingParams
    from graphrunner_tools.bench.dist_bench import _timed_steps

    C = args.decode_context
    llm = LLM(
        args.model, dtype="bfloat16", device="cuda", tensor_parallel_size=tp, decode_context_parallel_size=dcp,
        enable_prefix_caching=False,
        max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=C + args.decode_steps + 64,
        gpu_memory_utilization=0.9, enforce_eager=False, cudagraph_capture_sizes=[1, 2, 4, 8],
        collective_timeout_s=args.timeout, seed=0,
    )
    samples: list[float] = []

    def record(seconds, desc, _decision):
        if desc is not None and desc.is_full and desc.uniform_token_count is not None:
            samples.append(seconds)

    prompt = [(37 * j + 11) % 30000 + 1 for j in range(C)]
    orig = _timed_steps(llm, record)
    out = llm.generate([prompt], SamplingParams(max_tokens=args.decode_steps, temperature=0.0, ignore_eos=True))
    llm.step = orig  # type: ignore[method-assign]
    samples = samples[2:]
    result = {
        "kv_blocks_per_rank": llm.scheduler.num_blocks, "positions_per_block": llm.config.tokens_per_block,
        "capacity_tokens": llm.scheduler.num_blocks * llm.config.tokens_per_block,
        "kv_heads_per_rank": llm.runner.num_kv_heads_local, "decode_context": C,
        "decode_median_ms": 1e3 * stats.median(samples) if samples else None, "decode_steps": len(samples),
        "tokens": out[0].token_ids[:8],
    }
    llm.shutdown()
    return result


def worker(args) -> None:
    import torch

    from graphrunner.engine.llm import LLM
    from graphrunner.protocol import SamplingParams

    tp, pcp, dcp = CONFIGS[args.worker]
    if args.decode_context:
        import torch.distributed as dist

        result = {"config": args.worker, "tp": tp, "dcp": dcp, **_decode_worker(args, tp, dcp)}
        if not dist.is_initialized() or dist.get_rank() == 0:
            Path(args.result).write_text(json.dumps(result, indent=1))
        return
    lens = [int(x) for x in args.prompt_lens.split(",")]
    longest = max(lens)
    start = time.perf_counter()
    llm = LLM(
        args.model, dtype="bfloat16", device="cuda", prefill_context_parallel_size=pcp, max_num_seqs=8,
        enable_prefix_caching=False,  # the repeats must prefill, not hit the first run's blocks
        max_num_batched_tokens=longest, max_model_len=longest + 64, block_size=16,
        num_kv_blocks=(longest + 64) // 16 + 64, enforce_eager=False, cudagraph_capture_sizes=[1, 2, 4, 8],
        collective_timeout_s=args.timeout, seed=0,
    )
    result = {"config": args.worker, "model": args.model, "pcp": pcp, "startup_s": time.perf_counter() - start,
                    "ttft": []}
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for L in lens:
        prompt = [(37 * j + 11) % 30000 + 1 for j in range(L)]
        times, firsts = [], []
        for i in range(args.repeats + 1):  # the first run is the warm-up
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = llm.generate([prompt], params)
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t)
                firsts.append(out[0].token_ids[0])
        result["ttft"].append({"prompt_len": L, "median_ms": 1e3 * statistics.median(times),
                               "runs_ms": [1e3 * x for x in times], "first_tokens": firsts})
    write_result(llm, result, args.result)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--model", default="builtin:llama-3.1-8b")
    p.add_argument("--prompt-lens", default="16384,32768")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--configs", default="pcp1,pcp2")
    p.add_argument("--decode-context", type=int, default=0, help="DCP run: decode at this context (0: TTFT run)")
    p.add_argument("--decode-steps", type=int, default=32)
    add_world_args(p)
    args = p.parse_args(argv)
    if run_as_worker(args, worker):
        return 0

    worker_args = ["--model", args.model, "--prompt-lens", args.prompt_lens, "--repeats", str(args.repeats),
                   "--timeout", str(args.timeout), "--decode-context", str(args.decode_context),
                   "--decode-steps", str(args.decode_steps)]
    out = Path(args.out)
    results = run_worlds("graphrunner_tools.bench.cp_bench", args.configs.split(","),
                         lambda kind: CONFIGS[kind][0] * CONFIGS[kind][1], worker_args, out, "cp_bench", args.timeout)
    text = markdown(results)
    (out / "cp_bench.md").write_text(text)
    print(text)
    return all_ok(results)


def markdown(results: list[dict]) -> str:
    """The TTFT table (speed-up over pcp1), or the DCP table (capacity and decode vs tp1)."""
    if any("capacity_tokens" in r for r in results):
        return _decode_markdown(results)
    base = {t["prompt_len"]: t["median_ms"] for r in results if r.get("config") == "pcp1" for t in r.get("ttft", [])}
    lines = ["| config | prompt tokens | TTFT median ms | speed-up vs pcp1 | first tokens |", "|---|---|---|---|---|"]
    for r in results:
        if "ttft" not in r:
            lines.append(f"| {r.get('config')} | - | {r.get('skipped') or 'failed: status ' + str(r.get('status'))} "
                         "| - | - |")
            continue
        for t in r["ttft"]:
            ref = base.get(t["prompt_len"])
            ratio = f"{ref / t['median_ms']:.2f}x" if ref else "-"
            lines.append(f"| {r['config']} | {t['prompt_len']} | {t['median_ms']:.1f} | {ratio} "
                         f"| {t['first_tokens']} |")
    return "\n".join(lines) + "\n"


def _decode_markdown(results: list[dict]) -> str:
    base = next((r for r in results if r.get("config") == "tp1" and "capacity_tokens" in r), None)
    lines = ["| config | KV heads / rank | blocks / rank | positions / block | capacity tokens | vs tp1 | "
             "decode ms at context | vs tp1 | first tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "capacity_tokens" not in r:
            lines.append(f"| {r.get('config')} | {r.get('skipped') or 'failed: status ' + str(r.get('status'))} |")
            continue
        cap = f"{r['capacity_tokens'] / base['capacity_tokens']:.2f}x" if base else "-"
        dec = r["decode_median_ms"]
        speed = f"{base['decode_median_ms'] / dec:.2f}x" if base and dec and base["decode_median_ms"] else "-"
        lines.append(f"| {r['config']} | {r['kv_heads_per_rank']} | {r['kv_blocks_per_rank']} | "
                     f"{r['positions_per_block']} | {r['capacity_tokens']} | {cap} | "
                     f"{dec:.2f} at {r['decode_context']} | {speed} | {r['tokens']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
