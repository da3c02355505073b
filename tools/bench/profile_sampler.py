"""Which kernels the sampler spends its GPU time in (torch.profiler).

    python -m graphrunner_tools.bench.profile_sampler [--num-reqs 256] [--variant all_on] [--filter bisect]
        [--vocab 151936]

A diagnostic beside `graphrunner bench sampler`: one eager call per iteration of the same
batch the benchmark builds, CUDA kernel time per op, largest first.
"""

from __future__ import annotations

import argparse
import sys

import torch

from graphrunner.sample.sampler import Sampler
from graphrunner_tools.bench.sampler_bench import VARIANTS, _setup


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-reqs", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--variant", default="all_on", choices=VARIANTS, help="the benchmark's batch (default all_on)")
    ap.add_argument("--filter", default="bisect", help="bisect, sort or bisect-serial, optionally /torch or /triton")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rows", type=int, default=25, help="table rows to print")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    filter_impl, _, kernel_impl = args.filter.partition("/")
    with torch.inference_mode():
        states, features, b = _setup(device, args.num_reqs, args.vocab, args.max_model_len, args.variant)
        sampler = Sampler(states, filter_impl=filter_impl, kernel_impl=kernel_impl or "auto")

        def call():
            sampler(b["logits"], b["idx"], b["pos"], features, b["out"], out_logprobs=b["lp"],
                    out_logprob_ids=b["ids"], out_ranks=b["ranks"])

        for _ in range(3):
            call()
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
    print(f"sampler {args.variant}, {args.num_reqs} reqs x vocab {args.vocab}, filter {args.filter}, "
          f"{args.iters} calls, on {device}")
    print(prof.key_averages().table(sort_by=sort_by, row_limit=args.rows, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
