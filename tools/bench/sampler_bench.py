"""Sampler cost: the greedy-only pipeline vs every feature on, eager and in a CUDA graph.

It shows what the sampling key of the graph descriptor (GREEDY | SAMPLED | ALL_FEATURES)
saves: the all-features sampler against plain argmax at the decode batch sizes.

Variants (per batch size):
  greedy   SamplingFeatures() on greedy requests: argmax only (the GREEDY graph).
  sampled  SamplingFeatures.sampled_only() on requests using temperature, top-k, top-p
           and min-p with seeds, nothing else (the SAMPLED graph).
  all      exact features of a batch using penalties, min-p, top-k, top-p, logit bias
           and logprobs=5 (K bucket 5).
  all_on   SamplingFeatures.all_on() on the same batch (the ALL_FEATURES graph, K=20).

    python -m graphrunner_tools.bench.sampler_bench --device cuda --json out/sampler.json

Times are per sampler call: CUDA events on a GPU, perf_counter on a CPU (where only
eager runs). Must run on CPU with small sizes (the tests do).

A graph row also carries `in_graph_us`: the time per call of a graph that holds
`graph_calls` sampler calls back to back, over as many copies of the logits (cycled, so
the L2 cache holds none of them when it is read). That is the sampler's cost inside a
step's FULL graph, where no graph launch of its own precedes it; the one-call replay
(`median_us`) also pays the launch of a graph (~4 µs on an H200).

Every row also carries the logits-read limit, `rows x V x 4 bytes / copy bandwidth`,
with the copy bandwidth (bytes read + written per second by a device-to-device copy of
a buffer larger than the caches) measured in the same run, and the ratio of the time
to it: a sampler that reads the fp32 logits once and nothing else would reach 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from graphrunner.kernels import use_triton
from graphrunner.protocol import SamplingParams
from graphrunner.sample.fused_process import refresh_counts
from graphrunner.sample.sampler import Sampler
from graphrunner.state.features import SamplingFeatures
from graphrunner.state.sampling import SamplingStates

VARIANTS = ("greedy", "sampled", "all", "all_on")


def _all_features_params(i: int, vocab: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=i, repetition_penalty=1.1, frequency_penalty=0.2,
        presence_penalty=0.1, logit_bias={(7 * i + j) % vocab: 1.0 for j in range(8)}, logprobs=5,
    )


def _setup(device: torch.device, num_reqs: int, vocab: int, max_model_len: int, variant: str):
    rows = num_reqs + 1
    g = torch.Generator().manual_seed(num_reqs)
    history = torch.randint(0, vocab, (rows, max_model_len), generator=g, dtype=torch.int32).to(device)
    states = SamplingStates(rows, device, vocab_size=vocab, all_token_ids=history)
    prompt_len = max_model_len // 2
    for i in range(num_reqs):
        if variant == "greedy":
            params = SamplingParams(temperature=0.0)
        elif variant == "sampled":
            params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=i)
        else:
            params = _all_features_params(i, vocab)
        states.add_request(i, f"r{i}", params, vocab, prompt_len=prompt_len, eos_ids=(0,))
    states.apply_staged_writes()
    if states.counts is not None:  # as a step would: the admitted rows' penalty counts, once
        idx = torch.arange(num_reqs, dtype=torch.int32, device=device)
        known = torch.full((num_reqs,), max_model_len - 1, dtype=torch.int32, device=device)
        refresh_counts(states.counts, states.counts_stale, history, idx, states.prompt_len, known, clear=True,
                       use_triton_kernel=use_triton(states.counts))
    if variant == "greedy":
        features = SamplingFeatures()
    elif variant == "sampled":
        features = SamplingFeatures.sampled_only()
    elif variant == "all":
        features = states.features(np.arange(num_reqs))
    else:
        features = SamplingFeatures.all_on()
    k = max(features.num_logprobs, 0) + 1
    bufs = dict(
        logits=torch.randn(num_reqs, vocab, generator=g).to(device) * 3,  # [R, V]
        idx=torch.arange(num_reqs, dtype=torch.int32, device=device),
        pos=torch.full((num_reqs,), max_model_len - 1, dtype=torch.int32, device=device),  # seq_len
        out=torch.zeros(num_reqs, dtype=torch.int32, device=device),
        lp=torch.zeros(num_reqs, k, device=device),
        ids=torch.zeros(num_reqs, k, dtype=torch.int32, device=device),
        ranks=torch.zeros(num_reqs, dtype=torch.int32, device=device),
    )
    return states, features, bufs


def _time(fn, device: torch.device, iters: int, warmup: int) -> list[float]:
    """Seconds per call, one sample per iteration."""
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return samples


COPY_BYTES = 1 << 30  # 1 GiB: far beyond the H100/H200 L2, so the copy streams from memory


def copy_bandwidth(device: torch.device, nbytes: int = COPY_BYTES, iters: int = 20) -> float:
    """Bytes per second (read + written) of a device-to-device copy of `nbytes`, median of `iters`."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    src.fill_(1.0)
    samples = _time(lambda: dst.copy_(src), device, iters, warmup=3)
    return 2 * nbytes / statistics.median(samples)


