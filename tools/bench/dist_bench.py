"""Distributed benchmark: decode step time, offline throughput, PP bubble, DP padding waste.

    python -m graphrunner_tools.bench.dist_bench --out OUT_DIR [--model builtin:llama-3.1-8b]
        [--configs tp1,tp2,tp4,tp2pp2,pp4,dp4] [--batch-sizes 1,64] [--throughput-requests 256]
        [--prompt-len 512 --output-len 256]

Runs each configuration as its own `graphrunner launch` world (one process per GPU,
NCCL), every rank running the engine (SPMD), with FULL graphs for the decode steps.
A configuration is named by its sizes and a mode: `tp2`, `pp4`, `tp2pp2`, `dp4`, `dp2tp2`,
optionally followed by `sync` (PP resolving every step at once: not pipelined, the before of
pipelining), `disjoint` (pipelined PP with `pp_token_placeholders=False`: P disjoint batches in
flight, each resolved at the host before its requests run again), `lock` (lockstep DP) or
`lockdbo` (lockstep DP with dual batch overlap). `ep` after the sizes makes a MoE model's experts
expert parallel (over DP x TP under DP, lockstep implied: `dp2ep`, `dp2eplockdbo`, `tp2ep`), `eplb`
adds expert load balancing (--num-redundant-experts, --eplb-step-interval).

* decode (configs without DP): decode step wall time (engine step: schedule, execute, sample,
  D2H) of `bs` requests for each of --batch-sizes, median over the steps in which every request
  decodes (FULL uniform-decode descriptor). Dummy weights, bf16. Context: --prompt-len.
* throughput (--throughput-requests N[,N]): output tokens/s of one `generate` of N requests of
  --prompt-len random tokens and --output-len greedy tokens (after a short warm-up), the wall time
  being the slowest rank's. Under pipelined PP the engine keeps P + 1 batches in flight (P disjoint
  ones with `disjoint`); under DP the requests are split over the replicas. The same pass measures each rank's
  GPU idle fraction: CUDA events around every forward (after the PP receive is queued, before the
  send) give its busy time; 1 - busy / (first start .. last end) is the share of the run the GPU
  did not compute, which under PP is the pipeline bubble (receives waited for, stages starved).
* pp bubble, instrumented (PP configs, decode pass only): the stage boundary synchronised around
  each wait: per stage, the time spent waiting for the previous stage's hidden states (recv) and,
  on the first stage, for the last stage's sampled tokens (so this pass's step is a little slower).
* dp waste (DP configs): the skewed workload (replica 0 gets requests with many more tokens to
  generate); per step the DP decision's executed tokens (padded, plus the idle replica's dummy
  steps) over real tokens. dp2lock and dp2lockdbo also measure throughput over --batch-sizes
  requests with the microbatched step count (DBO: steps every replica agrees to split run their
  forward as two microbatches on two streams, eagerly; thresholds --dbo-*-token-threshold), and how
  much the two halves overlapped: events around each half on its stream give, per split step, the
  share of the halves' joint span during which both ran (0: one after the other), averaged.
* expert parallelism (ep / eplb configs): the lockstep steps run and those split into two
  microbatches (the DBO fraction: `dbo_microbatched_steps` / `lockstep_steps`); with eplb the
  per-rank expert load max/mean of each window before a rebalance (the first: the initial
  placement, i.e. without EPLB) and as the placement chosen spreads it, and over the last window.
* --throughput (the older form): --batch-sizes are request counts of the throughput pass and
  no decode pass runs.

Every world has a timeout (`--timeout`); a hung or failed world is recorded as such
and the next one runs. Results: OUT_DIR/dist_bench.json and OUT_DIR/dist_bench.md.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from graphrunner_tools.bench.worlds import add_world_args, all_ok, run_as_worker, run_worlds, write_result

PROMPT_LEN = 32  # the default --prompt-len
_NAME = re.compile(r"^(?:tp(\d+))?(?:pp(\d+))?(?:dp(\d+))?(?:tp(\d+))?(eplb|ep)?(sync|disjoint|lockdbo|lock)?$")


def _dummy_steps(llm) -> int:
    """Idle-replica dummy steps the runner ran (lockstep DP; 0 without it)."""
    return llm.runner.dp.num_dummy_steps if llm.runner.dp is not None else 0


def _dp_decision(llm):
    """The last DP agreement (lockstep DP; None without it)."""
    return llm.runner.dp.last_dp_decision if llm.runner.dp is not None else None


def _microbatched(llm) -> int:
    """Steps whose forward ran as two microbatches (DBO; 0 without it)."""
    return llm.runner.dp.num_microbatched_steps if llm.runner.dp is not None else 0


@dataclass(frozen=True)
class Layout:
    """A configuration name parsed: `tp2pp2` -> tp 2, pp 2; `dp2lockdbo` -> dp 2, lockstep, DBO."""

    name: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    mode: str = ""  # "", "sync" (PP not pipelined), "disjoint" (PP without placeholders), "lock", "lockdbo"
    experts: str = ""  # "", "ep" (expert parallel over DP x TP; lockstep implied under DP), "eplb" (and EPLB)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def lockstep(self) -> bool:
        return self.mode.startswith("lock") or (bool(self.experts) and self.dp > 1)


def parse_layout(name: str) -> Layout:
    """`tp4`, `tp2pp2`, `pp4sync`, `dp2tp2`, `dp2lockdbo`, ... (ValueError naming the forms)."""
    m = _NAME.match(name)
    if not name or m is None or not any(m.group(i) for i in (1, 2, 3, 4)):
        raise ValueError(f"config {name!r}: expected sizes tpN, ppN, dpN (in that order, or dpNtpN), optionally "
                         "ep or eplb, and an optional mode sync, disjoint, lock or lockdbo, e.g. tp2pp2, pp4sync, "
                         "dp2lock, dp2ep, dp2eplockdbo, tp2eplb")
    tp, pp, dp, tp_after, experts, mode = m.groups()
    if tp and tp_after:
        raise ValueError(f"config {name!r}: tp given twice")
    layout = Layout(name, int(tp or tp_after or 1), int(pp or 1), int(dp or 1), mode or "", experts or "")
    if layout.mode in ("sync", "disjoint") and layout.pp == 1:
        raise ValueError(f"config {name!r}: '{layout.mode}' (a PP mode) needs pp > 1")
    if layout.lockstep and layout.dp == 1:
        raise ValueError(f"config {name!r}: '{layout.mode}' (lockstep DP) needs dp > 1")
    return layout


def _ints(text: str) -> list[int]:
    return [int(b) for b in text.split(",") if b.strip()]


def capture_sizes(counts: list[int], splits: int) -> list[int]:
    """Decode graph sizes for batches of `counts` requests cut into 1..splits parts (P batches in flight
    under pipelined PP, one share per DP replica), and 1."""
    return sorted({1} | {max(1, -(-n // d)) for n in counts for d in range(1, splits + 1)})


def _llm(args, layout: Layout, model: str):
    from graphrunner.engine.llm import LLM

    sizes = capture_sizes(_ints(args.batch_sizes) + _ints(args.throughput_requests), layout.pp * layout.dp)
    dbo = layout.mode == "lockdbo"
    return LLM(
        model, dtype="bfloat16" if args.device == "cuda" else "float32", device=args.device,
        tensor_parallel_size=layout.tp, pipeline_parallel_size=layout.pp,
        data_parallel_size=layout.dp, max_num_seqs=max(sizes), max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.prompt_len + max(args.decode_steps, args.output_len) + 64, num_kv_blocks=args.num_kv_blocks,
        enforce_eager=False, cudagraph_mode="FULL_DECODE_ONLY", cudagraph_capture_sizes=sizes,
        compile_backend=args.compile_backend, collective_timeout_s=args.timeout, seed=0,
        data_parallel_lockstep=layout.lockstep, enable_prefix_caching=False,  # warm-up and timed runs share prompts
        pp_token_placeholders=layout.mode not in ("sync", "disjoint"),
        **(dict(enable_dbo=True, dbo_decode_token_threshold=args.dbo_decode_token_threshold,
                dbo_prefill_token_threshold=args.dbo_prefill_token_threshold) if dbo else {}),
        enable_expert_parallel=bool(layout.experts),
        **(dict(enable_eplb=True, num_redundant_experts=args.num_redundant_experts,
                eplb_step_interval=args.eplb_step_interval, eplb_window_size=args.eplb_step_interval)
           if layout.experts == "eplb" else {}),
    )


def skew_router(llm, hot: int, factor: float) -> dict:
    """Scale the router rows of `hot` experts by `factor` in every MoE layer, so that they win whenever
    their logit is positive: the skewed load EPLB exists for. Experts are placed in contiguous ranges,
    so the hot ones lie on EP rank 0. With redundant slots the initial placement already replicates
    experts 0..R-1 onto the last rank, which would balance a skew on them before EPLB moves anything
    (measured: max/mean rank load 1.01 on qwen3-30b-a3b, R=8, DP2 + EP); the hot experts therefore
    start at expert R. Returns what was done (for the result)."""
    import torch

    from graphrunner.layers.moe.layer import FusedMoE

    layers = [m for m in llm.runner.model.modules() if isinstance(m, FusedMoE)]
    if not layers:
        raise ValueError(f"--router-skew {factor} needs a mixture-of-experts model, found no FusedMoE layer")
    first_layer = layers[0]
    first = first_layer.num_physical_experts - first_layer.num_experts  # the initially replicated experts
    most = min(first_layer.num_experts - first, first_layer.num_experts - 1)
    if not 0 < hot <= most:
        raise ValueError(f"--hot-experts {hot} must lie in 1..{most} "
                         f"({first_layer.num_experts} experts, {first} replicated at start)")
    with torch.no_grad():
        for m in layers:
            m.gate.weight[first:first + hot].mul_(factor)
    return {"hot_experts": list(range(first, first + hot)), "factor": factor, "layers": len(layers)}


def _synchronize() -> None:
    """Wait for the GPU (a CPU run computes synchronously)."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _HostMark:
    """A CUDA event's stand-in on a CPU run, where the forward has finished when the call returns."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: _HostMark) -> float:
        return 1e3 * (end.t - self.t)


def _timed_steps(llm, record):
    """Wrap `llm.step` so that each call's wall time and descriptor are recorded."""
    orig = llm.step

    def step():
        _synchronize()
        start = time.perf_counter()
        out = orig()
        _synchronize()
        record(time.perf_counter() - start, llm.runner.last_descriptor, _dp_decision(llm))
        return out

    llm.step = step
    return orig


