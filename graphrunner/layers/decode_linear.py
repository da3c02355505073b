"""`y = x @ W^T (+ b)` with a one-launch GEMV for a single token row on CUDA (decode at batch 1).

At M = 1 a projection is a pure read of W. cuBLAS picks split-K GEMMs there (often with a
separate reduce kernel); a row-blocked GEMV measured faster on every decode projection of
qwen2.5-0.5b, llama-3.2-1b and llama-3.1-8b on an H100, 1.08-1.6x, the LM head included.
Program j owns BLOCK_N (1 or 2) output rows,
reads those rows of W once over the full K in BLOCK_K steps, accumulates the fp32 products
elementwise and sums them once at the end: no split-K, no reduce kernel, no memset, and with
~N programs each SM keeps many loads in flight. x (a few KiB) is re-read from L2.

Rows > 1 (prefills, batched decode) keep `F.linear`: this kernel would read W once per row.
The results differ from cuBLAS's by the summation order only (fp32 accumulation, one rounding
to the output dtype), as cuBLAS's own split-K choices do between shapes.

`gemv_triton(..., swiglu=True)` takes x = [gate | up] and forms each x tile as silu(gate) * up
while it loads it (layers/swiglu.py: the MLP's down projection at batch 1).

`linear(x, weight, bias)` is what the layers call. Eagerly it dispatches on the row count in
Python. Under torch.compile (the PIECEWISE pieces and the FULL graph bodies) it is the opaque
custom op `graphrunner::decode_linear`, which chooses at run time on the real shapes, so one
compiled graph serves every size. `GRAPHRUNNER_DECODE_GEMV=0` (read once at import) keeps
`F.linear` everywhere, for comparisons. CPU tensors always take `F.linear`.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from graphrunner.kernels import HAS_TRITON
from graphrunner.kernels.pdl import pdl_launch

__all__ = ["DECODE_GEMV", "gemv_fits", "gemv_plan", "gemv_serves", "gemv_triton", "linear", "wide_memory_part"]

DECODE_GEMV = os.environ.get("GRAPHRUNNER_DECODE_GEMV", "1") != "0"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_VOCAB_HEAD_ROWS = 32768  # N from here on is an LM head (vocabularies), not a layer projection

if HAS_TRITON:
    import triton
    import triton.language as tl

    from graphrunner.kernels.pdl import pdl_wait

    @triton.jit
    def _load_k(ptr, ks, K, EVEN_K: tl.constexpr):
        # [BLOCK_K] elements at columns ks as fp32 (unmasked, so vectorized, when K is whole blocks).
        if EVEN_K:
            v = tl.load(ptr + ks)
        else:
            v = tl.load(ptr + ks, mask=ks < K, other=0.0)
        return v.to(tl.float32)

    @triton.jit
    def _x_tile(x_ptr, ks, K, EVEN_K: tl.constexpr, SWIGLU: tl.constexpr):
        # x at columns ks as fp32; with SWIGLU x_ptr holds [gate (K) | up (K)] and x = silu(gate) * up,
        # computed in fp32 and rounded once to the input dtype (the unfused SiLU·mul's stored value).
        if SWIGLU:
            g = _load_k(x_ptr, ks, K, EVEN_K)
            x = (g * tl.sigmoid(g) * _load_k(x_ptr + K, ks, K, EVEN_K)).to(x_ptr.dtype.element_ty).to(tl.float32)
        else:
            x = _load_k(x_ptr, ks, K, EVEN_K)
        return x

    @triton.jit
    def _tile_product(x_ptr, w_rows, ok, ks, K, EVEN_K: tl.constexpr, SWIGLU: tl.constexpr):
        # [BLOCK_N, BLOCK_K] fp32 products of the rows' W tile at columns ks with x's.
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :], mask=ok[:, None], other=0.0)
        else:
            w = tl.load(w_rows + ks[None, :], mask=ok[:, None] & (ks[None, :] < K), other=0.0)
        return w.to(tl.float32) * _x_tile(x_ptr, ks, K, EVEN_K, SWIGLU)[None, :]

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, GDC: tl.constexpr, SWIGLU: tl.constexpr):
        # Program j: y[j*BLOCK_N : (j+1)*BLOCK_N] = W[those rows] . x, over the full K.
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        ok = rows < N
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
        ks0 = tl.arange(0, BLOCK_K)  # [BLOCK_K]
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        k_start = 0
        if GDC:
            # Launched with PDL (graphrunner.kernels.pdl): the weights are no kernel's output, so the
            # first W tile is read while the previous kernel finishes; x only after the wait.
            if EVEN_K:
                w0 = tl.load(w_rows + ks0[None, :], mask=ok[:, None], other=0.0)
            else:
                w0 = tl.load(w_rows + ks0[None, :], mask=ok[:, None] & (ks0[None, :] < K), other=0.0)
            pdl_wait(GDC)
            acc += w0.to(tl.float32) * _x_tile(x_ptr, ks0, K, False, SWIGLU)[None, :]
            k_start = BLOCK_K
        for k0 in range(k_start, K, BLOCK_K):
            acc += _tile_product(x_ptr, w_rows, ok, k0 + ks0, K, EVEN_K, SWIGLU)
        y = tl.sum(acc, axis=1)  # [BLOCK_N]
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=ok)


def gemv_plan(N: int, K: int, wide_memory: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) from an H100 sweep (42 configurations per shape): long rows
    (K >= 4096) one per program in 2048-wide steps, shorter ones two per program in 1024-wide
    steps; 8 warps for the mid-length rows of down projections (4096 < K < 12288).

    `wide_memory` (an H200-class part, `wide_memory_part`): its ~1.4x bandwidth wants more bytes in
    flight per program. The same sweep on an H200 put four or eight rows per program first on every
    llama-3.1-8b shape, 10-19% faster, and the step went 4.57 / 4.63 -> 4.24 / 4.15 ms at batch 1
    (shape classes N >= K >= 4096, and K >= 12288). A sweep of the qwen2.5-0.5b and llama-3.2-1b
    shapes added four classes: down
    projections with 4096 <= K < 12288 (qwen's SwiGLU down 7.86 -> 4.39 us, llama-3.2-1b's 9.57 ->
    8.68), vocabulary heads with K < 4096 (qwen's 92.5 -> 62.8 us; llama-3.2-1b's unchanged at
    115.6), rows of at most 1024 (qwen's o 1.38 -> 1.24) and rows of exactly 2048 (llama-3.2-1b's
    o 3.23 -> 2.86); with the norm GEMV's H200 plan (`norm_linear.norm_gemv_plan`) qwen batch 1 went
    0.771 / 0.761 -> 0.647 / 0.656 ms. Other K keep the H100 plan."""
    if wide_memory:
        if K >= 12288:
            return 4, 2048, 4
        if K >= 4096:
            return (8, 1024, 4) if N == K else (4, 2048, 8) if N > K else (8, 2048, 8)
        if N >= _VOCAB_HEAD_ROWS or K <= 1024:
            return 4, 1024, 4
        if K == 2048:
            return 2, 2048, 4
    if K >= 4096:
        return 1, 2048, 8 if 4096 < K < 12288 else 4
    return 2, 1024, 4


