"""Batch-M projections: cuBLAS as the step calls it, cuBLASLt preferred, and PyTorch's TunableOp
(every implementation it registers, timed per shape, the fastest kept). For issue #17 at batch
256, where the down projection takes ~10 us against a ~3 us weight read (session 15's kernel
table). Written in session 15, not yet run:

    python3 docs/bench/decode_fusion/gemm_tunable_s15.py [256 64 ...] [--out DIR]

CUDA-graph medians of 20 back-to-back calls, each on its own weight copy (cycled past the L2,
as the step reads them); TunableOp tunes every shape before its graph is captured and writes its
choices to DIR/tunableop_results.csv.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from graphrunner_tools.bench.gemv_bench import graph_time_us

SHAPES = {"q_qkv": (1152, 896, True), "q_o": (896, 896, False), "q_gu": (9728, 896, False),
          "q_down": (896, 4864, False), "l_qkv": (3072, 2048, False), "l_down": (2048, 8192, False)}


def measure(m: int, name: str, n: int, k: int, has_bias: bool) -> dict[str, float]:
    copies = max(2, int(200e6 // (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
    ref = F.linear(x.float(), ws[0].float(), None if b is None else b.float())

    def call(j: int) -> torch.Tensor:
        return F.linear(x, ws[j % copies], b)

    times = {}
    for label, library, tunable in (("cublas", "cublas", False), ("cublaslt", "cublaslt", False),
                                    ("tunable", "cublas", True)):
        torch.backends.cuda.preferred_blas_library(library)
        torch.cuda.tunable.enable(tunable)
        torch.cuda.tunable.tuning_enable(tunable)
        err = (call(0).float() - ref).abs().max().item()
        times[label] = graph_time_us(call, 20, 10)  # its warm-up call tunes the shape
        print(f"  M={m} {name} {label}: {times[label]:.2f} us (max err {err:.2e})", flush=True)
    torch.cuda.tunable.enable(False)
    torch.backends.cuda.preferred_blas_library("cublas")
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rows", nargs="*", type=int, default=[256])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.cuda.tunable.set_filename(os.path.join(args.out, "tunableop_results.csv"))
    torch.cuda.tunable.set_max_tuning_iterations(50)
    print(torch.cuda.get_device_name())
    for m in args.rows:
        for name, (n, k, has_bias) in SHAPES.items():
            t = measure(m, name, n, k, has_bias)
            floor = (n * k * 2) / 3.0e12 * 1e6
            best = min(t, key=lambda key: t[key])
            print(f"M={m} {name:7s} N={n} K={k}: " + " ".join(f"{key} {v:.2f}" for key, v in t.items())
                  + f" us | best {best} | weights at 3 TB/s {floor:.2f} us", flush=True)
    # torch 2.11 has no tunable.write_file(): the results file is written as tuning goes.


if __name__ == "__main__":
    main()
