"""The single-row projection kernels of graphrunner.layers.linear, their launch plans and torch references.

At M = 1 (decode at batch 1) a projection is a pure read of W. cuBLAS picks split-K GEMMs there
(often with a separate reduce kernel); a row-blocked GEMV measured faster on every decode
projection of qwen2.5-0.5b, llama-3.2-1b and llama-3.1-8b on an H100, 1.08-1.6x, the LM head
included. Program j owns BLOCK_N output rows, reads those rows of W once over the full K in
BLOCK_K steps, accumulates the fp32 products elementwise and sums them once at the end: no
split-K, no reduce kernel, no memset, and with ~N programs each SM keeps many loads in flight.
x (a few KiB) is re-read from L2. The results differ from cuBLAS's by the summation order only
(fp32 accumulation, one rounding to the output dtype), as cuBLAS's own split-K choices do.

- `gemv_triton`: y = x . W^T (+ b); with `swiglu=True` x = [gate | up] and each x tile is formed
  as silu(gate) * up while it loads (the MLP's down projection: no SiLU·mul kernel before it).
- `norm_gemv_triton`: the pre-norm block boundary and the projection after it. Every program
  loads the row x, the residual and the norm weight (a few KiB, from L2 after the first
  program), sums x and the residual in the activation dtype, takes the fp32 statistics, rounds
  the normalized row exactly as `rms_norm` does, and multiplies its rows of W with it; program
  0 also stores the sum, the next residual. On an H100 the separate norm node cost ~1.5 us of
  launch and drain, twice a layer; the recomputation costs each program a few KiB of L2 reads.
- `silu_mul_triton`: silu(gate) * up for several rows, one kernel (fp32, one rounding).

Each kernel computes silu(gate) * up and the normalized row in fp32 and rounds them once to
the activation dtype, as the unfused kernels store them, so the fused and unfused paths agree.
`gemv_plan` / `norm_gemv_plan` give the tiles, keyed by shapes and `DeviceProperties`.
"""

from __future__ import annotations

import torch

from graphrunner.kernels import HAS_TRITON
from graphrunner.kernels.device import DeviceProperties
from graphrunner.kernels.pdl import pdl_launch

__all__ = ["GEMV_DTYPES", "Tile", "gemv_extra_rows_triton", "gemv_fits", "gemv_plan", "gemv_triton", "norm_gemv_plan",
           "norm_gemv_triton", "silu_mul_triton"]

GEMV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
Tile = tuple[int, int, int]  # (BLOCK_N, BLOCK_K, num_warps)
_VOCAB_HEAD_ROWS = 32768  # N from here on is an LM head (vocabularies), not a layer projection
_SILU_BLOCK = 1024  # elements of one row per SiLU·mul program

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
    def x_tile(x_ptr, ks, K, EVEN_K: tl.constexpr, SWIGLU: tl.constexpr):
        # x at columns ks as fp32; with SWIGLU x_ptr holds [gate (K) | up (K)] and x = silu(gate) * up,
        # computed in fp32 and rounded once to the input dtype (the unfused SiLU·mul's stored value).
        # The fp8 GEMV (layers/fp8.py) loads its row through it too.
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
        return w.to(tl.float32) * x_tile(x_ptr, ks, K, EVEN_K, SWIGLU)[None, :]

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn, a_ptr, h_ptr, NA, stride_an,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     GDC: tl.constexpr, SWIGLU: tl.constexpr, EXTRA: tl.constexpr):
        # Program j: y[j*BLOCK_N : (j+1)*BLOCK_N] = W[those rows] . x, over the full K. With EXTRA, the
        # programs past W's rows do the same for the NA rows of A (stride_an) into h, fp32, unrounded.
        pid = tl.program_id(0)
        w_programs = tl.cdiv(N, BLOCK_N)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        ok = rows < N
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
        if EXTRA:
            if pid >= w_programs:
                rows = (pid - w_programs) * BLOCK_N + tl.arange(0, BLOCK_N)
                ok = rows < NA
                w_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_an
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
            acc += w0.to(tl.float32) * x_tile(x_ptr, ks0, K, False, SWIGLU)[None, :]
            k_start = BLOCK_K
        for k0 in range(k_start, K, BLOCK_K):
            acc += _tile_product(x_ptr, w_rows, ok, k0 + ks0, K, EVEN_K, SWIGLU)
        y = tl.sum(acc, axis=1)  # [BLOCK_N]
        if EXTRA:
            if pid >= w_programs:
                tl.store(h_ptr + rows, y, mask=ok)
            else:
                _store_rows(y, b_ptr, y_ptr, rows, ok, HAS_BIAS)
        else:
            _store_rows(y, b_ptr, y_ptr, rows, ok, HAS_BIAS)

    @triton.jit
    def _store_rows(y, b_ptr, y_ptr, rows, ok, HAS_BIAS: tl.constexpr):
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=ok)

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
        _store_rows(y, b_ptr, y_ptr, rows, ok, HAS_BIAS)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, gu_stride, out_ptr, out_stride, half, BLOCK: tl.constexpr):
        # Program (row, block): out[row, block] = silu(gate) * up, in fp32, rounded once.
        row, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        on = cols < half  # half = I, the width of gate (and of up)
        g = tl.load(gu_ptr + row * gu_stride + cols, mask=on, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * gu_stride + half + cols, mask=on, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=on)


