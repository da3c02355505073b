"""The MLP's activation and down projection: down(silu(gate) * up) of gate_up = [gate | up].

`swiglu_linear` is one opaque op under torch.compile (`graphrunner::swiglu_linear`) that chooses
on the real row count at run time (the compiled step's token count is an unbacked size, so a
Python branch on it cannot be traced):

- one row on CUDA (batch-1 decode): the GEMV of layers/decode_linear.py forms each x tile from
  the gate and up halves as it loads them: no SiLU·mul kernel between the two projections;
- more rows: one Triton SiLU·mul kernel, then `decode_linear.linear` (cuBLAS).

Both compute silu(gate) * up in fp32 and round it once to the input dtype, as a fused SiLU·mul
stores it; off CUDA (or without Triton) it is `F.silu(gate) * up` then `linear`.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from graphrunner.kernels import HAS_TRITON
from graphrunner.layers.decode_linear import DECODE_GEMV, gemv_fits, gemv_triton, linear

__all__ = ["silu_mul_triton", "swiglu", "swiglu_linear"]

_BLOCK = 1024  # elements of one row per program
# The one-row fused path only for down projections of at most this K (intermediate size; read once
# at import): every GEMV program recomputes silu(gate) * up over the whole K, which grows with K.
# H100, batch 1, FULL: llama-3.2-1b (K 8192) 1.253 fused vs 1.191 ms unfused, llama-3.1-8b
# (K 14336) 6.66 vs 6.21 with the norm fused; qwen2.5-0.5b (K 4864) unchanged within the spread
# (0.865 / 0.837 ms).
SWIGLU_GEMV_MAX_K = int(os.environ.get("GRAPHRUNNER_SWIGLU_GEMV_MAX_K", "6144"))

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _silu_mul_kernel(gu_ptr, gu_stride, out_ptr, out_stride, half, BLOCK: tl.constexpr):
        # Program (row, block): out[row, block] = silu(gate) * up, in fp32, rounded once.
        row, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        on = cols < half  # half = I, the width of gate (and of up)
        g = tl.load(gu_ptr + row * gu_stride + cols, mask=on, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * gu_stride + half + cols, mask=on, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=on)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """silu(gate) * up of the [gate | up] halves (torch)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """silu(gate) * up in one kernel: fp32 math, one rounding to gate_up's dtype."""
    rows, two_i = gate_up.shape
    if two_i % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} (strides {gate_up.stride()}) must be [T, 2I], unit stride")
    i = two_i // 2
    out = torch.empty(rows, i, dtype=gate_up.dtype, device=gate_up.device)  # [T, I]
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(i, _BLOCK))](gate_up, gate_up.stride(0), out, out.stride(0), i,
                                                          BLOCK=_BLOCK, num_warps=4)
    return out


def _swiglu_linear_cuda(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The run-time choice of the module docstring (CUDA, Triton)."""
    if weight.shape[1] <= SWIGLU_GEMV_MAX_K and gemv_fits(gate_up, weight, bias):
        return gemv_triton(gate_up, weight, bias, swiglu=True)
    return linear(silu_mul_triton(gate_up), weight, bias)


@torch.library.custom_op("graphrunner::swiglu_linear", mutates_args=())
def _swiglu_linear_op(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """swiglu_linear as one opaque op (module docstring)."""
    return _swiglu_linear_cuda(gate_up, weight, bias)


@_swiglu_linear_op.register_fake
def _swiglu_linear_fake(gate_up, weight, bias=None) -> torch.Tensor:
    return gate_up.new_empty(gate_up.shape[0], weight.shape[0])


def swiglu_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2K] -> [T, N] = linear(silu(gate) * up, weight, bias) (module docstring)."""
    if not (DECODE_GEMV and HAS_TRITON and gate_up.is_cuda and gate_up.dim() == 2 and gate_up.stride(-1) == 1):
        return linear(swiglu(gate_up), weight, bias)
    if torch.compiler.is_compiling():
        return _swiglu_linear_op(gate_up, weight, bias)
    return _swiglu_linear_cuda(gate_up, weight, bias)