def _decode_pass(llm, bs: int, decode_steps: int, prompt_len: int) -> dict:
    import numpy as np

    from graphrunner.protocol import SamplingParams

    samples: list[float] = []

    def record(seconds, desc, _decision):
        if desc is not None and desc.is_full and desc.uniform_token_count is not None:
            samples.append(seconds)

    rng = np.random.default_rng(bs)
    prompts = rng.integers(0, llm.vocab_size, size=(bs, prompt_len)).tolist()
    # Warm-up: the first steps of a world set up NCCL's connections (seconds under PP), not a token's cost.
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    orig = _timed_steps(llm, record)
    start = time.perf_counter()
    try:
        llm.generate(prompts, SamplingParams(max_tokens=decode_steps, temperature=0.0, ignore_eos=True))
    finally:
        llm.step = orig
    wall = time.perf_counter() - start
    samples = samples[2:]  # the first replays warm caches
    return {
        # ms_per_token: generate's wall (the prefill included) over the tokens each request got. Under
        # pipelined PP an engine step launches or resolves, so a step is not a token there.
        "bs": bs, "steps": len(samples), "context": prompt_len, "ms_per_token": 1e3 * wall / decode_steps,
        "median_ms": 1e3 * statistics.median(samples) if samples else None,
        "p90_ms": 1e3 * sorted(samples)[int(0.9 * (len(samples) - 1))] if samples else None,
    }