def _wide_memory(device: DeviceProperties | None) -> bool:
    return device is not None and device.wide_memory


def gemv_plan(N: int, K: int, device: DeviceProperties | None = None) -> Tile:
    """(BLOCK_N, BLOCK_K, num_warps) of `gemv_triton` for W [N, K] on `device`.

    The base plan, from a sweep of 42 configurations per shape on an H100: long rows
    (K >= 4096) one per program in 2048-wide steps, shorter ones two per program in 1024-wide
    steps; 8 warps for the mid-length rows of down projections (4096 < K < 12288).

    Wide-memory parts (`DeviceProperties.wide_memory`, an H200's ~1.4x bandwidth) want more bytes
    in flight per program. The same sweep on an H200 put four or eight rows per program first on
    every llama-3.1-8b shape (N >= K >= 4096, and K >= 12288), 10-19% faster; batch-1 steps went
    4.57 / 4.63 -> 4.24 / 4.15 ms. Sweeping the qwen2.5-0.5b and llama-3.2-1b shapes there added
    four classes: down projections with 4096 <= K < 12288 (qwen's SwiGLU down 7.86 -> 4.39 us,
    llama-3.2-1b's 9.57 -> 8.68), vocabulary heads with K < 4096 (qwen's 92.5 -> 62.8 us;
    llama-3.2-1b's unchanged at 115.6), rows of at most 1024 (qwen's o 1.38 -> 1.24 us) and rows
    of exactly 2048 (llama-3.2-1b's o 3.23 -> 2.86 us); with `norm_gemv_plan`'s wide plan qwen
    batch 1 went 0.771 / 0.761 -> 0.647 / 0.656 ms. Other K keep the base plan."""
    if _wide_memory(device):
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


def norm_gemv_plan(N: int, K: int, device: DeviceProperties | None = None) -> Tile:
    """(BLOCK_N, BLOCK_K, num_warps) of `norm_gemv_triton`: the GEMV's base plan with twice the
    rows per program, so the row, residual and norm weight each program re-reads stay small next
    to its W tile.

    Wide-memory parts: rows of at most 1024 want more rows per program still (H200: qwen2.5-0.5b's
    q|k|v 2.46 -> 2.02 us with 16 rows and 8 warps, its gate|up 7.16 -> 6.80 us with 8 rows in
    512-wide steps). llama-3.2-1b's (K = 2048) were fastest with the base plan there."""
    if _wide_memory(device) and K <= 1024:
        return (16, 1024, 8) if N < 4 * K else (8, 512, 4)  # q|k|v-like, gate|up-like
    block_n, block_k, warps = gemv_plan(N, K)
    return block_n * 2, block_k, warps



