"""Which kernels the sampler spends its GPU time in (torch.profiler).

    python -m graphrunner_tools.bench.profile_sampler [--num-reqs 256] [--variant all_on]
        [--vocab 151936] [--logits bench|flat|peaked] [--top-p 0.95] [--top-k 0] [--min-p 0] [--module PATH]

A diagnostic beside `graphrunner bench sampler`: one eager call per iteration of the same
batch the benchmark builds, CUDA kernel time per op, largest first. `--logits flat` (random-
weight-like rows: bf16 randn * 0.5 at T 0.8, 95% of the mass in ~80% of the vocabulary) or
`peaked` (randn * 3) profiles pivot_sample_triton alone on such rows instead, prints the mean
time per call (CUDA events) and which tier served the rows; `--module` loads pivot_select from
another file (a saved copy) to compare before / after in one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections import Counter

import torch

from graphrunner.sample import rng
from graphrunner.sample.sampler import Sampler
from graphrunner_tools.bench.sampler_bench import VARIANTS, _setup


def _pivot_module(path: str | None):
    if path is None:
        from graphrunner.sample import pivot_select

        return pivot_select
    spec = importlib.util.spec_from_file_location("pivot_select_under_test", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--pivot-module {path!r}: not a loadable Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows_call(args, device: torch.device):
    """A call of pivot_sample_triton on synthetic rows, and a function returning its tiers."""
    rows, vocab = args.num_reqs, args.vocab
    g = torch.Generator().manual_seed(0)
    if args.logits == "flat":
        x = (torch.randn(rows, vocab, generator=g) * 0.5).bfloat16().float()  # [R, V]
    else:
        x = torch.randn(rows, vocab, generator=g) * 3.0  # [R, V]
    x = x.to(device)
    temperature = torch.full((rows,), 0.8, device=device)
    keys = rng.row_keys(torch.arange(rows), torch.arange(rows)).to(device)
    top_k = torch.full((rows,), args.top_k, dtype=torch.int32, device=device)
    top_p, min_p = torch.full((rows,), args.top_p, device=device), torch.full((rows,), args.min_p, device=device)
    out = torch.empty(rows, dtype=torch.int64, device=device)
    thr = torch.empty(rows, device=device)
    sample = _pivot_module(args.module).pivot_sample_triton
    tiers: list[torch.Tensor] = []

    def call():
        tiers[:] = [sample(x, temperature, keys, top_k, top_p, min_p, args.top_k > 0, args.top_p < 1.0,
                           args.min_p > 0, out, thr)]

    return call, lambda: Counter(tiers[0].tolist())


def _mean_ms(call, iters: int, device: torch.device) -> float:
    if device.type != "cuda":
        return float("nan")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-reqs", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--variant", default="all_on", choices=VARIANTS, help="the benchmark's batch (default all_on)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rows", type=int, default=25, help="table rows to print")
    ap.add_argument("--logits", default="bench", choices=("bench", "flat", "peaked"),
                    help="bench: the Sampler on the benchmark's batch; flat / peaked: pivot_sample_triton alone")
    ap.add_argument("--top-p", type=float, default=0.95, help="flat / peaked rows only")
    ap.add_argument("--top-k", type=int, default=0, help="flat / peaked rows only")
    ap.add_argument("--min-p", type=float, default=0.0, help="flat / peaked rows only")
    ap.add_argument("--module", default=None, help="flat / peaked: load pivot_select from this file")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiers = None
    with torch.inference_mode():
        if args.logits == "bench":
            states, features, b = _setup(device, args.num_reqs, args.vocab, args.max_model_len, args.variant)
            sampler = Sampler(states)

            def call():
                sampler(b["logits"], b["idx"], b["pos"], features, b["out"], out_logprobs=b["lp"],
                        out_logprob_ids=b["ids"], out_ranks=b["ranks"])
        else:
            call, tiers = _rows_call(args, device)

        for _ in range(3):
            call()
        mean_ms = _mean_ms(call, max(args.iters, 20), device)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.iters):
                call()
            if device.type == "cuda":
                torch.cuda.synchronize()
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    what = args.variant if args.logits == "bench" else f"{args.logits} rows, top-p {args.top_p}, top-k {args.top_k}"
    print(f"sampler {what}, {args.num_reqs} reqs x vocab {args.vocab}, "
          f"{args.iters} calls, on {device}" + (f", module {args.module}" if args.module else ""))
    print(f"mean per call: {mean_ms * 1000:.1f} us (CUDA events, eager)")
    if tiers is not None:
        print(f"tiers (row count): {dict(sorted(tiers().items()))}")
    print(prof.key_averages().table(sort_by=sort_by, row_limit=args.rows, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