def bench_sampler(
    device: torch.device | str,
    num_reqs: Sequence[int] = (1, 64, 256),
    vocab: int = 151936,
    iters: int = 50,
    warmup: int = 3,
    max_model_len: int = 4096,
    variants: Sequence[str] = VARIANTS,
    graphs: bool = True,
    copy_bytes: int | None = None,
    graph_calls: int = 8,
) -> list[dict]:
    """Time the sampler per (batch size, variant, mode). Returns one dict per row.

    mode "graph" (CUDA only, with graphs=True) replays a torch.cuda.CUDAGraph of the call;
    "eager" calls it directly. Rows carry median/mean/min microseconds, the logits-read
    limit (`limit_us`, from `copy_bandwidth` measured once here over `copy_bytes`,
    default 1 GiB on CUDA and 64 MiB on a CPU), `ratio` = median / limit and, for graphs,
    the graph pool memory and `in_graph_us` (module docstring; `graph_calls` calls per graph,
    0 skips it).
    """
    device = torch.device(device)
    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"variant {v!r} not in {VARIANTS}")
    if copy_bytes is None:
        copy_bytes = COPY_BYTES if device.type == "cuda" else 64 << 20
    bandwidth = copy_bandwidth(device, copy_bytes)
    rows: list[dict] = []
    for n in num_reqs:
        for variant in variants:
            for row in _bench_one(device, n, vocab, max_model_len, variant, iters, warmup, graphs, graph_calls):
                row["copy_gbps"] = bandwidth / 1e9
                row["limit_us"] = n * vocab * 4 / bandwidth * 1e6
                row["ratio"] = row["median_us"] / row["limit_us"]
                rows.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def _capture(device: torch.device, fn) -> tuple[torch.cuda.CUDAGraph, int]:
    """A CUDA graph of `fn` (warmed up once on a side stream) and the bytes its private pool reserved."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()  # warm-up (lazy inits) outside the capture
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # so the difference below is the graph's private pool only
    before = torch.cuda.memory_reserved(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph, torch.cuda.memory_reserved(device) - before


def _bench_one(device, n, vocab, max_model_len, variant, iters, warmup, graphs, graph_calls) -> list[dict]:
    """Rows for one (batch size, variant): eager, and graph replay on CUDA."""
    states, features, b = _setup(device, n, vocab, max_model_len, variant)
    sampler = Sampler(states)

    def call(logits=b["logits"]):
        sampler(logits, b["idx"], b["pos"], features, b["out"], out_logprobs=b["lp"],
                out_logprob_ids=b["ids"], out_ranks=b["ranks"])

    modes: list[tuple[str, Callable[[], object]]] = [("eager", call)]
    pool_bytes, in_graph_us = None, None
    if graphs and device.type == "cuda":
        graph, pool_bytes = _capture(device, call)
        modes.append(("graph", graph.replay))
        if graph_calls > 0:
            copies = [b["logits"]] + [b["logits"].clone() for _ in range(min(graph_calls, 3) - 1)]  # [R, V] each
            many, _ = _capture(device, lambda: [call(copies[i % len(copies)]) for i in range(graph_calls)])
            in_graph_us = statistics.median(_time(many.replay, device, iters, warmup)) * 1e6 / graph_calls
            del many, copies
    rows = []
    for mode, fn in modes:
        samples = _time(fn, device, iters, warmup)
        rows.append({
            "num_reqs": n, "vocab": vocab, "max_model_len": max_model_len, "variant": variant,
            "mode": mode, "device": str(device),
            "median_us": statistics.median(samples) * 1e6, "mean_us": statistics.fmean(samples) * 1e6,
            "min_us": min(samples) * 1e6, "iters": iters,
            "graph_pool_mib": None if mode != "graph" or pool_bytes is None else pool_bytes / 2**20,
            "in_graph_us": in_graph_us if mode == "graph" else None,
        })
    return rows


def markdown_table(rows: list[dict]) -> str:
    """The rows as a markdown table; the logits-read limit and the ratio beside each time."""
    lines = ["| reqs | variant | mode | median µs | min µs | in-graph µs/call | read limit µs | × limit "
             "| in-graph × limit | graph pool MiB |", "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        pool = "" if r["graph_pool_mib"] is None else f"{r['graph_pool_mib']:.0f}"
        in_graph = r.get("in_graph_us")
        per_call, per_call_ratio = "", ""
        if in_graph is not None:
            per_call, per_call_ratio = f"{in_graph:.1f}", f"{in_graph / r['limit_us']:.2f}"
        lines.append(f"| {r['num_reqs']} | {r['variant']} | {r['mode']} | {r['median_us']:.1f} "
                     f"| {r['min_us']:.1f} | {per_call} | {r['limit_us']:.1f} | {r['ratio']:.2f} | {per_call_ratio} "
                     f"| {pool} |")
    if rows:
        lines.append(f"\nread limit = reqs × vocab × 4 bytes at the copy bandwidth measured in this run "
                     f"({rows[0]['copy_gbps']:.0f} GB/s, read + write); in-graph = per call of a graph holding "
                     f"several calls over cycled copies of the logits (as inside a step's graph: no launch of its own)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--num-reqs", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--graph-calls", type=int, default=8, help="calls per graph for the in-graph time (0: skip)")
    ap.add_argument("--json", help="write the rows to this JSON file")
    args = ap.parse_args(argv)
    with torch.inference_mode():
        rows = bench_sampler(args.device, args.num_reqs, args.vocab, args.iters,
                             max_model_len=args.max_model_len, variants=args.variants,
                             graphs=not args.no_graphs, graph_calls=args.graph_calls)
    print(markdown_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
