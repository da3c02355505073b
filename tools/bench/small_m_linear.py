"""One-launch `y = act(x) @ W^T (+ bias)` for decode batch sizes (M <= 16 rows), in Triton.

A measured alternative, not used by the model: `gemv_bench` (docs/bench/README.md) found
cuBLAS faster on every decode projection but the smallest (qwen2.5-0.5b q|k|v and o, by
about 0.5 µs of 4), and the SwiGLU-prologue down projection slower than cuBLAS's three
kernels. It stays here, with its tests, as the candidate the benchmark compares. The model's
single-row projections use graphrunner/layers/decode_linear.py instead (one or two output rows
per program and many programs, which this design's wide column tiles lack: 1.08-1.6x cuBLAS).

Why (issue #17, item 5): at M = 1..16 cuBLAS picks split-K GEMMs followed by a separate
`splitKreduce` kernel, and SwiGLU's `silu(gate) * up` is one more elementwise kernel
before the down projection. Each projection of a decode step is a pure weight read (the
activations are a few KiB), so a second and third launch only add latency and traffic.

Design: program j owns the output columns [j * BLOCK_N, (j + 1) * BLOCK_N) of *all* M rows
and walks the full K in BLOCK_K steps, so every weight tile is read from memory exactly
once (x is re-read by every program, from L2). No split-K: no atomics, no zeroed buffer
(no memset node), no reduce kernel; y is written once with plain stores. Graph-safe: the
grid and the constexprs come from Python ints, and the only allocation is the output.

Inner product per K step (constexpr USE_DOT):
- FMA: [M_PAD, 1, BLOCK_K] x [1, BLOCK_N, BLOCK_K] products summed over K in fp32
  registers. No padding to 16 rows, so it suits M <= 4; it costs M x N x K CUDA-core FMAs.
- DOT: tl.dot of the x tile [16, BLOCK_K] (M padded to 16 rows, the smallest MMA) and the
  transposed W tile [BLOCK_K, BLOCK_N], fp32 accumulate; fp32 inputs use "ieee" precision
  (no TF32), so fp32 results match F.linear to summation order.

SwiGLU prologue (silu_mul=True): x is [M, 2K], the output of a fused gate|up projection,
and the row fed to the product is `F.silu(gate) * up` computed as torch does in x's dtype:
silu in fp32, rounded to x.dtype, times up in fp32, rounded again. On CUDA the silu uses
libdevice's expf and a correctly rounded division (torch's CUDA silu is not fast-math), so
the prologue reproduces the two-kernel path's input, not just approximates it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from graphrunner.kernels import HAS_TRITON, sm_count

__all__ = ["MAX_SMALL_M", "SmallMPlan", "small_m_linear", "small_m_linear_plan", "small_m_linear_ref"]

MAX_SMALL_M = 16  # rows one launch serves: the DOT path pads M to one 16-row MMA tile
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FMA_MAX_M = 4  # rows up to which the FMA product is planned (above: DOT); the --sweep of gemv_bench tunes it
_FMA_PRODUCTS_PER_THREAD = 64  # register budget of the FMA tile [M_PAD, BLOCK_N, BLOCK_K] per thread
_DOT_TILE = 8192  # W elements per DOT step: 16 KiB of bf16 in flight per program
_MIN_WAVE = 0.9  # the widest BLOCK_N that still gives this fraction of one program per SM
_BLOCK_K_RANGE = (128, 512)
_NUM_WARPS = (1, 2, 4, 8, 16)

if HAS_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def _act_tile(x_ptr, rows, ks, M, K, stride_xm, stride_xk, SILU_MUL: tl.constexpr, EXACT_SILU: tl.constexpr):
        # -> [M_PAD, BLOCK_K] act(x) in x's dtype; 0 outside [M, K) (so padded rows and K add nothing).
        mask = (rows[:, None] < M) & (ks[None, :] < K)
        ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk
        a = tl.load(ptrs, mask=mask, other=0.0)
        if SILU_MUL:
            up = tl.load(ptrs + K * stride_xk, mask=mask, other=0.0)
            g = a.to(tl.float32)
            if EXACT_SILU:  # torch's CUDA silu: expf and an IEEE division
                s = tl.math.div_rn(g, 1.0 + libdevice.exp(-g))
            else:  # the interpreter has no libdevice
                s = g / (1.0 + tl.exp(-g))
            a = (s.to(a.dtype).to(tl.float32) * up.to(tl.float32)).to(a.dtype)
        return a

    @triton.jit
    def _small_m_linear_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_ym,
        HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, EXACT_SILU: tl.constexpr, USE_DOT: tl.constexpr,
        IEEE: tl.constexpr, EVEN_K: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # Program j: y[:, j*BLOCK_N : (j+1)*BLOCK_N] for all M rows, over the full K.
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        col_ok = cols < N
        rows = tl.arange(0, M_PAD)  # [M_PAD]
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
        acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            a = _act_tile(x_ptr, rows, ks, M, K, stride_xm, stride_xk, SILU_MUL, EXACT_SILU)  # [M_PAD, BLOCK_K]
            if EVEN_K:
                w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None], other=0.0)  # [BLOCK_N, BLOCK_K]
            else:
                w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks[None, :] < K), other=0.0)
            if USE_DOT:
                if IEEE:
                    acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, tl.trans(w), acc)
            else:
                prod = a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [M_PAD, BLOCK_N, BLOCK_K]
                acc += tl.sum(prod, axis=2)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & col_ok[None, :])


@dataclass(frozen=True)
class SmallMPlan:
    """Launch parameters of one (M, N, K) shape; `programs` = cdiv(N, block_n)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    use_dot: bool
    programs: int


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def small_m_linear_plan(M: int, N: int, K: int, device: torch.device | str) -> SmallMPlan:
    """Tile sizes for `small_m_linear` from Python ints only (no device work: graph-safe).

    BLOCK_N: the widest of 8/16/32/64 (16+ for DOT) that still gives ~one program per SM
    (wider tiles read longer contiguous W rows per step, but fewer programs leave SMs idle
    and without split-K nothing else fills them). BLOCK_K: enough W per step to keep memory
    busy (DOT: ~16 KiB of bf16; FMA: what the register budget of [M_PAD, BLOCK_N, BLOCK_K]
    allows), clamped to 128..512 and to K's next power of two.
    """
    if not 1 <= M <= MAX_SMALL_M:
        raise ValueError(f"M={M} rows is outside the small-M range 1..MAX_SMALL_M={MAX_SMALL_M}")
    if N < 1 or K < 1:
        raise ValueError(f"N={N} and K={K} must both be >= 1")
    use_dot = M > _FMA_MAX_M
    m_pad = 16 if use_dot else _pow2_ceil(M)
    sms = sm_count(device, cpu=4)
    choices = (16, 32, 64) if use_dot else (8, 16, 32, 64)
    block_n = choices[0]
    for bn in choices:
        if -(-N // bn) >= _MIN_WAVE * sms:
            block_n = bn
    num_warps = 8 if K >= 2048 else 4
    if use_dot:
        block_k = _DOT_TILE // block_n
    else:
        block_k = _pow2_floor(_FMA_PRODUCTS_PER_THREAD * 32 * num_warps // (m_pad * block_n))
    block_k = min(max(block_k, _BLOCK_K_RANGE[0]), _BLOCK_K_RANGE[1], max(16, _pow2_ceil(K)))
    return SmallMPlan(block_n, block_k, num_warps, 3, use_dot, -(-N // block_n))


def _check_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> tuple[int, int]:
    """Host-side checks (metadata only, safe during capture); returns (N, K)."""
    if weight.dim() != 2:
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected [N, K]")
    n, k = weight.shape
    if weight.dtype not in _DTYPES:
        raise ValueError(f"weight has dtype {weight.dtype}, expected one of: {', '.join(map(str, _DTYPES))}")
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous (row-major [N, K]), got strides {weight.stride()}")
    width = 2 * k if silu_mul else k
    if x.dim() != 2 or x.shape[1] != width:
        what = f"[M, 2*K={width}] (gate | up)" if silu_mul else f"[M, K={k}]"
        raise ValueError(f"x has shape {tuple(x.shape)}, expected {what}")
    if x.shape[0] > MAX_SMALL_M:
        raise ValueError(f"x has M={x.shape[0]} rows, more than MAX_SMALL_M={MAX_SMALL_M}; use F.linear")
    if x.dtype != weight.dtype:
        raise ValueError(f"x has dtype {x.dtype}, expected the weight's dtype {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device}, the weight on {weight.device}")
    if bias is not None:
        if tuple(bias.shape) != (n,) or bias.dtype != weight.dtype or bias.stride() != (1,):
            raise ValueError(
                f"bias has shape {tuple(bias.shape)}, dtype {bias.dtype}, strides {bias.stride()}; "
                f"expected a contiguous [{n}] tensor of {weight.dtype}"
            )
        if bias.device != weight.device:
            raise ValueError(f"bias is on {bias.device}, the weight on {weight.device}")
    return n, k


def _check_overrides(block_n: int, block_k: int, num_warps: int, use_dot: bool) -> None:
    """Explicit tile sizes must be powers of two the kernel can use (tl.dot needs 16+)."""
    min_n = 16 if use_dot else 1
    if block_n < min_n or block_n > 256 or block_n & (block_n - 1):
        raise ValueError(f"block_n={block_n} must be a power of two in {min_n}..256 (use_dot={use_dot})")
    if block_k < 16 or block_k > 4096 or block_k & (block_k - 1):
        raise ValueError(f"block_k={block_k} must be a power of two in 16..4096")
    if num_warps not in _NUM_WARPS:
        raise ValueError(f"num_warps={num_warps} must be one of {_NUM_WARPS}")


def small_m_linear(
    x: torch.Tensor,  # [M, K], or [M, 2K] = gate | up with silu_mul; M <= MAX_SMALL_M, any strides
    weight: torch.Tensor,  # [N, K] contiguous (the nn.Linear weight), x's dtype
    bias: torch.Tensor | None = None,  # [N] or None
    *,
    silu_mul: bool = False,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    use_dot: bool | None = None,
) -> torch.Tensor:  # [M, N] in x's dtype
    """`F.linear(act(x), weight, bias)` in one kernel launch; act = SwiGLU's silu(gate) * up with silu_mul.

    Tile sizes left None come from `small_m_linear_plan` (explicit ones are for tests and
    the tuning sweep of tools/bench/gemv_bench.py). Raises ValueError for shapes, dtypes
    and layouts it does not serve, so the caller can keep F.linear for those.
    """
    if not HAS_TRITON:
        raise RuntimeError("small_m_linear needs triton, which failed to import; use small_m_linear_ref")
    n, k = _check_args(x, weight, bias, silu_mul)
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0:
        return y
    plan = small_m_linear_plan(m, n, k, x.device)
    use_dot = plan.use_dot if use_dot is None else use_dot
    if block_n is None:
        block_n = plan.block_n if use_dot == plan.use_dot else max(plan.block_n, 16)
    block_k = plan.block_k if block_k is None else block_k
    num_warps = plan.num_warps if num_warps is None else num_warps
    num_stages = plan.num_stages if num_stages is None else num_stages
    _check_overrides(block_n, block_k, num_warps, use_dot)
    _small_m_linear_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), x.stride(1), weight.stride(0),
        y.stride(0), HAS_BIAS=bias is not None, SILU_MUL=silu_mul, EXACT_SILU=x.is_cuda, USE_DOT=use_dot,
        IEEE=x.dtype == torch.float32, EVEN_K=k % block_k == 0, M_PAD=16 if use_dot else _pow2_ceil(m),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return y


def small_m_linear_ref(
    x: torch.Tensor,  # [M, K], or [M, 2K] = gate | up with silu_mul
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N] or None
    *,
    silu_mul: bool = False,
) -> torch.Tensor:  # [M, N]
    """Torch reference: the kernels of today, `F.linear(F.silu(gate) * up, weight, bias)`."""
    if silu_mul:
        k = weight.shape[1]
        x = F.silu(x[:, :k]) * x[:, k:]  # [M, K]
    return F.linear(x, weight, bias)
