"""Batch-M projections on qwen2.5-0.5b / llama-3.2-1b shapes: cuBLAS, cuBLAS on a transposed
weight and inductor max-autotune (Triton templates), plus the LM head's bf16 + cast vs one
fp32-output GEMM. Usage: python3 gemm_m256_s13.py 256 [64 ...] (CUDA-graph medians, µs)."""

import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

SHAPES = {"q_qkv": (1152, 896, True), "q_o": (896, 896, False), "q_gu": (9728, 896, False),
          "q_down": (896, 4864, False), "l_qkv": (3072, 2048, False), "l_o": (2048, 2048, False),
          "l_gu": (16384, 2048, False), "l_down": (2048, 8192, False)}
HEADS = [(151936, 896), (128256, 2048)]


def us(fn, *args) -> float:
    return do_bench_cudagraph(lambda: fn(*args), rep=200) * 1000


def mm_transposed(x, wt, b):
    return torch.addmm(b, x, wt) if b is not None else torch.mm(x, wt)


def head_cast(x, w):
    return F.linear(x, w).float()


def head_fp32(x, w):
    return torch.mm(x, w.t(), out_dtype=torch.float32)


def projections(m: int, dev: str, dt: torch.dtype) -> None:
    for name, (n, k, has_bias) in SHAPES.items():
        x = torch.randn(m, k, device=dev, dtype=dt)
        w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
        b = torch.randn(n, device=dev, dtype=dt) if has_bias else None
        wt = w.t().contiguous()
        r = {"cublas": us(F.linear, x, w, b), "cublas_wT": us(mm_transposed, x, wt, b)}
        try:
            torch._dynamo.reset()
            f = torch.compile(lambda x, w, b: F.linear(x, w, b), mode="max-autotune-no-cudagraphs", dynamic=False)
            f(x, w, b)
            r["inductor_ma"] = us(f, x, w, b)
        except Exception as e:  # noqa: BLE001 - report and go on
            r["inductor_ma"] = float("nan")
            print(name, "compile failed", repr(e)[:200])
        mb = (n * k * 2 + m * k * 2 + m * n * 2) / 1e6
        times = " ".join(f"{key}={v:.2f}us" for key, v in r.items())
        print(f"M={m} {name:8s} N={n} K={k} {times}  bytes {mb:.1f}MB flops {2 * m * n * k / 1e9:.2f}GF", flush=True)


def lm_heads(m: int, dev: str, dt: torch.dtype) -> None:
    for v, h in HEADS:
        x = torch.randn(m, h, device=dev, dtype=dt)
        w = torch.randn(v, h, device=dev, dtype=dt) * 0.02
        cast, fp32 = us(head_cast, x, w), us(head_fp32, x, w)
        err = (head_cast(x, w) - head_fp32(x, w)).abs().max().item()
        print(f"M={m} lm_head V={v} H={h} linear+float={cast:.2f}us mm_out_fp32={fp32:.2f}us maxdiff={err:.3g}")


if __name__ == "__main__":
    torch.manual_seed(0)
    for rows in [int(a) for a in sys.argv[1:]] or [256]:
        projections(rows, "cuda", torch.bfloat16)
        lm_heads(rows, "cuda", torch.bfloat16)
