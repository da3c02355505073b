"""The pre-norm block boundary and the projection after it in one call: `add_norm_linear`.

A decoder layer enters each of its two halves the same way: the residual add, RMSNorm,
then a column projection (q|k|v, or gate|up). For several rows that is the fused
add + RMSNorm kernel (`layers/norm.py`) and a cuBLAS GEMM. For one row (decode at batch
1) the GEMM is already a one-launch Triton GEMV (`layers/decode_linear.py`), and the norm
kernel before it is a whole graph node that reads and writes a few KiB: on an H100 such a
node costs ~1.5 us of launch and drain, twice a layer.

Here, for one row, the GEMV does the norm itself: every program loads the row x, the
residual and the norm weight (a few KiB, from L2 after the first program), sums x and the
residual in the activation dtype, takes the fp32 statistics, rounds the normalized row
exactly as `rms_norm` does, and multiplies its rows of W with it. Program 0 also stores the
sum, which is the next residual. The recomputation costs each program a few KiB of L2
reads next to its BLOCK_N rows of W; it replaces a kernel on the critical path.

The normalized row is bit-identical to the two-kernel path's, so the outputs differ from it
only by the GEMV's summation order (none: the same tiles), and from cuBLAS's as the GEMV's
do. The op `graphrunner::add_norm_linear` makes the choice on the real row count at run
time, so one compiled graph serves every size (as `graphrunner::decode_linear` does).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from graphrunner.kernels import HAS_TRITON
from graphrunner.kernels.pdl import pdl_launch
from graphrunner.layers.decode_linear import DECODE_GEMV, gemv_plan, linear, wide_memory_part
from graphrunner.layers.norm import RMSNorm, add_rms_norm

__all__ = ["NORM_GEMV", "add_norm_linear", "add_norm_project", "norm_gemv_plan", "norm_gemv_triton"]

# GRAPHRUNNER_NORM_GEMV=0 keeps the two-kernel path at one row too (read once at import).
NORM_GEMV = DECODE_GEMV and os.environ.get("GRAPHRUNNER_NORM_GEMV", "1") != "0"
# The fused path only for projections of at most this K (hidden size; read once at import): every
# program re-reads the whole x and residual rows to normalize them. H100, batch 1, FULL: llama-3.1-8b
# (K 4096) 6.21 ms fused vs 5.81 unfused (SwiGLU GEMV off in both), llama-3.2-1b (K 2048) 1.253 vs
# 1.251, qwen2.5-0.5b (K 896) 0.82 vs 0.89.
NORM_GEMV_MAX_K = int(os.environ.get("GRAPHRUNNER_NORM_GEMV_MAX_K", "2048"))
_BLOCK_N_OVERRIDE = int(os.environ.get("GRAPHRUNNER_NORM_GEMV_BLOCK_N", "0"))  # device sweeps
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from graphrunner.kernels.pdl import pdl_wait

    @triton.jit
    def _residual_sum(x_ptr, res_ptr, ks, km):
        # [BLOCK_K] fp32 of (x + residual) rounded to the activation dtype, as the sum is kept.
        ty = x_ptr.dtype.element_ty
        s = tl.load(x_ptr + ks, mask=km, other=0.0).to(tl.float32) + tl.load(res_ptr + ks, mask=km,
                                                                              other=0.0).to(tl.float32)
        return s.to(ty).to(tl.float32)

    @triton.jit
    def _normed_tile(x_ptr, res_ptr, nw_ptr, ks, K, inv):
        # [BLOCK_K] fp32 of the normalized row at columns ks, rounded as rms_norm rounds it:
        # (s * inv) to the dtype, times the weight, to the dtype.
        ty = x_ptr.dtype.element_ty
        km = ks < K
        s = _residual_sum(x_ptr, res_ptr, ks, km)
        nw = tl.load(nw_ptr + ks, mask=km, other=0.0).to(tl.float32)
        return ((s * inv).to(ty).to(tl.float32) * nw).to(ty).to(tl.float32)

    @triton.jit
    def _norm_gemv_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, res_out_ptr, N, K, eps, stride_wn,
                          HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GDC: tl.constexpr):
        # Program j: y[j*BLOCK_N : (j+1)*BLOCK_N] = W[those rows] . rms_norm(x + residual) * nw.
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        ok = rows < N
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
        ks0 = tl.arange(0, BLOCK_K)  # [BLOCK_K]
        # The first W tile is no kernel's output: under PDL it loads while the previous kernel ends.
        w0 = tl.load(w_rows + ks0[None, :], mask=ok[:, None] & (ks0[None, :] < K), other=0.0)
        pdl_wait(GDC)
        # Pass 1: the sum's statistics; program 0 stores the sum (the next residual).
        sq = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + ks0
            km = ks < K
            s = _residual_sum(x_ptr, res_ptr, ks, km)
            tl.store(res_out_ptr + ks, s.to(res_out_ptr.dtype.element_ty), mask=km & (pid == 0))
            sq += s * s
        inv = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
        # Pass 2: the products with the normalized row (re-read from L1/L2 tile by tile).
        acc = w0.to(tl.float32) * _normed_tile(x_ptr, res_ptr, nw_ptr, ks0, K, inv)[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            ks = k0 + ks0
            w = tl.load(w_rows + ks[None, :], mask=ok[:, None] & (ks[None, :] < K), other=0.0)
            acc += w.to(tl.float32) * _normed_tile(x_ptr, res_ptr, nw_ptr, ks, K, inv)[None, :]
        y = tl.sum(acc, axis=1)  # [BLOCK_N]
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=ok)


def norm_gemv_plan(N: int, K: int, wide_memory: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): the GEMV's H100 plan (`gemv_plan`) with twice the rows per
    program, so the row, residual and norm weight each program re-reads stay small next to its W
    tile. GRAPHRUNNER_NORM_GEMV_BLOCK_N overrides BLOCK_N.

    `wide_memory` (an H200-class part, `decode_linear.wide_memory_part`): rows of at most 1024 want
    more rows per program still:
    qwen2.5-0.5b's q|k|v 2.46 -> 2.02 us with 16 rows and 8 warps, its gate|up 7.16 -> 6.80 with 8
    rows in 512-wide steps. llama-3.2-1b's (K = 2048) were fastest with the H100 plan there."""
    if wide_memory and K <= 1024:
        block_n, block_k, warps = (16, 1024, 8) if N < 4 * K else (8, 512, 4)  # q|k|v-like, gate|up-like
        return _BLOCK_N_OVERRIDE or block_n, block_k, warps
    block_n, block_k, warps = gemv_plan(N, K)
    return _BLOCK_N_OVERRIDE or block_n * 2, block_k, warps


