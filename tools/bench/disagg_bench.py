"""Disaggregated prefill against colocated serving on two GPUs: decode inter-token latency under a mixed load.

    python -m graphrunner_tools.bench.disagg_bench --out OUT_DIR [--model builtin:llama-3.1-8b]
        [--num-requests 64 --long-len 8192 --short-len 256 --output-len 256] [--layouts colocated,disagg]
    graphrunner bench disagg --out OUT_DIR ...        (the same options)

The workload: --num-requests requests in alternating pairs of --long-len and --short-len prompt
tokens (random token ids, fixed seed), --output-len greedy tokens each (ignore_eos), all arriving
at once (or as a Poisson process of --request-rate requests/s). Each layout runs as its own pair of
processes (`graphrunner launch`, one GPU each, both killed after --timeout seconds):

* colocated: two independent instances, each serving every other request (both lengths): the long
  prompts' prefill chunks (up to --max-num-batched-tokens a step) share steps with the running
  requests' decodes, as the engine schedules them by default.
* disagg: GPU 0 is a prefill instance (NcclConnector kv_producer) running every request with
  max_tokens=1; GPU 1 the decode instance (kv_consumer), given each whole request once the prefill
  instance has finished it (as a router forwards it), which loads the prompt blocks over the link
  (NCCL) and computes only the rest of the prompt.

Both processes of a layout build their engines (graphs captured: --cudagraph-mode, inductor on
CUDA), warm up (under disagg through the link, so NCCL is up), then start their clocks together.
On each decode instance every step's new tokens are stamped with the step's wall time: a request's
inter-token latencies (ITL) are the gaps between its consecutive tokens after its first, its time
to first token (TTFT) the time from its arrival to its first token. Reported per layout: median and
p99 ITL over every gap, median and p99 TTFT, output tokens/s over the run (to the end of the slowest
process), and the share of prompt tokens the decode instances loaded rather than computed; and what
the tail is made of: the slowest decode steps with the runner's descriptor of each, and the caching
allocator's retries (CUDA). The target: disagg p99 ITL <= 1.3 x its median.

Results: OUT_DIR/disagg_bench.json and OUT_DIR/disagg_bench.md (each process's raw figures beside
them, disagg_bench_LAYOUT_rankR.json). `--device cpu` runs the same processes over gloo (with
builtin:tiny-llama and tiny lengths: a smoke run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from graphrunner_tools.bench.worlds import add_world_args, run_as_worker

LAYOUTS = ("colocated", "disagg")
ITL_TARGET = 1.3  # disagg p99 ITL over its median: decode steps no longer wait behind long prefills
_SEED = 0
_WARMUP_TOKENS = 4
_START_DELAY_S = 0.2  # both processes read the start time before it comes
_IDLE_S = 5e-4  # poll interval of an instance with nothing to run yet
_LINK_TIMEOUT_S = 60.0  # the connector's timeout_s: a decode request waits this long for announced blocks
_STEM = "disagg_bench"
_SLOWEST = 8  # the decode steps listed by duration: what the ITL tail is made of


def add_args(p: argparse.ArgumentParser) -> None:
    """The benchmark's options (`graphrunner bench disagg` and `python -m ...disagg_bench`)."""
    p.add_argument("--out", default=os.environ.get("OUT", "out"), help="folder of the JSON and markdown results")
    p.add_argument("--model", default="builtin:llama-3.1-8b", help="builtin:NAME (dummy weights) or a checkpoint")
    p.add_argument("--dtype", default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cuda: two GPUs, NCCL link; cpu: gloo (a smoke run)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--num-requests", type=int, default=64, help="requests in all (half long, half short)")
    p.add_argument("--long-len", type=int, default=8192, help="prompt tokens of the long requests")
    p.add_argument("--short-len", type=int, default=256, help="prompt tokens of the short requests")
    p.add_argument("--output-len", type=int, default=256, help="greedy tokens per request (ignore_eos)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s of a Poisson arrival process; inf: every request arrives at once")
    p.add_argument("--max-num-seqs", type=int, default=None, help="per instance; unset = the engine's default")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (prefill chunks) per instance; unset = the engine's default")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="unset = sized by --gpu-memory-utilization")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="per instance; below the engine's 0.9 so that the link's buffer fits beside the cache")
    p.add_argument("--kv-buffer-gib", type=float, default=4.0,
                   help="disagg: NcclConnector's kv_buffer_size (blocks waiting to be sent, or received and not "
                        "yet loaded), in GiB")
    p.add_argument("--nccl-num-channels", type=int, default=8,
                   help="disagg: NcclConnector's nccl_num_channels (CTAs, so SMs, a transfer may hold)")
    p.add_argument("--cudagraph-mode", default="FULL_AND_PIECEWISE", help="NONE = eager")
    p.add_argument("--capture-sizes", default=None, help="comma-separated token counts; unset = the default ladder")
    p.add_argument("--compile-backend", default=None, help="unset = inductor on CUDA, eager on CPU")
    p.add_argument("--kv-port", type=int, default=None, help=argparse.SUPPRESS)  # the driver picks a free one
    add_world_args(p)
    p.set_defaults(timeout=900.0)


def register(sub: argparse._SubParsersAction) -> None:
    """Add `bench disagg` to the `graphrunner bench` group."""
    p = sub.add_parser("disagg", help="disaggregated prefill vs colocated on two GPUs: decode ITL, TTFT, tokens/s",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.set_defaults(func=run)


def check_args(args: argparse.Namespace) -> list[str]:
    """The layouts asked for; ValueError naming the offending option, its value and the limit."""
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    bad = [name for name in layouts if name not in LAYOUTS]
    if bad or not layouts:
        raise ValueError(f"--layouts={args.layouts!r}: expected a comma-separated list of {list(LAYOUTS)}")
    for name in ("num_requests", "long_len", "short_len", "output_len"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')}={value} must be >= 1")
    if args.num_requests < 2:
        raise ValueError(f"--num-requests={args.num_requests} must be >= 2 (one per instance at least)")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate={args.request_rate} must be > 0 (inf: all at once)")
    if not args.kv_buffer_gib > 0:
        raise ValueError(f"--kv-buffer-gib={args.kv_buffer_gib} must be > 0")
    return layouts


# ---------------------------------------------------------------------------- the workload
def prompt_lens(args: argparse.Namespace) -> list[int]:
    """Alternating pairs long, long, short, short, ...: every other request (an instance's share under
    colocated) holds both lengths."""
    return [args.long_len if i % 4 < 2 else args.short_len for i in range(args.num_requests)]


def arrival_offsets(args: argparse.Namespace) -> list[float]:
    """Seconds after the start at which each request arrives (all 0 at an infinite rate)."""
    import numpy as np

    if math.isinf(args.request_rate):
        return [0.0] * args.num_requests
    gaps = np.random.default_rng(_SEED).exponential(1.0 / args.request_rate, size=args.num_requests)
    return [float(t) for t in np.cumsum(gaps) - gaps[0]]


def _prompts(lens: Sequence[int], vocab_size: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=n).tolist() for n in lens]


# ---------------------------------------------------------------------------- a worker process
def _select_device(args: argparse.Namespace, rank: int) -> None:
    """Make this process an instance of its own on GPU `rank` (before CUDA starts in it)."""
    # The launcher's torchrun variables would make the engine join a world of two; the instances are independent.
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    if args.device == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else ["0", "1"]
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[rank].strip()


def _role(layout: str, rank: int) -> str:
    if layout == "colocated":
        return "instance"
    return "prefill" if rank == 0 else "decode"


def _build_llm(args: argparse.Namespace, role: str) -> Any:
    from graphrunner.engine import LLM

    eager = args.cudagraph_mode.upper() == "NONE"
    kv_transfer = None
    if role != "instance":
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
        extra = {"kv_port": args.kv_port, "backend": "nccl" if args.device == "cuda" else "gloo",
                 "timeout_s": _LINK_TIMEOUT_S, "kv_buffer_size": int(args.kv_buffer_gib * (1 << 30)),
                 "nccl_num_channels": args.nccl_num_channels}
        kv_transfer = {"kv_connector": "NcclConnector", "kv_role": kv_role, "kv_connector_extra_config": extra}
    sizes = [int(s) for s in args.capture_sizes.split(",")] if args.capture_sizes else None
    return LLM(args.model, dtype=args.dtype, device=args.device, seed=_SEED, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens,
               max_model_len=max(args.long_len, args.short_len) + args.output_len,
               num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
               enforce_eager=eager, cudagraph_mode=None if eager else args.cudagraph_mode,
               cudagraph_capture_sizes=None if eager else sizes,
               compile_backend=args.compile_backend or ("inductor" if args.device == "cuda" else "eager"),
               kv_transfer_config=kv_transfer)


def _params(max_tokens: int) -> Any:
    from graphrunner.protocol import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _wait_until(done: Callable[[], bool], seconds: float, what: Callable[[], str]) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what()} within {seconds:.0f} s")
        time.sleep(0.01)


def _warm_up(llm: Any, args: argparse.Namespace, role: str) -> None:
    """One long and one short request of other tokens, so that the timed run pays no first-call costs;
    under disagg the decode instance loads them from the prefill instance (NCCL's connection is made)."""
    prompts = _prompts([args.long_len, args.short_len], llm.vocab_size, _SEED + 1)
    if role == "prefill":
        llm.generate(prompts, _params(1), use_tqdm=False)
        return
    if role == "decode":
        link = llm.scheduler.kv_connector.link
        block_size = llm.config.cache.block_size
        want = sum(len(p) // block_size for p in prompts)
        _wait_until(lambda: link.num_received_blocks >= want, args.timeout,
                    lambda: f"the decode instance received {link.num_received_blocks} of its {want} warm-up blocks")
    llm.generate(prompts, _params(_WARMUP_TOKENS), use_tqdm=False)


def _start_together(store: Any, rank: int) -> float:
    """Both instances ready: the common start (time.monotonic, one clock for the processes of a host)."""
    store.set(f"ready{rank}", "1")
    store.wait(["ready0", "ready1"])
    if rank == 0:
        store.set("t0", repr(time.monotonic() + _START_DELAY_S))
    t0 = float(store.get("t0").decode())
    time.sleep(max(0.0, t0 - time.monotonic()))
    return t0


class _Arrivals:
    """The requests an instance takes as they arrive, by the clock (their offsets after the start `t0`)."""

    def __init__(self, ids: Sequence[int], offsets: Sequence[float], t0: float) -> None:
        self.pending = sorted(ids, key=lambda i: offsets[i])
        self.offsets, self.t0 = offsets, t0

    def due(self) -> list[int]:
        now = time.monotonic() - self.t0
        k = 0
        while k < len(self.pending) and self.offsets[self.pending[k]] <= now:
            k += 1
        taken, self.pending = self.pending[:k], self.pending[k:]
        return taken


class _HandedOn:
    """The requests the prefill instance has finished, in the order it published them (the store)."""

    def __init__(self, store: Any) -> None:
        self.store, self.seen = store, 0

    def due(self) -> list[int]:
        count = self.store.add("prefilled", 0)
        ids = [int(self.store.get(f"prefilled/{k}").decode()) for k in range(self.seen, count)]
        self.seen = count
        return ids


def _request_id(i: int) -> str:
    # Not generate's "0", "1", ...: the warm-up's ids may still be live when the timed run starts.
    return f"bench-{i}"


def _index(request_id: str) -> int:
    return int(request_id.removeprefix("bench-"))


def _run_prefill(llm: Any, store: Any, ids: list[int], prompts: list[list[int]], offsets: list[float],
                 t0: float) -> dict[str, Any]:
    """Every request with max_tokens=1; each one finished is published for the decode instance."""
    arrivals, done, finished = _Arrivals(ids, offsets, t0), 0, {}
    params = _params(1)
    while done < len(ids):
        for i in arrivals.due():
            llm.add_request(_request_id(i), prompts[i], params, stream=False)
        if not llm.has_unfinished_requests():
            time.sleep(_IDLE_S)
            continue
        finals, _ = llm.step_outputs()
        for out in finals:
            i = _index(out.request_id)
            store.set(f"prefilled/{done}", str(i))  # the key before the count that makes it visible
            done += 1
            finished[i] = time.monotonic() - t0
        if finals:
            store.add("prefilled", len(finals))
    link = llm.scheduler.kv_connector.link
    return {"wall_s": time.monotonic() - t0, "prefill_done_s": [finished[i] - offsets[i] for i in ids],
            "sent_blocks": link.num_sent_blocks, "dropped_blocks": link.num_dropped_blocks}


def _run_decode(llm: Any, source: Any, n: int, prompts: list[list[int]], offsets: list[float], t0: float,
                output_len: int) -> dict[str, Any]:
    """Serve `n` requests as `source` hands them over, stamping each step's new tokens with its end."""
    import torch

    from capture.jit_events import record_triton_jit
    from graphrunner_tools.bench.throughput import StepEvents

    params = _params(output_len)
    on_gpu = torch.cuda.is_available()
    events = StepEvents(llm.runner, device_events=on_gpu)
    last: dict[int, float] = {}
    ttft: dict[int, float] = {}
    tokens: dict[int, int] = {}
    cached: dict[int, int] = {}
    gaps: list[float] = []
    steps: list[tuple[float, float, str]] = []  # (seconds, ended at, the runner's descriptor)
    with record_triton_jit() as jit:
        while len(cached) < n:
            for i in source.due():
                llm.add_request(_request_id(i), prompts[i], params, stream=True)
            if not llm.has_unfinished_requests():
                time.sleep(_IDLE_S)
                continue
            began = time.monotonic()
            finals, deltas = llm.step_outputs()
            now = time.monotonic()
            steps.append((now - began, now - t0, str(llm.runner.last_descriptor)))
            for delta in deltas:
                i = _index(delta.request_id)
                for _ in (t for completion in delta.outputs for t in completion.token_ids):
                    if i in last:
                        gaps.append(now - last[i])
                    else:
                        ttft[i] = now - (t0 + offsets[i])
                    last[i] = now
                    tokens[i] = tokens.get(i, 0) + 1
            for out in finals:
                cached[_index(out.request_id)] = out.num_cached_tokens
    ids = sorted(cached)
    if on_gpu:
        torch.cuda.synchronize()
    device = events.device_ms() if on_gpu else [None] * len(events.host)
    # (host start, host ms, device ms) of each execute_model
    launches = [(a, 1e3 * (b - a), ms) for (a, b), ms in zip(events.host, device, strict=True)]
    events.close()

    def window(step: tuple[float, float, str]) -> tuple[float, float]:
        return t0 + step[1] - step[0], t0 + step[1]

    def within(step: tuple[float, float, str]) -> tuple[int, float, float | None]:
        """The Triton specializations (compiles or disk loads) made during the step, and the host and
        device ms of the execute_model calls it launched: a slow step with a short device time waited
        on the host."""
        began, end = window(step)
        mine = [launch for launch in launches if began <= launch[0] <= end]
        device = sum(ms for _, _, ms in mine if ms is not None) if on_gpu else None
        return sum(began <= at <= end for at, _ in jit), sum(ms for _, ms, _ in mine), device

    link = getattr(llm.scheduler.kv_connector, "link", None)
    spans = list(link.receive_spans) if link is not None else []

    def receiving(step: tuple[float, float, str]) -> float:
        """Milliseconds of the step during which the link was receiving blocks onto this GPU."""
        began, end = window(step)
        return 1e3 * sum(max(0.0, min(end, b) - max(began, a)) for a, b in spans)

    overlap = [receiving(step) for step in steps]
    order = sorted(range(len(steps)), key=lambda k: steps[k], reverse=True)[:_SLOWEST]
    slowest = [(*steps[k], *within(steps[k]), overlap[k]) for k in order]
    beside = [step[0] for step, ms in zip(steps, overlap, strict=True) if ms > 0]
    alone = [step[0] for step, ms in zip(steps, overlap, strict=True) if ms == 0]
    by_link = {} if link is None else {"steps_receiving": [len(beside), _percentile(beside, 50)],
                                       "steps_alone": [len(alone), _percentile(alone, 50)]}
    return {**by_link,
            "wall_s": max(last.values()) - t0 if last else 0.0, "requests": ids,
            "ttft_s": [ttft.get(i) for i in ids], "output_tokens": [tokens.get(i, 0) for i in ids],
            "num_cached_tokens": [cached[i] for i in ids], "prompt_tokens": [len(prompts[i]) for i in ids],
            "itl_s": gaps, "slowest_steps": slowest, "jit_specializations": len(jit),
            "jit_kernels": sorted({name for _, name in jit}), **_allocator_stats()}


def _allocator_stats() -> dict[str, int]:
    """The caching allocator's retries (each frees cached memory after a failed cudaMalloc, a device-wide
    wait) and its cudaMalloc calls: long steps that line up with them are memory churn, not compute."""
    import torch

    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {"alloc_retries": stats.get("num_alloc_retries", 0), "device_allocs": stats.get("num_device_alloc", 0)}


def worker(args: argparse.Namespace) -> None:
    """One process of a layout (rank 0 or 1 of `graphrunner launch`): build, warm up, serve, write."""
    rank = int(os.environ["RANK"])
    store_at = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    _select_device(args, rank)
    from datetime import timedelta

    import torch.distributed as dist

    layout, role = args.worker, _role(args.worker, rank)
    started = time.monotonic()
    llm = _build_llm(args, role)
    _warm_up(llm, args, role)
    setup_s = time.monotonic() - started
    store = dist.TCPStore(*store_at, 2, rank == 0, timeout=timedelta(seconds=args.timeout))
    lens, offsets = prompt_lens(args), arrival_offsets(args)
    prompts = _prompts(lens, llm.vocab_size, _SEED)
    t0 = _start_together(store, rank)
    ids = list(range(args.num_requests))
    if role == "prefill":
        result = _run_prefill(llm, store, ids, prompts, offsets, t0)
    elif role == "decode":
        result = _run_decode(llm, _HandedOn(store), len(ids), prompts, offsets, t0, args.output_len)
        result["evicted_unused_blocks"] = llm.scheduler.kv_connector.link.num_evicted_unused_blocks
    else:
        mine = ids[rank::2]
        result = _run_decode(llm, _Arrivals(mine, offsets, t0), len(mine), prompts, offsets, t0, args.output_len)
    result.update(layout=layout, rank=rank, role=role, setup_s=setup_s)
    Path(f"{args.result}_rank{rank}.json").write_text(json.dumps(result))
    store.set(f"done{rank}", "1")
    # Rank 0 holds the store, and a prefill instance's last blocks may still be on their way: it leaves last.
    if rank == 0:
        store.wait(["done1"])


# ---------------------------------------------------------------------------- the driver
def _percentile(values: Sequence[float], q: float) -> float | None:
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else None


def summarize(layout: str, ranks: Sequence[dict[str, Any]], output_len: int) -> dict[str, Any]:
    """One layout's figures from its processes' raw results (see the module docstring)."""
    decode = [r for r in ranks if r["role"] != "prefill"]
    gaps = [g for r in decode for g in r["itl_s"]]
    ttft = [t for r in decode for t in r["ttft_s"] if t is not None]
    out_tokens = sum(sum(r["output_tokens"]) for r in decode)
    prompt_tokens = sum(sum(r["prompt_tokens"]) for r in decode)
    wall = max(r["wall_s"] for r in ranks)
    itl_median, itl_p99 = _percentile(gaps, 50), _percentile(gaps, 99)
    summary: dict[str, Any] = {
        "layout": layout, "requests": sum(len(r["requests"]) for r in decode), "output_tokens": out_tokens,
        "expected_output_tokens": sum(len(r["requests"]) for r in decode) * output_len,
        "itl_median_ms": _ms(itl_median), "itl_p99_ms": _ms(itl_p99),
        "itl_p99_over_median": itl_p99 / itl_median if itl_median and itl_p99 is not None else None,
        "ttft_median_ms": _ms(_percentile(ttft, 50)), "ttft_p99_ms": _ms(_percentile(ttft, 99)),
        "wall_s": wall, "output_tokens_per_s": out_tokens / wall if wall > 0 else None,
        "cached_fraction": sum(sum(r["num_cached_tokens"]) for r in decode) / prompt_tokens if prompt_tokens else None,
        "setup_s": [r["setup_s"] for r in ranks],
        "slowest_steps": sorted((s for r in decode for s in r.get("slowest_steps", [])), reverse=True)[:_SLOWEST],
        "jit_specializations": sum(r.get("jit_specializations", 0) for r in decode),
        "jit_kernels": sorted({k for r in decode for k in r.get("jit_kernels", [])}),
        "steps_receiving": [[r["steps_receiving"], r["steps_alone"]] for r in decode if r.get("steps_receiving")],
    }
    if any("alloc_retries" in r for r in decode):
        summary.update(alloc_retries=sum(r.get("alloc_retries", 0) for r in decode),
                       device_allocs=sum(r.get("device_allocs", 0) for r in decode))
    prefill = [r for r in ranks if r["role"] == "prefill"]
    if prefill:
        done = prefill[0]["prefill_done_s"]
        summary.update(prefill_done_median_ms=_ms(_percentile(done, 50)),
                       prefill_done_p99_ms=_ms(_percentile(done, 99)), sent_blocks=prefill[0]["sent_blocks"],
                       dropped_blocks=prefill[0]["dropped_blocks"],
                       evicted_unused_blocks=sum(r.get("evicted_unused_blocks", 0) for r in decode))
    return summary


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def target_line(results: Sequence[dict[str, Any]]) -> str:
    """Whether the disagg layout met its ITL target (or why it cannot be told)."""
    ratio = next((r.get("itl_p99_over_median") for r in results if r.get("layout") == "disagg"), None)
    verdict = "not measured" if ratio is None else f"{ratio:.2f}x: {'met' if ratio <= ITL_TARGET else 'missed'}"
    return f"Target: disagg p99 ITL <= {ITL_TARGET}x its median ({verdict})."


def markdown(results: Sequence[dict[str, Any]], args: argparse.Namespace) -> str:
    """The results as a markdown table, the workload and the target."""
    def num(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    lines = [f"{args.model}, {args.num_requests} requests ({args.long_len} / {args.short_len} prompt tokens, half "
             f"each), {args.output_len} output tokens, request rate {args.request_rate} /s, {args.device}", "",
             "| layout | ITL median ms | ITL p99 ms | p99 / median | TTFT median ms | TTFT p99 ms | output tok/s "
             "| cached fraction | wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "itl_median_ms" not in r:
            why = r.get("skipped") or f"FAILED (status {r.get('status')})"
            lines.append(f"| {r['layout']} | {why} | | | | | | | |")
            continue
        lines.append(f"| {r['layout']} | {num(r['itl_median_ms'], '.2f')} | {num(r['itl_p99_ms'], '.2f')} "
                     f"| {num(r['itl_p99_over_median'], '.2f')} | {num(r['ttft_median_ms'], '.1f')} "
                     f"| {num(r['ttft_p99_ms'], '.1f')} | {num(r['output_tokens_per_s'], '.0f')} "
                     f"| {num(r['cached_fraction'], '.3f')} | {r['wall_s']:.2f} |")
    for r in results:
        for step_ms, at_s, descriptor, jit, host_ms, device_ms, receiving_ms in r.get("slowest_steps", [])[:_SLOWEST]:
            device = "" if device_ms is None else f", device {device_ms:.1f} ms"
            lines.append(f"{r['layout']} slow step: {step_ms * 1e3:.1f} ms at {at_s:.2f} s, {descriptor}, "
                         f"{jit} Triton specializations, execute_model {host_ms:.1f} ms{device}, "
                         f"receiving blocks {receiving_ms:.1f} ms")
        for (n_beside, med_beside), (n_alone, med_alone) in r.get("steps_receiving", []):
            if n_beside:
                alone_ms = num(None if med_alone is None else 1e3 * med_alone, ".2f")
                lines.append(f"{r['layout']}: {n_beside} steps ran while blocks arrived (median "
                             f"{1e3 * med_beside:.2f} ms), {n_alone} without (median {alone_ms} ms)")
        if r.get("jit_specializations"):
            lines.append(f"{r['layout']}: {r['jit_specializations']} Triton specializations while serving, of "
                         f"{', '.join(r['jit_kernels'])}")
        if "alloc_retries" in r:
            lines.append(f"{r['layout']}: allocator retries {r['alloc_retries']}, "
                         f"cudaMalloc calls {r['device_allocs']}")
    for r in results:
        if "sent_blocks" in r:
            lines += ["", f"{r['layout']}: {r['sent_blocks']} blocks sent, {r['dropped_blocks']} dropped by the "
                      f"producer (over its buffer), {r['evicted_unused_blocks']} let go unused by the consumer "
                      "(over its buffer)."]
    return "\n".join([*lines, "", target_line(results)]) + "\n"


def run_layouts(args: argparse.Namespace, layouts: Sequence[str]) -> list[dict[str, Any]]:
    """Launch each layout's two processes; their summaries (or why not), the JSON rewritten after each."""
    from graphrunner.distributed.launch import free_port, launch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpus = sys.maxsize
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
    results: list[dict[str, Any]] = []
    for layout in layouts:
        if gpus < 2:
            results.append({"layout": layout, "skipped": f"needs 2 GPUs, found {gpus}"})
            continue
        stem = out / f"{_STEM}_{layout}"
        paths = [Path(f"{stem}_rank{r}.json") for r in (0, 1)]
        for path in paths:
            path.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "graphrunner_tools.bench.disagg_bench", "--worker", layout, "--result", str(stem),
               *_worker_argv(args), "--kv-port", str(free_port())]
        status = launch(cmd, 2, timeout=args.timeout)
        if status == 0 and all(p.is_file() for p in paths):
            entry = summarize(layout, [json.loads(p.read_text()) for p in paths], args.output_len)
        else:
            entry = {"layout": layout}
        entry["status"] = status
        results.append(entry)
        options = {**_worker_args(args), "request_rate": str(args.request_rate)}  # JSON has no infinity
        (out / f"{_STEM}.json").write_text(json.dumps({"target_itl_p99_over_median": ITL_TARGET, "args": options,
                                                       "layouts": results}, indent=1))
    return results


_WORKER_OPTIONS = ("model", "dtype", "device", "num_requests", "long_len", "short_len", "output_len", "request_rate",
                   "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "gpu_memory_utilization",
                   "kv_buffer_gib", "cudagraph_mode", "capture_sizes", "compile_backend", "timeout")


def _worker_args(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in _WORKER_OPTIONS}


def _worker_argv(args: argparse.Namespace) -> list[str]:
    return [part for name, value in _worker_args(args).items() if value is not None
            for part in (f"--{name.replace('_', '-')}", str(value))]


def run(args: argparse.Namespace) -> int:
    """Run the layouts; print the table and write the results. 0 when every layout ran and every request
    got its tokens."""
    try:
        layouts = check_args(args)
    except ValueError as e:
        raise SystemExit(f"graphrunner bench disagg: {e}") from None
    results = run_layouts(args, layouts)
    text = markdown(results, args)
    (Path(args.out) / f"{_STEM}.md").write_text(text)
    print(text)
    short = [r["layout"] for r in results if "output_tokens" in r and r["output_tokens"] != r["expected_output_tokens"]]
    for layout in short:
        print(f"graphrunner bench disagg: {layout}: fewer output tokens than --output-len per request",
              file=sys.stderr)
    return 0 if all(r.get("status", 0) == 0 for r in results) and not short else 1


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m graphrunner_tools.bench.disagg_bench`: the driver, or (--worker) one of its processes."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    args = p.parse_args(argv)
    if run_as_worker(args, worker):
        return 0
    return run(args)


__all__ = ["ITL_TARGET", "LAYOUTS", "add_args", "main", "register", "run", "summarize", "worker"]


if __name__ == "__main__":
    sys.exit(main())
