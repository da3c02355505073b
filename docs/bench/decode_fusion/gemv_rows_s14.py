"""Multi-row GEMV (layers/decode_linear.py, M = 2..8) against cuBLAS on decode projection shapes.

    python3 docs/bench/decode_fusion/gemv_rows_s14.py

CUDA-graph medians of 20 back-to-back calls, each on its own weight copy (cycled, so no call
finds W in L2), bf16, for the default plan and a few alternatives; the floor is W's bytes
at the measured copy bandwidth.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphrunner.layers.decode_linear import gemv_rows_plan, gemv_triton
from graphrunner_tools.bench.gemv_bench import graph_time_us
from graphrunner_tools.bench.roofline import measure_copy_bandwidth

SHAPES = {"qwen qkv": (1152, 896), "qwen o": (896, 896), "qwen gate_up": (9728, 896), "qwen down": (896, 4864),
          "1b qkv": (3072, 2048), "1b o": (2048, 2048), "1b gate_up": (16384, 2048), "1b down": (2048, 8192),
          }


def main() -> None:
    bw = measure_copy_bandwidth(torch.device("cuda"), 1 << 30).bytes_per_s
    print(f"{torch.cuda.get_device_name()} copy bandwidth {bw / 1e9:.0f} GB/s")
    for name, (n, k) in SHAPES.items():
        copies = max(2, int(200e6 // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        floor = n * k * 2 / bw * 1e6
        for m in (2, 4, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_cublas = graph_time_us(lambda i, x=x, ws=ws, c=copies: F.linear(x, ws[i % c]), 20, 20)
            bn, bk, wp = gemv_rows_plan(m, n, k)
            plans = {"plan": (bn, bk, wp), "bk*2": (bn, bk * 2, wp)}
            times = {}
            for label, blk in plans.items():
                try:
                    times[label] = graph_time_us(
                        lambda i, blk=blk, x=x, ws=ws, c=copies: gemv_triton(x, ws[i % c], block=blk), 20, 20)
                except Exception as exc:  # a plan that does not compile (registers) is skipped
                    times[label] = float("nan")
                    print(f"  {label} {blk}: {type(exc).__name__}")
            ref = F.linear(x.float(), ws[0].float())
            err = (gemv_triton(x, ws[0]).float() - ref).abs().max().item()
            best = min(times, key=lambda t: times[t] if times[t] == times[t] else 1e9)
            row = " ".join(f"{t} {v:6.2f}" for t, v in times.items())
            print(f"{name:13s} M={m} cuBLAS {t_cublas:6.2f} us | {row} | best {best} "
                  f"x{t_cublas / times[best]:.2f} | floor {floor:5.2f} | err {err:.1e}")


if __name__ == "__main__":
    main()