def norm_gemv_triton(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     weight: torch.Tensor, bias: torch.Tensor | None = None,
                     block: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [1, K] -> (rms_norm(x + residual) * norm_weight . weight^T (+ bias) [1, N], x + residual [1, K]).

    One launch; the outputs in x's dtype. `block` = (BLOCK_N, BLOCK_K, num_warps) overrides
    `norm_gemv_plan` (tests)."""
    (m, k), (n, k_w) = x.shape, weight.shape
    if m != 1 or k != k_w or residual.shape != x.shape or norm_weight.shape != (k,):
        raise ValueError(f"norm_gemv_triton: x {tuple(x.shape)} and residual {tuple(residual.shape)} must be [1, K] "
                         f"and norm_weight {tuple(norm_weight.shape)} [K], with K = weight's {k_w}")
    if x.stride(1) != 1 or residual.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"norm_gemv_triton: x, residual and weight need unit stride along K, got {x.stride()}, "
                         f"{residual.stride()}, {weight.stride()}")
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)  # [1, N]
    res_out = torch.empty(1, k, dtype=x.dtype, device=x.device)  # [1, K]
    block_n, block_k, warps = norm_gemv_plan(n, k, wide_memory_part(x.device)) if block is None else block
    launch = pdl_launch(x.device, 1)  # {} unless PDL is on (graphrunner.kernels.pdl)
    _norm_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual, norm_weight, weight, bias if bias is not None else weight, y, res_out, n, k, eps,
        weight.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, GDC=bool(launch),
        num_warps=warps, **launch)
    return y, res_out


def _norm_gemv_fits(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> bool:
    return (NORM_GEMV and HAS_TRITON and x.is_cuda and x.shape[0] == 1 and x.dtype in _DTYPES
            and weight.shape[1] <= NORM_GEMV_MAX_K and residual.dtype == norm_weight.dtype == weight.dtype == x.dtype
            and x.stride(-1) == 1 and residual.stride(-1) == 1 and weight.stride(-1) == 1
            and (bias is None or bias.dtype == x.dtype))


def add_norm_linear_reference(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                              weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The two-step path: fused add + RMSNorm (Triton on CUDA, torch elsewhere), then the projection."""
    normed, res = add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight, bias), res


@torch.library.custom_op("graphrunner::add_norm_linear", mutates_args=())
def add_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, K] -> (linear(rms_norm(x + residual) * norm_weight) [T, N], x + residual [T, K]).

    One row on CUDA: `norm_gemv_triton`, one launch. Otherwise the fused norm kernel and the
    projection. The choice is made on the real shapes, at run time."""
    if _norm_gemv_fits(x, residual, norm_weight, weight, bias):
        return norm_gemv_triton(x, residual, norm_weight, eps, weight, bias)
    return add_norm_linear_reference(x, residual, norm_weight, eps, weight, bias)


@add_norm_linear.register_fake
def _add_norm_linear_fake(x, residual, norm_weight, eps, weight, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape[0], weight.shape[0]), torch.empty(x.shape, dtype=x.dtype, device=x.device)


def add_norm_project(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor,
                     proj: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(proj(norm(x + residual)), x + residual): a decoder half's entry, x and residual [T, K].

    `proj` is a column projection (its `weight` [N, K] and `bias` are this rank's share;
    it communicates nothing). On CUDA it is the op `graphrunner::add_norm_linear`, one
    launch at one row; elsewhere `norm.add_norm`, then `proj`."""
    if NORM_GEMV and HAS_TRITON and x.is_cuda and x.dim() == 2:
        return torch.ops.graphrunner.add_norm_linear(x, residual, norm.weight, norm.eps, proj.weight, proj.bias)
    normed, residual = norm.add_norm(x, residual)
    return proj(normed), residual