def _instrument_bubble(llm) -> dict:
    """Time the PP waits of this stage (synchronised around each)."""
    hooks = llm.runner.pp  # this rank's pipeline stage
    waits: dict[str, list[float]] = {"recv_hidden_s": [], "recv_tokens_s": []}
    orig_before, orig_exchange = hooks.receive, hooks._exchange_sampled

    def before_forward(*a, **k):
        _synchronize()
        t = time.perf_counter()
        orig_before(*a, **k)
        _synchronize()
        if hooks.stage.hidden_in is not None:
            waits["recv_hidden_s"].append(time.perf_counter() - t)

    def exchange(batch, produces):
        _synchronize()
        t = time.perf_counter()
        orig_exchange(batch, produces)
        _synchronize()
        if not hooks.is_last_stage:
            waits["recv_tokens_s"].append(time.perf_counter() - t)

    hooks.receive, hooks._exchange_sampled = before_forward, exchange
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
                                   "dummy_steps": _dummy_steps(llm)},
                           group=llm.groups.world_cpu_group)
    # Lockstep: the agreed decisions count both replicas' run tokens (dummy steps included).
    total = run if lockstep else sum(e["executed"] for e in every)
    return {
        "lockstep": lockstep, "steps": steps, "real_tokens": real_tokens,
        "executed_tokens": total, "padded_over_real": total / real_tokens,
        "generate_wall_s": max(e["wall_s"] for e in every), "ranks": every,
        "first_steps": per_step[:4], "last_steps": per_step[-4:],
    }