@functools.cache
def _wide_memory_cuda(index: int) -> bool:
    return "H200" in torch.cuda.get_device_name(index)


def wide_memory_part(device: torch.device) -> bool:
    """Whether `device` is an H200-class GPU (HBM3e; the GH200 included), for `gemv_plan`."""
    return device.type == "cuda" and _wide_memory_cuda(device.index if device.index is not None
                                                       else torch.cuda.current_device())


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                block: tuple[int, int, int] | None = None, out_dtype: torch.dtype | None = None,
                swiglu: bool = False) -> torch.Tensor:
    """x [1, K] (unit stride) . weight [N, K]^T (+ bias [N]) -> [1, N] in `out_dtype` (default x's; one launch).

    The fp32 sum is rounded once, to `out_dtype`: the LM head asks for float32 and gets the
    accumulator itself, with no cast kernel after. With `swiglu`, x is [1, 2K] = [gate | up] and
    the product is with silu(gate) * up (module docstring). `block` = (BLOCK_N, BLOCK_K, num_warps)
    overrides `gemv_plan` (tests)."""
    (m, k_x), (n, k) = x.shape, weight.shape
    if m != 1 or k_x != (2 * k if swiglu else k):
        want = "[1, 2K] (gate | up)" if swiglu else "[1, K]"
        raise ValueError(f"gemv_triton: x {tuple(x.shape)} must be {want} with K = weight's {k}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv_triton: x and weight need unit stride along K, got {x.stride()}, {weight.stride()}")
    y = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)  # [1, N]
    block_n, block_k, warps = gemv_plan(n, k, wide_memory_part(x.device)) if block is None else block
    launch = pdl_launch(x.device, 1)  # {} unless PDL is on (graphrunner.kernels.pdl)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0), HAS_BIAS=bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, GDC=bool(launch), SWIGLU=swiglu,
        num_warps=warps, **launch)
    return y


def gemv_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` would run x [T, K] . weight^T as the one-launch GEMV (eagerly)."""
    return DECODE_GEMV and HAS_TRITON and x.is_cuda and x.dim() == 2 and gemv_fits(x, weight, None)


def gemv_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (x.shape[0] == 1 and x.dtype == weight.dtype and x.dtype in _DTYPES and x.stride(-1) == 1
            and weight.stride(-1) == 1 and (bias is None or bias.dtype == x.dtype))


@torch.library.custom_op("graphrunner::decode_linear", mutates_args=())
def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with gemv_triton for a single row: the choice made on the real shapes at run time."""
    if gemv_fits(x, weight, bias):
        return gemv_triton(x, weight, bias)
    return F.linear(x, weight, bias)


@decode_linear.register_fake
def _decode_linear_fake(x, weight, bias=None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] -> [T, N]: F.linear, or on CUDA for T = 1 the one-launch GEMV (module docstring)."""
    if not (DECODE_GEMV and HAS_TRITON and x.is_cuda and x.dim() == 2):
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling():
        return decode_linear(x, weight, bias)
    return gemv_triton(x, weight, bias) if gemv_fits(x, weight, bias) else F.linear(x, weight, bias)
