"""Split-K GEMM whose reduction happens in the next add + RMSNorm: one launch less, more SMs busy.

Issue #17, qwen2.5-0.5b at batch 256: cuBLAS runs the down projection (K = 4864) as a split-K GEMM plus a
reduce kernel (7.6 + 2.3 µs on an H200), and the o projection (K = 896) as ~28 tiles on 132 SMs (4.7 µs);
each is followed by the residual add + RMSNorm kernel. Here the projection is a strided batched GEMM over S
slices of K with fp32 outputs (`torch.bmm(..., out_dtype=torch.float32)`, no copies), and the add + RMSNorm
kernel sums the S partials first (rounding the sum to bf16 as the GEMM would, then adding the residual as
before). Times both chains in CUDA graphs (20 chains per graph) for S = 1 .. 8 and checks the outputs against
the cuBLAS chain (max difference in bf16 ulps). From the repository root with tools/device_env.sh sourced:

    python3 docs/bench/decode_fusion/splitk_norm_s22.py [--rows 256]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from graphrunner.layers.norm import add_rms_norm_triton
from graphrunner_tools.bench.gemv_bench import graph_time_us


@triton.jit
def _sum_add_rms_norm_kernel(p_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, hidden, eps, stride_ps, stride_pm,
                             NUM_PARTS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < hidden
    ty = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(NUM_PARTS):
        acc += tl.load(p_ptr + s * stride_ps + row * stride_pm + i, mask=ok, other=0.0)
    x = acc.to(ty).to(tl.float32)  # the projection's output, rounded as a bf16 GEMM would
    s_ = (x + tl.load(res_ptr + row * hidden + i, mask=ok, other=0.0).to(tl.float32)).to(ty)
    tl.store(res_out_ptr + row * hidden + i, s_, mask=ok)
    sf = s_.to(tl.float32)
    inv = tl.rsqrt(tl.sum(sf * sf, axis=0) / hidden + eps)
    y = (sf * inv).to(ty).to(tl.float32) * tl.load(w_ptr + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + i, y.to(ty), mask=ok)


def split_k_partials(a: torch.Tensor, w: torch.Tensor, parts: int) -> torch.Tensor:
    """a [M, K] @ w [N, K]^T as `parts` fp32 partial sums over K slices: [parts, M, N]."""
    m, k = a.shape
    n = w.shape[0]
    a_s = a.view(m, parts, k // parts).transpose(0, 1)  # [S, M, K/S], no copy
    w_s = w.view(n, parts, k // parts).transpose(0, 1).transpose(1, 2)  # [S, K/S, N], no copy
    return torch.bmm(a_s, w_s, out_dtype=torch.float32)


def sum_add_rms_norm(parts: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float):
    s, m, hidden = parts.shape
    out, res_out = torch.empty_like(res), torch.empty_like(res)
    block = triton.next_power_of_2(hidden)
    _sum_add_rms_norm_kernel[(m,)](parts, res, w, out, res_out, hidden, eps, parts.stride(0), parts.stride(1),
                                   NUM_PARTS=s, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out, res_out


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b| in units of b's bf16 spacing."""
    spacing = torch.finfo(torch.bfloat16).eps * b.float().abs().clamp_min(1e-3)
    return float(((a.float() - b.float()).abs() / spacing).max())


SHAPES = {  # projection: (N = hidden, K)
    "qwen-o": (896, 896), "qwen-down": (896, 4864),
    "l1b-o": (2048, 2048), "l1b-down": (2048, 8192),
    "l8b-o": (4096, 4096), "l8b-down": (4096, 14336),
}


def bench_projection(name: str, rows: int, g: torch.Generator) -> str:
    """One projection [rows, K] -> N followed by the add + RMSNorm: the cuBLAS chain vs split-K chains."""
    (hidden, k), dev, dt = SHAPES[name], g.device, torch.bfloat16
    a = torch.randn(rows, k, device=dev, dtype=dt, generator=g)
    w = torch.randn(hidden, k, device=dev, dtype=dt, generator=g) * k ** -0.5
    res = torch.randn(rows, hidden, device=dev, dtype=dt, generator=g)
    nw = torch.rand(hidden, device=dev, dtype=dt, generator=g) + 0.5
    ref = add_rms_norm_triton(a @ w.T, res, nw, 1e-6)
    base = graph_time_us(lambda _: add_rms_norm_triton(a @ w.T, res, nw, 1e-6), 20, 10)
    gemm = graph_time_us(lambda _: a @ w.T, 20, 10)
    line = [f"{name} rows {rows} (N {hidden}, K {k}): cuBLAS + add_rms_norm {base:.2f} µs (GEMM {gemm:.2f})"]
    for s in (1, 2, 3, 4, 6, 7, 8):
        if k % s or (k // s) % 8:
            continue
        got = sum_add_rms_norm(split_k_partials(a, w, s), res, nw, 1e-6)
        err = max(ulps(got[0], ref[0]), ulps(got[1], ref[1]))
        t = graph_time_us(lambda _, s=s: sum_add_rms_norm(split_k_partials(a, w, s), res, nw, 1e-6), 20, 10)
        tg = graph_time_us(lambda _, s=s: split_k_partials(a, w, s), 20, 10)
        line.append(f"S={s}: {t:.2f} (bmm {tg:.2f}, {err:.1f} ulp)")
    return "; ".join(line)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="256")
    p.add_argument("--shapes", default="qwen-o,qwen-down")
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: 20 chains per graph; µs per chain")
    for name in args.shapes.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            print("  " + bench_projection(name, rows, g), flush=True)


if __name__ == "__main__":
    main()