def gemv_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether x . weight^T (+ bias) is a `gemv_triton` launch: one row of a GEMV dtype, the weight's,
    unit stride along K."""
    return (x.dim() == 2 and x.shape[0] == 1 and x.dtype == weight.dtype and x.dtype in GEMV_DTYPES
            and x.stride(-1) == 1 and weight.stride(-1) == 1 and (bias is None or bias.dtype == x.dtype))


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: Tile, *,
                out_dtype: torch.dtype | None = None, swiglu: bool = False, pdl_rows: int = 0) -> torch.Tensor:
    """x [1, K] (unit stride) . weight [N, K]^T (+ bias [N]) -> [1, N] in `out_dtype` (default x's; one launch).

    The fp32 sum is rounded once, to `out_dtype`: the LM head asks for float32 and gets the
    accumulator itself, with no cast kernel after. With `swiglu`, x is [1, 2K] = [gate | up] and
    the product is with silu(gate) * up. `tile` = (BLOCK_N, BLOCK_K, num_warps) (`gemv_plan`);
    `pdl_rows` >= 1 launches it with PDL (graphrunner.kernels.pdl)."""
    (m, k_x), (n, k) = x.shape, weight.shape
    if m != 1 or k_x != (2 * k if swiglu else k):
        want = "[1, 2K] (gate | up)" if swiglu else "[1, K]"
        raise ValueError(f"gemv_triton: x {tuple(x.shape)} must be {want} with K = weight's {k}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv_triton: x and weight need unit stride along K, got {x.stride()}, {weight.stride()}")
    y = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)  # [1, N]
    _launch_gemv(x, weight, bias, y, tile, swiglu, pdl_rows)
    return y


def gemv_extra_rows_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, extra: torch.Tensor,
                           tile: Tile, *, pdl_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x . weight^T (+ bias) [1, N] in x's dtype, x . extra^T [1, NA] in fp32), one launch: the programs
    past weight's rows read `extra`'s (NA rows of K, unit stride along K; e.g. every LoRA slot's A of a
    projection, whose products with x are then that projection's shrink, without a launch of its own)."""
    (m, k_x), (n, k) = x.shape, weight.shape
    if m != 1 or k_x != k or extra.dim() != 2 or extra.shape[1] != k or extra.dtype != weight.dtype:
        raise ValueError(f"gemv_extra_rows_triton: x {tuple(x.shape)} must be [1, K] and extra "
                         f"{tuple(extra.shape)} [NA, K] of {weight.dtype}, K = weight's {k}")
    if x.stride(1) != 1 or weight.stride(1) != 1 or extra.stride(1) != 1:
        raise ValueError(f"gemv_extra_rows_triton: x, weight and extra need unit stride along K, got {x.stride()}, "
                         f"{weight.stride()}, {extra.stride()}")
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    h = torch.empty(1, extra.shape[0], dtype=torch.float32, device=x.device)
    _launch_gemv(x, weight, bias, y, tile, False, pdl_rows, extra, h)
    return y, h


def _launch_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, tile: Tile,
                 swiglu: bool, pdl_rows: int, extra: torch.Tensor | None = None, h: torch.Tensor | None = None) -> None:
    n, k = weight.shape
    block_n, block_k, warps = tile
    launch = pdl_launch(1, pdl_rows)
    na = 0 if extra is None else extra.shape[0]
    _gemv_kernel[(triton.cdiv(n, block_n) + triton.cdiv(na, block_n),)](
        x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0),
        extra if extra is not None else weight, h if h is not None else y, na,
        extra.stride(0) if extra is not None else 0, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, GDC=bool(launch), SWIGLU=swiglu, EXTRA=extra is not None, num_warps=warps,
        **launch)


def norm_gemv_triton(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     weight: torch.Tensor, bias: torch.Tensor | None, tile: Tile, *,
                     pdl_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [1, K] -> (rms_norm(x + residual) * norm_weight . weight^T (+ bias) [1, N], x + residual [1, K]).

    One launch; the outputs in x's dtype. `tile` = (BLOCK_N, BLOCK_K, num_warps) (`norm_gemv_plan`)."""
    (m, k), (n, k_w) = x.shape, weight.shape
    if m != 1 or k != k_w or residual.shape != x.shape or norm_weight.shape != (k,):
        raise ValueError(f"norm_gemv_triton: x {tuple(x.shape)} and residual {tuple(residual.shape)} must be [1, K] "
                         f"and norm_weight {tuple(norm_weight.shape)} [K], with K = weight's {k_w}")
    if x.stride(1) != 1 or residual.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"norm_gemv_triton: x, residual and weight need unit stride along K, got {x.stride()}, "
                         f"{residual.stride()}, {weight.stride()}")
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)  # [1, N]
    res_out = torch.empty(1, k, dtype=x.dtype, device=x.device)  # [1, K]
    block_n, block_k, warps = tile
    launch = pdl_launch(1, pdl_rows)
    _norm_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual, norm_weight, weight, bias if bias is not None else weight, y, res_out, n, k, eps,
        weight.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, GDC=bool(launch),
        num_warps=warps, **launch)
    return y, res_out


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """silu(gate) * up in one kernel: fp32 math, one rounding to gate_up's dtype."""
    rows, two_i = gate_up.shape
    if two_i % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} (strides {gate_up.stride()}) must be [T, 2I], unit stride")
    i = two_i // 2
    out = torch.empty(rows, i, dtype=gate_up.dtype, device=gate_up.device)  # [T, I]
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(i, _SILU_BLOCK))](gate_up, gate_up.stride(0), out, out.stride(0), i,
                                                              BLOCK=_SILU_BLOCK, num_warps=4)
    return out