class ForwardEvents:
    """CUDA events around every run of a step on this rank (no synchronisation: the run is undisturbed).

    They bracket `StepGraphs.run`: the PP receive is queued before it (so the start event completes
    once the hidden states arrived), the send and the token exchange after it.
    """

    def __init__(self, graphs, device: str) -> None:
        import torch

        self._graphs = graphs
        self._new = (lambda: torch.cuda.Event(enable_timing=True)) if device == "cuda" else _HostMark
        self.pairs: list = []
        self._orig = graphs.run

        def run(*a, **k):
            start = self._new()
            start.record()
            out = self._orig(*a, **k)
            end = self._new()
            end.record()
            self.pairs.append([start, end])
            return out

        graphs.run = run

    def close(self) -> dict:
        """Restore the run; busy and window milliseconds and the idle fraction (after a synchronise)."""
        self._graphs.run = self._orig
        _synchronize()
        pairs = [(a, b) for a, b in self.pairs if b is not None]
        if not pairs:
            return {"forwards": 0}
        busy = sum(a.elapsed_time(b) for a, b in pairs)
        window = pairs[0][0].elapsed_time(pairs[-1][1])
        return {"forwards": len(pairs), "busy_ms": busy, "window_ms": window,
                "idle_fraction": 1.0 - busy / window if window > 0 else 0.0}


class MicrobatchOverlap:
    """Events around each microbatch's forward, on the stream it runs on (dual batch overlap): per split
    step, the share of the two halves' joint span during which both ran,
    (min(e0, e1) - max(s0, s1)) / (max(e0, e1) - min(s0, s1)): 0 when one ran after the other (as on a
    CPU), 1 when they ran side by side throughout. Installed on the Microbatcher class of this process
    (each world is a process of its own) until `close`."""

    def __init__(self, device: str) -> None:
        import torch

        from graphrunner.step.microbatch import Microbatcher

        self._cls, self._orig = Microbatcher, Microbatcher._forward
        new = (lambda: torch.cuda.Event(enable_timing=True)) if device == "cuda" else _HostMark
        self.halves: list = []
        orig, halves = self._orig, self.halves

        def _forward(microbatcher, body, half, pad):
            start = new()
            start.record()
            out = orig(microbatcher, body, half, pad)
            end = new()
            end.record()
            halves.append((start, end))
            return out

        Microbatcher._forward = _forward  # type: ignore[method-assign]

    def close(self) -> dict:
        """Restore the class; the split steps and their overlap fractions' mean and median."""
        self._cls._forward = self._orig  # type: ignore[method-assign]
        _synchronize()
        fractions = [overlap_fraction(0.0, s0.elapsed_time(e0), s0.elapsed_time(s1), s0.elapsed_time(e1))
                     for (s0, e0), (s1, e1) in zip(self.halves[0::2], self.halves[1::2], strict=False)]
        return {"split_steps": len(fractions),
                "overlap_mean": statistics.fmean(fractions) if fractions else None,
                "overlap_median": statistics.median(fractions) if fractions else None}


