"""Distributed benchmark: decode step time TP1 vs TP2 vs PP2, PP bubble, DP padding waste.

    python -m graphrunner_tools.bench.dist_bench --out OUT_DIR [--model builtin:llama-3.1-8b] [--batch-sizes 1,64]

Runs each configuration as its own `graphrunner launch` world (one process per GPU,
NCCL), every rank running the engine (SPMD), with FULL graphs for the decode steps:

* tp1 / tp2 / pp2: decode step wall time (engine step: schedule, execute, sample, D2H)
  of `bs` requests, median over the steps in which every request decodes (FULL
  uniform-decode descriptor). Dummy weights, bf16.
* pp2 bubble: a second pass of the pp2 world with the stage boundary instrumented:
  per stage, the time spent waiting for the previous stage's hidden states (recv) and,
  on the first stage, for the last stage's sampled tokens (synchronised before/after,
  so this pass's step time is a little higher than the plain one).
* --throughput: output tokens/s of `generate` for tp1 / tp2 / pp2 / pp2sync (PP2 with every
  step resolved at once, i.e. not pipelined: the before of pipelining, in the same call).
* dp2 / dp2lock: two DP replicas, independent (the default) or in lockstep, a skewed
  workload (replica 0 gets requests with many
  more tokens to generate); per step the DP decision's executed tokens (padded, plus
  the idle replica's dummy steps) over real tokens.
* dp2lockdbo: dp2lock with dual batch overlap (`enable_dbo`, thresholds --dbo-decode-token-threshold /
  --dbo-prefill-token-threshold): steps every replica agrees to split run their forward as two
  microbatches on two streams (eagerly). dp2lock and dp2lockdbo also measure output tokens/s of
  `generate` over --batch-sizes requests (split over the replicas), with the microbatched step count.

Every world has a timeout (`--timeout`); a hung or failed world is recorded as such
and the next one runs. Results: OUT_DIR/dist_bench.json and OUT_DIR/dist_bench.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from graphrunner_tools.bench.worlds import add_world_args, all_ok, run_as_worker, run_worlds, write_result

PROMPT_LEN = 32


def _llm(args, tp: int, pp: int, dp: int, model: str, lockstep: bool = False, dbo: bool = False):
    from graphrunner.engine.llm import LLM

    wanted = [int(b) for b in args.batch_sizes.split(",")]
    sizes = sorted(set(wanted) | {max(1, b // 2) for b in wanted} | {1})  # pipelined PP: P batches per set
    return LLM(
        model, dtype="bfloat16", device="cuda", tensor_parallel_size=tp, pipeline_parallel_size=pp,
        data_parallel_size=dp, max_num_seqs=max(sizes), max_num_batched_tokens=max(512, max(sizes) * PROMPT_LEN),
        max_model_len=PROMPT_LEN + args.decode_steps + 64, num_kv_blocks=args.num_kv_blocks,
        enforce_eager=False, cudagraph_mode="FULL_DECODE_ONLY", cudagraph_capture_sizes=sizes,
        compile_backend=args.compile_backend, collective_timeout_s=args.timeout, seed=0,
        data_parallel_lockstep=lockstep, enable_prefix_caching=False,  # warm-up and timed runs share prompts
        **(dict(enable_dbo=True, dbo_decode_token_threshold=args.dbo_decode_token_threshold,
                dbo_prefill_token_threshold=args.dbo_prefill_token_threshold) if dbo else {}),
    )


def _timed_steps(llm, record):
    """Wrap `llm.step` so that each call's wall time and descriptor are recorded."""
    import torch

    orig = llm.step

    def step():
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = orig()
        torch.cuda.synchronize()
        record(time.perf_counter() - start, llm.runner.last_descriptor, llm.runner.parallel.last_dp_decision)
        return out

    llm.step = step
    return orig


def _decode_pass(llm, bs: int, decode_steps: int) -> dict:
    import numpy as np

    from graphrunner.protocol import SamplingParams

    samples: list[float] = []

    def record(seconds, desc, _decision):
        if desc is not None and desc.is_full and desc.uniform_token_count is not None:
            samples.append(seconds)

    rng = np.random.default_rng(bs)
    prompts = rng.integers(0, llm.vocab_size, size=(bs, PROMPT_LEN)).tolist()
    orig = _timed_steps(llm, record)
    try:
        llm.generate(prompts, SamplingParams(max_tokens=decode_steps, temperature=0.0, ignore_eos=True))
    finally:
        llm.step = orig
    samples = samples[2:]  # the first replays warm caches
    return {
        "bs": bs, "steps": len(samples),
        "median_ms": 1e3 * statistics.median(samples) if samples else None,
        "p90_ms": 1e3 * sorted(samples)[int(0.9 * (len(samples) - 1))] if samples else None,
    }


