"""fp8 (e4m3) weight projections: quantization, the exact torch reference and the CUDA kernels.

The arithmetic (`fp8_linear_reference`, which every path implements): the weight is stored as
float8_e4m3fn with fp32 scales, per output channel ([N]), per tensor ([1]) or per (bn, bk) tile
([ceil(N/bn), ceil(K/bk)], the block format). The activation is quantized on the fly, per token
(scale = amax(|row|) / 448), per token and bk-column group in the block format, or with a static
scale from the checkpoint. Both are dequantized to fp32 (q * scale, rounded once), multiplied in
fp32, the bias added in fp32, and the sum rounded once to the output dtype. A scale of zero (an
all-zero row, group or tile) is replaced by 1.0, so nothing divides by zero.

The CUDA paths (`fp8_linear`), chosen on the real shapes at run time inside one opaque custom op
(`graphrunner::fp8_linear`, as `graphrunner::decode_linear` in linear.py):

- one row (decode at batch 1): `fp8_gemv_triton`. Program j owns BLOCK_N output rows and reads
  their fp8 weights once over the full K: half the bytes of a bf16 GEMV, which is what bounds
  decode. Every program quantizes x itself: a first pass over x for the row's amax (x is a few
  KiB, re-read from L2), then each x tile is quantized as it loads, exactly as `quantize_act_fp8`
  does (times the scale's reciprocal, round to nearest even, +-448 clamp). The products accumulate in fp32
  elementwise and both scales apply once at the end. In the block format the tile is viewed as
  [BLOCK_N, BLOCK_K // bk, bk] and each element is dequantized by its group's and tile's scales
  (the reference's own products), so one pass suffices: a group's amax lies within its tile.
- several rows, per-channel or per-tensor weights: `torch._scaled_mm` (cuBLASLt / CUTLASS fp8
  tensor cores) with row-wise scales, x quantized first by one Triton launch
  (`_act_quant_kernel`). _scaled_mm needs K and N multiples of 16 and a bf16 output; other cases
  run the Triton GEMM below.
- several rows, block scales (and the cases above that _scaled_mm refuses): `fp8_gemm_triton`,
  one program per (BLOCK_M, BLOCK_N) output tile with fp8 `tl.dot` (tensor-core mma). In the block
  format BLOCK_K equals the group bk: each K step quantizes its x tile per row (the group's amax
  is the tile row's), multiplies, and adds the fp32 partial product times both tile scales. With
  per-token scales a first pass over the program's rows of x finds their amax.

Kernels take fp8 tensors as uint8 views and bitcast inside. Converting fp32 to fp8 is the one
operation the Triton interpreter (CPU tests) gets wrong: it rounds ties away from zero and loses
the carry into the exponent (124 became 64). Under the interpreter (`_EMULATE_FP8` below, fixed
at import) the kernels therefore round with integer operations on the fp32 bits (`graphrunner.kernels.fp8_bits`);
compiled for a GPU they use the hardware conversion (cvt.rn.satfinite), which rounds to nearest
even as torch does. fp8 -> fp32 and fp8 `tl.dot` are correct in the interpreter. The uint8 views
also keep the launches in the types tools/compile_check.py records.

Tiles are chosen once, where a layer is built (`fp8_gemv_plan`; `fp8_gemm_plan` runs per call on
the real row count, host-side only), and passed as plain tuples. Nothing here synchronizes with
the host or has a data-dependent shape: every path can be captured in a CUDA graph.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from graphrunner.kernels import HAS_TRITON

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "GemmTile",
    "Tile",
    "dequantize_fp8",
    "fp8_gemm_plan",
    "fp8_gemm_triton",
    "fp8_gemv_plan",
    "fp8_gemv_triton",
    "fp8_linear",
    "fp8_linear_op",
    "fp8_linear_reference",
    "quantize_act_fp8",
    "quantize_weight_fp8",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
Tile = tuple[int, int, int]  # the GEMV's (BLOCK_N, BLOCK_K, num_warps)
GemmTile = tuple[int, int, int, int]  # the GEMM's (BLOCK_M, BLOCK_N, BLOCK_K, num_warps)
_GEMM_STAGES = 3
# The smallest scale kept: fp32's smallest normal. A row whose amax / 448 is below it (all zeros,
# or values under 5.3e-36) gets scale 1.0 instead, so the reciprocal the quantization multiplies
# by stays finite (a subnormal scale's reciprocal is inf, and 0 * inf is NaN).
_MIN_SCALE = 2.0**-126
_ACT_QUANT_BLOCK = 1024  # columns per step of the activation quantization kernel
# Modes of the activation's scale in the kernels.
_PER_TOKEN, _STATIC, _GROUP = 0, 1, 2

if HAS_TRITON:
    import triton
    import triton.language as tl

    from graphrunner.kernels.fp8_bits import e4m3_bits
    from graphrunner.layers.gemv import silu_mul_triton, x_tile

    _EMULATE_FP8 = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
    _MIN_SCALE_C: tl.constexpr = tl.constexpr(_MIN_SCALE)

    @triton.jit
    def _tl_quantize(x, inv):
        # x fp32 (any shape) times inv (the scale's IEEE reciprocal, `_tl_inverse`) -> fp8e4nv values,
        # as quantize_act_fp8: one fp32 product, clamp, round to nearest even.
        v = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)
        if _EMULATE_FP8:
            q = e4m3_bits(v).to(tl.float8e4nv, bitcast=True)
        else:
            q = v.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        return q

    @triton.jit
    def _tl_scale_of(amax):
        # amax / 448, and 1.0 where that is below fp32's smallest normal (an all-zero row or group),
        # as `_scale_of` does in torch.
        s = tl.div_rn(amax, 448.0)
        return tl.where(s >= _MIN_SCALE_C, s, 1.0)

    @triton.jit
    def _tl_inverse(s):
        # 1 / s correctly rounded, as torch.reciprocal: computed once per row or group, so the
        # per-element quantization is one multiply (an IEEE division per element cost the batch-1
        # GEMV 3x its weight-read time).
        return tl.div_rn(s * 0.0 + 1.0, s)

    @triton.jit
    def _tl_row_scale(x_row, K, BLOCK: tl.constexpr, SWIGLU: tl.constexpr):
        # The per-token scale of the row at x_row (K elements): its amax over BLOCK-wide steps, / 448.
        cols = tl.arange(0, BLOCK)
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            amax = tl.maximum(amax, tl.abs(x_tile(x_row, k0 + cols, K, False, SWIGLU)))
        return _tl_scale_of(tl.max(amax, axis=0))

    @triton.jit
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, stride_s, STATIC: tl.constexpr,
                          GROUP: tl.constexpr, BLOCK: tl.constexpr):
        # Program (row, g): GROUP > 0 quantizes that row's g-th group of GROUP columns (BLOCK = GROUP);
        # otherwise the whole row, with its amax (or the static scale) found first.
        row, g = tl.program_id(0).to(tl.int64), tl.program_id(1)
        x_row, q_row = x_ptr + row * stride_x, q_ptr + row * stride_q
        cols0 = tl.arange(0, BLOCK)
        if GROUP > 0:
            cols = g * GROUP + cols0
            x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            s = _tl_scale_of(tl.max(tl.abs(x), axis=0))
            tl.store(q_row + cols, _tl_quantize(x, _tl_inverse(s)).to(tl.uint8, bitcast=True), mask=cols < K)
            tl.store(s_ptr + row * stride_s + g, s)
        else:
            if STATIC:
                s = tl.load(s_ptr)
            else:
                s = _tl_row_scale(x_row, K, BLOCK, False)
                tl.store(s_ptr + row * stride_s, s)
            inv = _tl_inverse(s)
            for k1 in range(0, K, BLOCK):
                cols = k1 + cols0
                x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
                tl.store(q_row + cols, _tl_quantize(x, inv).to(tl.uint8, bitcast=True), mask=cols < K)

    @triton.jit
    def _fp8_gemv_kernel(x_ptr, w_ptr, ws_ptr, xs_ptr, b_ptr, y_ptr, N, K, stride_wn, stride_wsn, BN_W,
                         MODE: tl.constexpr, W_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
                         SWIGLU: tl.constexpr):
        # Program j: y[j*BLOCK_N : (j+1)*BLOCK_N] = the rows' fp8 weights . quantized x, over the full K.
        # SWIGLU (MODE 0 / 1): x_ptr holds [gate | up] and x = silu(gate) * up (`gemv.x_tile`).
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        ok = rows < N
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
        ks0 = tl.arange(0, BLOCK_K)
        if MODE == 2:
            # Block format: the tile as [BLOCK_N, KB, GROUP]; group kb of the tile is x's group k0 / GROUP + kb.
            KB: tl.constexpr = BLOCK_K // GROUP
            kb = tl.arange(0, KB)
            gs = tl.arange(0, GROUP)
            ks3 = kb[:, None] * GROUP + gs[None, :]  # [KB, GROUP]
            ws_rows = ws_ptr + (rows // BN_W).to(tl.int64)[:, None] * stride_wsn  # [BLOCK_N, 1]
            num_groups = tl.cdiv(K, GROUP)
            acc3 = tl.zeros([BLOCK_N, KB, GROUP], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + ks3
                k_ok = ks < K
                x = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)  # [KB, GROUP]
                xs = _tl_scale_of(tl.max(tl.abs(x), axis=1))  # [KB]
                xd = _tl_quantize(x, _tl_inverse(xs)[:, None]).to(tl.float32) * xs[:, None]  # as the reference
                grp = k0 // GROUP + kb
                ws = tl.load(ws_rows + grp[None, :], mask=ok[:, None] & (grp[None, :] < num_groups), other=0.0)
                w = tl.load(w_rows[:, :, None] + ks[None, :, :], mask=ok[:, None, None] & k_ok[None, :, :], other=0)
                wd = w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * ws[:, :, None]  # W dequantized
                acc3 += wd * xd[None, :, :]
            y = tl.sum(tl.sum(acc3, axis=2), axis=1)
        else:
            if MODE == 1:
                xs = tl.load(xs_ptr)
            else:
                xs = _tl_row_scale(x_ptr, K, BLOCK_K, SWIGLU)  # a first pass; x is re-read from L2 in the second
            inv = _tl_inverse(xs)
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            for k1 in range(0, K, BLOCK_K):
                ks = k1 + ks0
                x = x_tile(x_ptr, ks, K, EVEN_K, SWIGLU)
                if EVEN_K:
                    w = tl.load(w_rows + ks[None, :], mask=ok[:, None], other=0)
                else:
                    w = tl.load(w_rows + ks[None, :], mask=ok[:, None] & (ks[None, :] < K), other=0)
                xq = _tl_quantize(x, inv).to(tl.float32)
                acc += w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * xq[None, :]
            if W_PER_ROW:
                ws = tl.load(ws_ptr + rows, mask=ok, other=0.0)
            else:
                ws = tl.load(ws_ptr)
            y = tl.sum(acc, axis=1) * xs * ws
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _fp8_gemm_kernel(x_ptr, w_ptr, ws_ptr, xs_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                         stride_wsn, BN_W, MODE: tl.constexpr, W_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        # Program (m, n): y[m tile, n tile] = quantized x . fp8 W^T with fp8 tensor-core dots. The M
        # tiles of one N tile are consecutive programs, so they share its weight tile in L2.
        num_m = tl.cdiv(M, BLOCK_M)
        pid = tl.program_id(0)
        pid_m, pid_n = pid % num_m, pid // num_m
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        r_ok, c_ok = rows < M, cols < N
        ks = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
        # Columns past N wrap to valid rows of W (dropped at the store), so weight loads need no row mask.
        w_cols = w_ptr + (cols % N).to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N]
        if MODE == 1:
            xs = tl.load(xs_ptr)
        elif MODE == 0:
            amax = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                amax = tl.maximum(amax, tl.abs(tl.load(x_rows + k0 + ks[None, :],
                                                       mask=r_ok[:, None] & (k0 + ks[None, :] < K),
                                                       other=0.0).to(tl.float32)))
            xs = _tl_scale_of(tl.max(amax, axis=1))[:, None]  # [BLOCK_M, 1]
        if MODE != 2:
            inv = _tl_inverse(xs)
        ws_cols = ws_ptr + ((cols % N) // BN_W).to(tl.int64) * stride_wsn  # [BLOCK_N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k1 in range(0, K, BLOCK_K):
            kk = k1 + ks
            if EVEN_K:
                x = tl.load(x_rows + kk[None, :], mask=r_ok[:, None], other=0.0).to(tl.float32)
                w = tl.load(w_cols + kk[:, None])  # [BLOCK_K, BLOCK_N], K contiguous
            else:
                x = tl.load(x_rows + kk[None, :], mask=r_ok[:, None] & (kk[None, :] < K), other=0.0).to(tl.float32)
                w = tl.load(w_cols + kk[:, None], mask=kk[:, None] < K, other=0)
            w = w.to(tl.float8e4nv, bitcast=True)
            if MODE == 2:
                # BLOCK_K is the group: the tile's row amax is the group's.
                xs_t = _tl_scale_of(tl.max(tl.abs(x), axis=1))[:, None]  # [BLOCK_M, 1]
                part = tl.dot(_tl_quantize(x, _tl_inverse(xs_t)), w, out_dtype=tl.float32)
                ws_t = tl.load(ws_cols + k1 // BLOCK_K)  # [BLOCK_N]
                acc += part * xs_t * ws_t[None, :]
            else:
                # Hopper's fp8 wgmma accumulates in reduced precision (about 14 bits, DeepSeek-V3 measured
                # errors near 2% at K = 4096), and Triton leaves it unpromoted on sm_90 by default: the
                # partial sum joins the fp32 accumulator after every BLOCK_K (128) columns, as DeepGEMM does
                # (64 fp32 adds per thread per step of a 64 x 128 tile, in the sm_90 PTX).
                acc = tl.dot(_tl_quantize(x, inv), w, acc, out_dtype=tl.float32, max_num_imprecise_acc=BLOCK_K)
        if MODE != 2:
            if W_PER_ROW:
                ws = tl.load(ws_cols)[None, :]
            else:
                ws = tl.load(ws_ptr)
            acc = acc * xs * ws
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=r_ok[:, None] & c_ok[None, :])


# ---------------------------------------------------------------------------------------------
# The torch definitions: quantization, dequantization and the reference projection.


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 in fp32, with 1.0 where that is below `_MIN_SCALE`: an all-zero row (or one
    whose amax / 448 underflows) quantizes to zeros, and every scale has a finite reciprocal."""
    amax = amax.float()
    # A tensor divisor: CUDA divides by a Python number as a multiply by its rounded reciprocal,
    # which is not the correctly rounded quotient the kernels compute (1 ulp off on some rows).
    scale = amax / torch.full_like(amax, FP8_MAX)
    return torch.where(scale >= _MIN_SCALE, scale, torch.ones_like(scale))