def overlap_fraction(start0: float, end0: float, start1: float, end1: float) -> float:
    """The share of [min start, max end] during which both intervals run (0 for a zero-length span)."""
    span = max(end0, end1) - min(start0, start1)
    both = min(end0, end1) - max(start0, start1)
    return max(0.0, both) / span if span > 0 else 0.0


def _throughput_pass(llm, n: int, out_len: int, prompt_len: int) -> dict:
    """`n` requests of `prompt_len` random tokens and `out_len` greedy outputs each: output tokens/s of
    one `generate` (the slowest rank's wall time), each rank's GPU idle fraction over that run, and
    the microbatched steps (DBO). A warm-up of the same prompts with 8 output tokens goes first."""
    import numpy as np
    import torch.distributed as dist

    from graphrunner.protocol import SamplingParams

    prompts = np.random.default_rng(n).integers(0, llm.vocab_size, size=(n, prompt_len)).tolist()
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
    ubatched = _microbatched(llm)
    events = ForwardEvents(llm.runner.graphs, llm.runner.device.type)
    overlap = MicrobatchOverlap(llm.runner.device.type) if llm.config.parallel.enable_dbo else None
    start = time.perf_counter()
    llm.generate(prompts, params)
    wall = time.perf_counter() - start
    mine = {"rank": llm.groups.rank, "pp_rank": llm.groups.pp_rank, "dp_rank": llm.groups.dp_rank,
            "wall_s": wall, **events.close(), **({"dbo": overlap.close()} if overlap is not None else {})}
    every: list = [mine]
    if llm.groups.world_size > 1:
        every = [None] * llm.groups.world_size
        dist.all_gather_object(every, mine, group=llm.groups.world_cpu_group)
    wall = max(e["wall_s"] for e in every)
    idle = [e["idle_fraction"] for e in every if "idle_fraction" in e]
    overlaps = [e["dbo"]["overlap_mean"] for e in every if e.get("dbo", {}).get("overlap_mean") is not None]
    return {"requests": n, "prompt_len": prompt_len, "output_len": out_len, "wall_s": wall,
            "output_tokens_per_s": n * out_len / wall, "max_idle_fraction": max(idle) if idle else None,
            "mean_idle_fraction": statistics.fmean(idle) if idle else None, "ranks": every,
            "microbatched_steps": _microbatched(llm) - ubatched,
            "dbo_overlap_mean": statistics.fmean(overlaps) if overlaps else None}


def _bubble_pass(llm, args, batch_sizes: list[int]) -> list[dict]:
    """The decode pass again with the stage boundary synchronised around each wait (PP configs)."""
    import torch.distributed as dist

    waits = _instrument_bubble(llm)
    rows = []
    for bs in batch_sizes:
        for v in waits.values():
            v.clear()
        step = _decode_pass(llm, bs, args.decode_steps, args.prompt_len)
        mine = {k: 1e3 * statistics.median(v) if v else None for k, v in waits.items()}
        every: list = [None] * llm.groups.world_size
        dist.all_gather_object(every, {"pp_rank": llm.groups.pp_rank, **mine}, group=llm.groups.world_cpu_group)
        rows.append({"bs": bs, "instrumented_step_ms": step["median_ms"], "stages_ms": every})
    return rows