def _instrument_bubble(llm) -> dict:
    """Time the PP waits of this stage (synchronised around each)."""
    import torch

    hooks = llm.runner.parallel
    waits = {"recv_hidden_s": [], "recv_tokens_s": []}
    orig_before, orig_exchange = hooks.before_forward, hooks._exchange_sampled

    def before_forward(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        orig_before(n)
        torch.cuda.synchronize()
        if hooks.hidden_in is not None:
            waits["recv_hidden_s"].append(time.perf_counter() - t)

    def exchange(batch, produces):
        torch.cuda.synchronize()
        t = time.perf_counter()
        orig_exchange(batch, produces)
        torch.cuda.synchronize()
        if not hooks.is_last_stage:
            waits["recv_tokens_s"].append(time.perf_counter() - t)

    hooks.before_forward, hooks._exchange_sampled = before_forward, exchange
    return waits


def _dp_waste(llm, args, *, lockstep: bool) -> dict:
    """The skewed two-replica workload: executed over real tokens, generate wall time, per rank."""
    import torch.distributed as dist

    from graphrunner.protocol import SamplingParams

    real = run = steps = executed = 0
    per_step = []

    def record(_s, desc, decision):
        nonlocal real, run, steps, executed
        if desc is not None:
            executed += desc.num_tokens  # this replica's padded tokens (dummy steps included)
        if decision is not None and not decision.skip:
            real += decision.total_real_tokens
            run += decision.total_run_tokens
            steps += 1
            per_step.append([list(decision.real_tokens), list(decision.run_tokens)])

    n = 16
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(PROMPT_LEN)] for i in range(n)]
    # Round-robin split: even prompts -> replica 0 (long generations), odd -> replica 1 (short).
    params = [SamplingParams(max_tokens=args.decode_steps if i % 2 == 0 else max(2, args.decode_steps // 8),
                             temperature=0.0, ignore_eos=True) for i in range(n)]
    real_tokens = sum(PROMPT_LEN + p.max_tokens - 1 for p in params)  # prompt + decodes of every request
    orig = _timed_steps(llm, record)
    start = time.perf_counter()
    llm.generate(prompts, params)
    wall = time.perf_counter() - start
    llm.step = orig
    every: list = [None] * llm.groups.world_size
    dist.all_gather_object(every, {"executed": executed, "wall_s": wall,
                                   "dummy_steps": llm.runner.parallel.num_dummy_steps},
                           group=llm.groups.world_cpu_group)
    # Lockstep: the agreed decisions count both replicas' run tokens (dummy steps included).
    total = run if lockstep else sum(e["executed"] for e in every)
    return {
        "lockstep": lockstep, "steps": steps, "real_tokens": real_tokens,
        "executed_tokens": total, "padded_over_real": total / real_tokens,
        "generate_wall_s": max(e["wall_s"] for e in every), "ranks": every,
        "first_steps": per_step[:4], "last_steps": per_step[-4:],
    }


def _throughput_pass(llm, n: int, out_len: int) -> dict:
    """`n` requests of PROMPT_LEN random tokens and `out_len` greedy outputs each: output tokens/s
    of one `generate` (under pipelined PP the engine keeps P batches of disjoint requests in flight;
    under DP the requests are split over the replicas), and the timed run's microbatched steps (DBO)."""
    import numpy as np

    from graphrunner.protocol import SamplingParams

    prompts = np.random.default_rng(n).integers(0, llm.vocab_size, size=(n, PROMPT_LEN)).tolist()
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up: every batch shape once
    ubatched = llm.runner.parallel.num_microbatched_steps
    start = time.perf_counter()
    llm.generate(prompts, params)
    wall = time.perf_counter() - start
    return {"requests": n, "output_len": out_len, "wall_s": wall, "output_tokens_per_s": n * out_len / wall,
            "microbatched_steps": llm.runner.parallel.num_microbatched_steps - ubatched}


def worker(args) -> None:
    import torch.distributed as dist

    kind = args.worker
    tp, pp, dp = {"tp1": (1, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "pp2sync": (1, 2, 1), "dp2": (1, 1, 2),
                  "dp2lock": (1, 1, 2), "dp2lockdbo": (1, 1, 2)}[kind]
    model = args.dp_model if kind.startswith("dp2") else args.model
    start = time.perf_counter()
    lockstep = kind in ("dp2lock", "dp2lockdbo")
    llm = _llm(args, tp, pp, dp, model, lockstep=lockstep, dbo=kind == "dp2lockdbo")
    result: dict = {"config": kind, "model": model, "tp": tp, "pp": pp, "dp": dp,
                    "startup_s": time.perf_counter() - start}
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if kind == "pp2sync":  # the same PP2 engine resolving every step at once: no batch overlaps another
        llm._keep_in_flight = 0
    if args.throughput and kind in ("tp1", "tp2", "pp2", "pp2sync"):
        result["throughput"] = [_throughput_pass(llm, n, args.decode_steps) for n in batch_sizes]
    elif kind in ("tp1", "tp2", "pp2"):
        result["decode"] = [_decode_pass(llm, bs, args.decode_steps) for bs in batch_sizes]
    if lockstep:  # DBO's yardstick: the same workload with and without microbatching
        result["throughput"] = [_throughput_pass(llm, n, args.decode_steps) for n in batch_sizes]
    if kind == "pp2" and not args.throughput:
        waits = _instrument_bubble(llm)
        result["bubble"] = []
        for bs in batch_sizes:
            for v in waits.values():
                v.clear()
            step = _decode_pass(llm, bs, args.decode_steps)
            mine = {k: 1e3 * statistics.median(v) if v else None for k, v in waits.items()}
            every: list = [None] * llm.groups.world_size
            dist.all_gather_object(every, {"pp_rank": llm.groups.pp_rank, **mine}, group=llm.groups.world_cpu_group)
            result["bubble"].append({"bs": bs, "instrumented_step_ms": step["median_ms"], "stages_ms": every})
    if kind.startswith("dp2"):
        result["dp_waste"] = _dp_waste(llm, args, lockstep=lockstep)
    write_result(llm, result, args.result)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--model", default="builtin:llama-3.1-8b")
    p.add_argument("--dp-model", default="builtin:llama-3.2-1b", help="model of the DP waste run")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--decode-steps", type=int, default=48)
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--configs", default="tp1,tp2,pp2,dp2")
    p.add_argument("--throughput", action="store_true",
                   help="tp1/tp2/pp2: output tokens/s of generate over --batch-sizes requests (not step times)")
    p.add_argument("--dbo-decode-token-threshold", type=int, default=32, help="dp2lockdbo: decode steps split from")
    p.add_argument("--dbo-prefill-token-threshold", type=int, default=512, help="dp2lockdbo: other steps split from")
    add_world_args(p)
    args = p.parse_args(argv)
    if run_as_worker(args, worker):
        return 0

    worker_args = [*sum(([f"--{k.replace('_', '-')}", str(getattr(args, k))] for k in
                         ("model", "dp_model", "batch_sizes", "decode_steps", "num_kv_blocks", "compile_backend",
                          "timeout", "dbo_decode_token_threshold", "dbo_prefill_token_threshold")), []),
                   *(["--throughput"] if args.throughput else [])]
    out = Path(args.out)
    results = run_worlds("graphrunner_tools.bench.dist_bench", args.configs.split(","),
                         lambda kind: 1 if kind == "tp1" else 2, worker_args, out, "dist_bench", args.timeout)
    (out / "dist_bench.md").write_text(_markdown(results))
    print(_markdown(results))
    return all_ok(results)


def _markdown(results: list[dict]) -> str:
    lines = ["| config | bs | decode step median ms | p90 ms |", "|---|---|---|---|"]
    for r in results:
        for t in r.get("throughput", []):
            ubatched = f", {t['microbatched_steps']} microbatched steps" if r["config"].startswith("dp2") else ""
            lines.append(f"| {r['config']} | {t['requests']} requests x {t['output_len']} out | "
                         f"{t['output_tokens_per_s']:.0f} output tok/s | {t['wall_s']:.3f} s{ubatched} |")
    for r in results:
        for d in r.get("decode", []):
            lines.append(f"| {r['config']} | {d['bs']} | {d['median_ms']:.3f} | {d['p90_ms']:.3f} |")
        if "status" in r and r["status"] != 0:
            lines.append(f"| {r['config']} | - | FAILED (status {r['status']}) | |")
        if "skipped" in r:
            lines.append(f"| {r['config']} | - | skipped: {r['skipped']} | |")
    for r in results:
        for b in r.get("bubble", []):
            waits = "; ".join(
                f"stage {st['pp_rank']} waits "
                + ", ".join(
                    f"{k.removesuffix('_s')} {v:.3f} ms" for k, v in st.items() if k != "pp_rank" and v is not None
                )
                for st in b["stages_ms"]
            )
            lines.append(f"\nPP bubble bs={b['bs']}: instrumented step {b['instrumented_step_ms']:.3f} ms; {waits}")
        if "dp_waste" in r:
            w = r["dp_waste"]
            mode = "lockstep" if w.get("lockstep") else "independent"
            lines.append(f"\nDP2 skewed ({mode}): executed/real tokens = {w['padded_over_real']:.2f} "
                         f"({w['executed_tokens']} / {w['real_tokens']}), generate {w['generate_wall_s']:.3f} s")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