def _to_fp8(v: torch.Tensor) -> torch.Tensor:
    # torch's cast rounds to nearest even but makes NaN past 448 (e4m3fn has no infinity): clamp first.
    return v.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _padded_tiles(v: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """v [N, K] fp32 zero-padded to whole tiles, as [ceil(N/bn), bn, ceil(K/bk), bk]."""
    n, k = v.shape
    nb, kb = -(-n // bn), -(-k // bk)
    return F.pad(v, (0, kb * bk - k, 0, nb * bn - n)).view(nb, bn, kb, bk)


def _check_block(block: Sequence[int]) -> tuple[int, int]:
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"block must be two positive sizes (bn, bk), got {tuple(block)}")
    return int(block[0]), int(block[1])


def quantize_weight_fp8(w: torch.Tensor, block: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (w_q [N, K] float8_e4m3fn, scale fp32).

    Per output channel (block None): scale [N] = amax(|row|) / 448. block=(bn, bk): scale
    [ceil(N/bn), ceil(K/bk)], one per tile (edge tiles are partial). An all-zero row or tile gets
    scale 1.0. w_q = clamp(w / scale, -448, 448) rounded to nearest even, computed in fp32."""
    if w.dim() != 2:
        raise ValueError(f"quantize_weight_fp8: w must be [N, K], got {tuple(w.shape)}")
    wf = w.float()
    if block is None:
        scale = _scale_of(wf.abs().amax(dim=1))  # [N]
        return _to_fp8(wf / scale[:, None]), scale
    bn, bk = _check_block(block)
    n, k = wf.shape
    tiles = _padded_tiles(wf, bn, bk)  # [NB, bn, KB, bk]
    scale = _scale_of(tiles.abs().amax(dim=(1, 3)))  # [NB, KB]
    q = _to_fp8(tiles / scale[:, None, :, None]).view(tiles.shape[0] * bn, -1)[:n, :k]
    return q.contiguous(), scale


def quantize_act_fp8(x: torch.Tensor, group: int | None = None,
                     static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation quantization: x [T, K] -> (x_q float8_e4m3fn [T, K], scale fp32).

    Dynamic per token: scale [T, 1] = amax(|row|) / 448 (1.0 for an all-zero row). group=g: per
    token and g-column group (the block format's activations), scale [T, ceil(K/g)].
    static_scale (a [1] fp32 tensor from the checkpoint): that scale for every row, returned as
    [T, 1]; values past +-448 after scaling are clamped.

    Each element is multiplied by the scale's reciprocal (1 / scale, correctly rounded, once per
    row or group), as vLLM's activation quantization does: the kernels then quantize with one fp32
    multiply per element and stay bit-identical to this definition."""
    if x.dim() != 2:
        raise ValueError(f"quantize_act_fp8: x must be [T, K], got {tuple(x.shape)}")
    xf = x.float()
    t, k = xf.shape
    if static_scale is not None:
        if group is not None:
            raise ValueError("quantize_act_fp8: a static scale has no groups")
        s = static_scale.float().reshape(1, 1)
        return _to_fp8(xf * s.reciprocal()), s.expand(t, 1).contiguous()
    if group is None:
        scale = _scale_of(xf.abs().amax(dim=1, keepdim=True))  # [T, 1]
        return _to_fp8(xf * scale.reciprocal()), scale
    if group < 1:
        raise ValueError(f"quantize_act_fp8: group must be positive, got {group}")
    groups = _padded_tiles(xf, 1, group).view(t, -1, group)  # [T, G, g]
    scale = _scale_of(groups.abs().amax(dim=2))  # [T, G]
    return _to_fp8(groups * scale.reciprocal()[:, :, None]).view(t, -1)[:, :k].contiguous(), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """The fp32 values of q [N, K] (fp8) with its scales: q * scale, each product rounded once.

    scale: a [1] (or 0-d) per-tensor scale, [N] or [N, 1] per row, or with block=(bn, bk) the
    [ceil(N/bn), ceil(K/bk)] per-tile scales (block=(1, g) for quantize_act_fp8's groups)."""
    qf = q.float()
    scale = scale.float()
    if block is not None:
        bn, bk = _check_block(block)
        n, k = qf.shape
        full = scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
        return qf * full
    if scale.numel() == 1:
        return qf * scale.reshape(())
    if scale.dim() == 1:
        scale = scale[:, None]
    return qf * scale


def fp8_linear_reference(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                         *, block: tuple[int, int] | None = None, input_scale: torch.Tensor | None = None,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] . dequantized w_q [N, K]^T (+ bias [N]) -> [..., N] in `out_dtype` (default x's).

    The arithmetic every fp8 path implements: x quantized per token (per token and block[1]-column
    group with `block`, or with the static `input_scale`), x and W dequantized to fp32, one fp32
    matmul, the bias added in fp32, one rounding to out_dtype. The CPU path of the runner."""
    k = w_q.shape[1]
    x2 = x.reshape(-1, k)
    if block is not None:
        if input_scale is not None:
            raise ValueError("fp8_linear: the block format quantizes activations dynamically (no input_scale)")
        bn, bk = _check_block(block)
        xq, xs = quantize_act_fp8(x2, group=bk)
        xd, wd = dequantize_fp8(xq, xs, (1, bk)), dequantize_fp8(w_q, w_scale, (bn, bk))
    else:
        xq, xs = quantize_act_fp8(x2, static_scale=input_scale)
        xd, wd = dequantize_fp8(xq, xs), dequantize_fp8(w_q, w_scale)
    y = xd @ wd.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype).reshape(*x.shape[:-1], w_q.shape[0])


# ---------------------------------------------------------------------------------------------
# Plans and the Triton launches.


def fp8_gemv_plan(n: int, k: int) -> Tile:
    """(BLOCK_N, BLOCK_K, num_warps) of `fp8_gemv_triton` for fp8 W [N, K].

    From a sweep of 28 tiles (BLOCK_N 4-32, BLOCK_K 512-4096, 4-16 warps, 8-64 fp32 accumulators
    per thread) on an H200, per-channel scales. Unlike the bf16 GEMV, every program also quantizes
    x, so more rows per program pay for that work: 16 rows in 512-column steps won on most shapes
    (llama-3.1-8b q|k|v 16.66 -> 6.87 us, gate|up 74.18 -> 37.24 us against twice the bf16 plan's
    columns; the bf16 GEMVs take 15.81 and 64.88 us); square ones 8 rows in 1024-column steps
    (6.97 -> 5.51 us), long rows (K >= 12288) 32 rows with 16 warps (down 28.46 -> 19.63 us), and
    short ones (K <= 1024, N <= 2K) 4 rows over the whole row (qwen2.5-0.5b's q|k|v, 2.47 us)."""
    if k >= 12288:
        return 32, 1024, 16
    if n == k:
        return 8, 1024, 4
    if k <= 1024 and n <= 2 * k:
        return 4, 1024, 4
    return 16, 512, 4


def fp8_gemm_plan(m: int, n: int, k: int, group: int | None = None) -> GemmTile:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) of `fp8_gemm_triton` for M rows of x [M, K] and W [N, K].

    BLOCK_K is the block format's group (one scale per K step) or 128 (an fp8 wgmma is 32 deep);
    BLOCK_M follows the row count so that decode batches do not pad to 64 rows."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    return block_m, 128 if n >= 128 else 64, group or 128, 8 if block_m == 128 else 4


def _mode(block: tuple[int, int] | None, input_scale: torch.Tensor | None) -> int:
    if block is not None:
        if input_scale is not None:
            raise ValueError("fp8_linear: the block format quantizes activations dynamically (no input_scale)")
        return _GROUP
    return _STATIC if input_scale is not None else _PER_TOKEN


def _check_operands(name: str, x: torch.Tensor, w_q: torch.Tensor) -> None:
    if x.dim() != 2 or w_q.dim() != 2 or x.shape[1] != w_q.shape[1]:
        raise ValueError(f"{name}: x {tuple(x.shape)} must be [T, K] with K = w_q's {tuple(w_q.shape)}[1]")
    if x.stride(1) != 1 or w_q.stride(1) != 1 or w_q.dtype != FP8_DTYPE:
        raise ValueError(f"{name}: x and an fp8 w_q need unit stride along K, got {x.stride()}, {w_q.stride()}, "
                         f"{w_q.dtype}")


def _scale_args(w_scale: torch.Tensor, block: tuple[int, int] | None) -> tuple[int, int, bool]:
    """(stride of a row of W's scales, W rows per scale row, per-row scales?) for the kernels."""
    if block is not None:
        return w_scale.stride(0), block[0], True
    return 1, 1, w_scale.numel() != 1


def fp8_gemv_triton(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                    tile: Tile, *, block: tuple[int, int] | None = None,
                    input_scale: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
    """x [1, K] . w_q [N, K]^T with fp8 weights (+ bias [N]) -> [1, N] in x's dtype; one launch.

    Same quantization and scales as `fp8_linear_reference`. `tile` = (BLOCK_N, BLOCK_K, num_warps)
    (`fp8_gemv_plan`); with `block`, BLOCK_K is raised to block[1] where smaller (block[1] must be a
    power of two). w_scale: [N] / [N, 1] / [1], or [ceil(N/bn), ceil(K/bk)] with `block`.
    `swiglu`: x is [1, 2K], [gate | up], and the projection reads silu(gate) * up as `silu_mul_triton`
    would store it (per-channel, per-tensor or static scales; not the block format)."""
    if swiglu:
        if block is not None:
            raise ValueError("fp8_gemv_triton: swiglu=True takes per-channel, per-tensor or static scales, not block")
        if x.dim() != 2 or x.shape[1] != 2 * w_q.shape[1]:
            raise ValueError(f"fp8_gemv_triton: swiglu=True needs x [1, 2K] with K = w_q's {tuple(w_q.shape)}[1], "
                             f"got {tuple(x.shape)}")
        _check_operands("fp8_gemv_triton", x[:, : w_q.shape[1]], w_q)
    else:
        _check_operands("fp8_gemv_triton", x, w_q)
    if x.shape[0] != 1:
        raise ValueError(f"fp8_gemv_triton: x must be one row, got {tuple(x.shape)}")
    n, k = w_q.shape
    mode = _mode(block, input_scale)
    block_n, block_k, warps = tile
    group = 1
    if block is not None:
        group = block[1]
        if group & (group - 1):
            raise ValueError(f"fp8_gemv_triton: block[1] must be a power of two, got {group}")
        block_k = max(block_k, group)
    stride_wsn, bn_w, per_row = _scale_args(w_scale, block)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w_q.view(torch.uint8), w_scale, input_scale if input_scale is not None else w_scale,
        bias if bias is not None else w_scale, y, n, k, w_q.stride(0), stride_wsn, bn_w, MODE=mode, W_PER_ROW=per_row,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, GROUP=group, EVEN_K=k % block_k == 0,
        SWIGLU=swiglu, num_warps=warps)
    return y


def fp8_gemm_triton(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                    *, block: tuple[int, int] | None = None, input_scale: torch.Tensor | None = None,
                    tile: GemmTile | None = None) -> torch.Tensor:
    """x [M, K] . w_q [N, K]^T with fp8 weights (+ bias [N]) -> [M, N] in x's dtype; one launch.

    Same quantization and scales as `fp8_linear_reference`, fp8 tensor-core dots with fp32
    accumulation. `tile` = (BLOCK_M, BLOCK_N, BLOCK_K, num_warps), default `fp8_gemm_plan`; with
    `block`, BLOCK_K must equal block[1] (a power of two >= 16)."""
    _check_operands("fp8_gemm_triton", x, w_q)
    (m, k), n = x.shape, w_q.shape[0]
    mode = _mode(block, input_scale)
    block_m, block_n, block_k, warps = tile or fp8_gemm_plan(m, n, k, block[1] if block is not None else None)
    if block is not None and block_k != block[1]:
        raise ValueError(f"fp8_gemm_triton: BLOCK_K {block_k} must be the block's group {block[1]}")
    stride_wsn, bn_w, per_row = _scale_args(w_scale, block)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        _fp8_gemm_kernel[(triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)](
            x, w_q.view(torch.uint8), w_scale, input_scale if input_scale is not None else w_scale,
            bias if bias is not None else w_scale, y, m, n, k, x.stride(0), w_q.stride(0), y.stride(0), stride_wsn,
            bn_w, MODE=mode, W_PER_ROW=per_row, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=warps, num_stages=_GEMM_STAGES)
    return y


def _quantize_act_triton(x: torch.Tensor, input_scale: torch.Tensor | None,
                         group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_act_fp8` in one launch (bit-identical): x [T, K] -> (fp8 [T, K], fp32 [T, 1] or [T, G]).
    `group` must be a power of two."""
    t, k = x.shape
    q = torch.empty(t, k, dtype=FP8_DTYPE, device=x.device)
    if group is not None:
        scale = torch.empty(t, -(-k // group), dtype=torch.float32, device=x.device)
        grid, block = (t, scale.shape[1]), group
    elif input_scale is not None:
        scale = input_scale.float().reshape(1, 1).expand(t, 1).contiguous()
        grid, block = (t, 1), _ACT_QUANT_BLOCK
    else:
        scale = torch.empty(t, 1, dtype=torch.float32, device=x.device)
        grid, block = (t, 1), _ACT_QUANT_BLOCK
    if t:
        _act_quant_kernel[grid](x, q.view(torch.uint8), scale, k, x.stride(0), q.stride(0), scale.stride(0),
                                STATIC=input_scale is not None, GROUP=group or 0, BLOCK=block, num_warps=4)
    return q, scale


# torch._scaled_mm's fp8 GEMMs: operand dims multiples of 16, row-wise scales with a bf16 output.
_SCALED_MM_ALIGN = 16


def _scaled_mm_fits(x: torch.Tensor, w_q: torch.Tensor, bias: torch.Tensor | None) -> bool:
    n, k = w_q.shape
    return (x.is_cuda and x.dtype == torch.bfloat16 and k % _SCALED_MM_ALIGN == 0 and n % _SCALED_MM_ALIGN == 0
            and w_q.is_contiguous() and (bias is None or bias.dtype == torch.bfloat16)
            and torch.cuda.get_device_capability(x.device) >= (8, 9))


def _scaled_mm_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                      input_scale: torch.Tensor | None) -> torch.Tensor:
    """Per-channel / per-tensor fp8 weights, several rows: x quantized by one Triton launch, then
    torch._scaled_mm with row-wise scales (x [T, 1], W [1, N]); the bias joins its fp32 epilogue."""
    xq, xs = _quantize_act_triton(x, input_scale)
    n = w_q.shape[0]
    ws = w_scale.float().reshape(1, -1).expand(1, n).contiguous()  # [1, N]
    return torch._scaled_mm(xq, w_q.t(), scale_a=xs, scale_b=ws, bias=bias, out_dtype=x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2K] -> [T, K] silu(gate) * up: `silu_mul_triton` on CUDA (fp32 math, one rounding), torch
    elsewhere (as the unquantized model computes it)."""
    if gate_up.is_cuda and HAS_TRITON:
        return silu_mul_triton(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _fp8_linear_rows(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                     input_scale: torch.Tensor | None, block: Sequence[int], tile: Sequence[int],
                     swiglu: bool = False) -> torch.Tensor:
    """The device paths (module docstring), chosen on the real shapes at run time: x [T, K] -> [T, N].
    `swiglu`: x is [T, 2K] and the projection reads silu(gate) * up; one row on CUDA forms it inside
    the GEMV (one launch), every other case runs `silu_mul` first."""
    blk = _check_block(block) if len(block) else None
    if swiglu and not (x.is_cuda and HAS_TRITON and blk is None and x.shape[0] == 1):
        x, swiglu = silu_mul(x), False
    if not (x.is_cuda and HAS_TRITON):  # a CPU step compiled with the op: the exact reference
        return fp8_linear_reference(x, w_q, w_scale, bias, block=blk, input_scale=input_scale)
    if blk is not None and (blk[1] < 16 or blk[1] & (blk[1] - 1)):  # Triton tiles are powers of two
        return fp8_linear_reference(x, w_q, w_scale, bias, block=blk, input_scale=input_scale)
    if x.stride(1) != 1:
        x = x.contiguous()
    if x.shape[0] == 1:
        return fp8_gemv_triton(x, w_q, w_scale, bias, tuple(tile), block=blk,  # type: ignore[arg-type]
                               input_scale=input_scale, swiglu=swiglu)
    if blk is None and _scaled_mm_fits(x, w_q, bias):
        return _scaled_mm_linear(x, w_q, w_scale, bias, input_scale)
    return fp8_gemm_triton(x, w_q, w_scale, bias, block=blk, input_scale=input_scale)


fp8_linear_op = torch.library.custom_op("graphrunner::fp8_linear", _fp8_linear_rows, mutates_args=())


@fp8_linear_op.register_fake
def _fp8_linear_fake(x, w_q, w_scale, bias, input_scale, block, tile, swiglu=False) -> torch.Tensor:
    return x.new_empty(x.shape[0], w_q.shape[0])


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
               block: tuple[int, int] | None = None, input_scale: torch.Tensor | None = None,
               tile: Tile | None = None, swiglu: bool = False) -> torch.Tensor:
    """x [..., K] . fp8 w_q [N, K]^T (+ bias [N]) -> [..., N] in x's dtype.

    `fp8_linear_reference`'s result up to fp32 summation order and the final rounding. CPU (or no
    Triton): the reference. CUDA: the GEMV for one row, _scaled_mm or the Triton GEMM for several
    (module docstring); under torch.compile through the opaque op `graphrunner::fp8_linear`, so one
    compiled graph serves every row count. `tile`: the GEMV's (`fp8_gemv_plan`), best chosen once
    where the layer is built; None plans it here (host-side). `swiglu`: x is [..., 2K], [gate | up],
    and the projection reads silu(gate) * up (`silu_mul`; folded into the one-row GEMV on CUDA)."""
    compiling = torch.compiler.is_compiling()
    if not (x.is_cuda and HAS_TRITON) and not compiling:
        x = silu_mul(x) if swiglu else x
        return fp8_linear_reference(x, w_q, w_scale, bias, block=block, input_scale=input_scale)
    n, k = w_q.shape
    # Under torch.compile every device goes through the op: the reference's shape tests on an unbacked
    # token count cannot be traced.
    tile = tile or fp8_gemv_plan(n, k)
    x2 = x.reshape(-1, 2 * k if swiglu else k)
    blk = tuple(block) if block is not None else ()
    if compiling:
        y = fp8_linear_op(x2, w_q, w_scale, bias, input_scale, blk, tile, swiglu)
    else:
        y = _fp8_linear_rows(x2, w_q, w_scale, bias, input_scale, blk, tile, swiglu)
    return y.reshape(*x.shape[:-1], n)