def worker(args) -> None:
    layout = parse_layout(args.worker)
    model = args.dp_model if layout.dp > 1 and not args.throughput_requests else args.model
    start = time.perf_counter()
    llm = _llm(args, layout, model)
    result: dict = {"config": layout.name, "model": model, "tp": layout.tp, "pp": layout.pp, "dp": layout.dp,
                    "startup_s": time.perf_counter() - start}
    if args.router_skew != 1.0:
        result["router_skew"] = skew_router(llm, args.hot_experts, args.router_skew)
    batch_sizes, requests = _ints(args.batch_sizes), _ints(args.throughput_requests)
    if layout.mode == "sync":  # the same PP engine resolving every step at once: no batch overlaps another
        llm._keep_in_flight = 0
    if args.throughput or (layout.lockstep and not requests):  # lockstep: DBO's yardstick (with and without)
        requests, batch_sizes = batch_sizes, []
    if layout.dp == 1 and batch_sizes:
        result["decode"] = [_decode_pass(llm, bs, args.decode_steps, args.prompt_len) for bs in batch_sizes]
    if requests:
        result["throughput"] = [_throughput_pass(llm, n, args.output_len, args.prompt_len) for n in requests]
    if layout.pp > 1 and layout.mode != "sync" and batch_sizes and not args.throughput_requests:
        result["bubble"] = _bubble_pass(llm, args, batch_sizes)
    if layout.dp > 1 and not args.throughput_requests:
        result["dp_waste"] = _dp_waste(llm, args, lockstep=layout.lockstep)
    if llm.runner.eplb is not None:  # per-rank expert load max/mean: the first window (the initial
        result["eplb"] = llm.runner.eplb.report()  # placement: without EPLB) against the later ones
    if llm.runner.dp is not None:
        result["dbo_microbatched_steps"] = _microbatched(llm)
        result["dbo_microbatched_graph_steps"] = llm.runner.dp.num_microbatched_graph_steps
        result["lockstep_steps"] = llm.runner.dp.num_steps
    write_result(llm, result, args.result)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--model", default="builtin:llama-3.1-8b")
    p.add_argument("--dp-model", default="builtin:llama-3.2-1b", help="model of the DP waste run")
    p.add_argument("--batch-sizes", default="1,64", help="decode pass: requests per timed decode")
    p.add_argument("--decode-steps", type=int, default=48)
    p.add_argument("--throughput-requests", default="", help="throughput pass: requests per generate, e.g. 256")
    p.add_argument("--prompt-len", type=int, default=PROMPT_LEN, help="prompt tokens of every pass's requests")
    p.add_argument("--output-len", type=int, default=None, help="throughput pass: output tokens (--decode-steps)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--device", default="cuda", help="cuda (NCCL), or cpu (gloo: a smoke run of the worlds)")
    p.add_argument("--configs", default="tp1,tp2,pp2,dp2")
    p.add_argument("--throughput", action="store_true",
                   help="the older form: --batch-sizes are throughput request counts; no decode pass")
    p.add_argument("--dbo-decode-token-threshold", type=int, default=32, help="dp2lockdbo: decode steps split from")
    p.add_argument("--dbo-prefill-token-threshold", type=int, default=512, help="dp2lockdbo: other steps split from")
    p.add_argument("--num-redundant-experts", type=int, default=2, help="eplb configs: redundant expert slots")
    p.add_argument("--eplb-step-interval", type=int, default=64, help="eplb configs: steps between rebalances")
    p.add_argument("--router-skew", type=float, default=1.0,
                   help="MoE models: scale the router rows of the first --hot-experts experts by this factor")
    p.add_argument("--hot-experts", type=int, default=8,
                   help="experts --router-skew favours (from the first one the initial placement does not replicate)")
    add_world_args(p)
    args = p.parse_args(argv)
    args.output_len = args.output_len or args.decode_steps
    layouts = {name: parse_layout(name) for name in args.configs.split(",")}  # a bad name fails here, once
    if run_as_worker(args, worker):
        return 0

    worker_args = [*sum(([f"--{k.replace('_', '-')}", str(getattr(args, k))] for k in
                         ("model", "dp_model", "batch_sizes", "decode_steps", "throughput_requests", "prompt_len",
                          "output_len", "max_num_batched_tokens", "num_kv_blocks", "compile_backend", "device",
                          "timeout", "dbo_decode_token_threshold", "dbo_prefill_token_threshold",
                          "num_redundant_experts", "eplb_step_interval", "router_skew", "hot_experts")), []),
                   *(["--throughput"] if args.throughput else [])]
    out = Path(args.out)
    results = run_worlds("graphrunner_tools.bench.dist_bench", list(layouts),
                         lambda name: layouts[name].world_size, worker_args, out, "dist_bench", args.timeout,
                         args.device)
    (out / "dist_bench.md").write_text(_markdown(results))
    print(_markdown(results))
    return all_ok(results)


def _markdown(results: list[dict]) -> str:
    lines = ["| config | requests | output tok/s | wall s | GPU idle (max / mean over ranks) |",
             "|---|---|---|---|---|"]
    for r in results:
        for t in r.get("throughput", []):
            ubatched = f", {t['microbatched_steps']} microbatched steps" if r.get("dp", 1) > 1 else ""
            if t.get("dbo_overlap_mean") is not None:
                ubatched += f" (halves overlapping {t['dbo_overlap_mean']:.0%} of their span)"
            idle = (f"{t['max_idle_fraction']:.1%} / {t['mean_idle_fraction']:.1%}"
                    if t.get("max_idle_fraction") is not None else "-")
            lines.append(f"| {r['config']} | {t['requests']} x {t.get('prompt_len', PROMPT_LEN)} in / "
                         f"{t['output_len']} out | {t['output_tokens_per_s']:.0f} | {t['wall_s']:.3f}{ubatched} "
                         f"| {idle} |")
    experts = [r for r in results if "lockstep_steps" in r or "eplb" in r]
    if experts:
        lines += ["", "| config | lockstep steps | DBO microbatched | per-rank expert load max/mean: window "
                  "before each rebalance -> as placed; last window |", "|---|---|---|---|"]
    for r in experts:
        steps, ub = r.get("lockstep_steps", 0), r.get("dbo_microbatched_steps", 0)
        e = r.get("eplb")
        load = "-" if e is None else ", ".join(f"{b:.3f} -> {a:.3f}" for _, b, a, _ in e["rearrangements"]) + \
            f"; {e['balance_now']:.3f}"
        graphed = r.get("dbo_microbatched_graph_steps", 0)
        lines.append(f"| {r['config']} | {steps} | {ub} ({ub / steps if steps else 0:.0%}; {graphed} as FULL graphs) "
                     f"| {load} |")
    lines += ["", "| config | bs | context | decode step median ms | p90 ms | generate ms per token |",
              "|---|---|---|---|---|---|"]
    for r in results:
        for d in r.get("decode", []):
            per_token = f"{d['ms_per_token']:.3f}" if "ms_per_token" in d else "-"
            lines.append(f"| {r['config']} | {d['bs']} | {d.get('context', PROMPT_LEN)} | {d['median_ms']:.3f} "
                         f"| {d['p90_ms']:.3f} | {per_token} |")
    for r in results:
        if "status" in r and r["status"] != 0:
            lines.append(f"| {r['config']} | - | - | FAILED (status {r['status']}) | |")
        if "skipped" in r:
            lines.append(f"| {r['config']} | - | - | skipped: {r['skipped']} | |")
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
            lines.append(f"\nDP skewed ({mode}): executed/real tokens = {w['padded_over_real']:.2f} "
                         f"({w['executed_tokens']} / {w['real_tokens']}), generate {w['generate_wall_s']:.3f} s")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
