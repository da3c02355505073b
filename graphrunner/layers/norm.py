"""RMSNorm, with a fused residual-add variant.

The statistics are computed in fp32 and the normalized activations cast back before
the weight multiply, exactly as Hugging Face Llama/Qwen do, so bf16 outputs match.

On CUDA the pre-norm block boundary (`add_norm`: residual add, then RMSNorm) is one
Triton kernel behind the opaque custom op `graphrunner::fused_add_rms_norm`. Left to
inductor, that boundary compiled to three graph nodes per norm: a copy of the residual
into the preceding GEMM's output (inductor turns `mm + residual` into an addmm that
accumulates in place), a reduction kernel and a pointwise kernel. The op keeps the GEMM
plain and does the add, the statistics and the scaling in one program per token. Whether
a norm takes it is decided once, when the norm is built on its device.
"""

from __future__ import annotations

import torch
from torch import nn

from graphrunner.config import KernelConfig
from graphrunner.kernels import HAS_TRITON
from graphrunner.kernels.device import device_properties
from graphrunner.kernels.pdl import pdl_launch, pdl_max_rows

FUSED_ADD_RMS_NORM = "graphrunner::fused_add_rms_norm"


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)) over the last dimension.

    Built on the device it runs on: a CUDA norm with Triton does `add_norm` in the fused kernel
    (launched with PDL up to `kernel.pdl_max_rows` rows), any other the torch reference."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, dtype: torch.dtype, device=None,
                 kernel: KernelConfig | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.fused = HAS_TRITON and self.weight.device.type == "cuda"
        device_props = device_properties(self.weight.device)
        self.pdl_rows = pdl_max_rows(kernel or KernelConfig(), device_props) if self.fused else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., hidden] -> same shape and dtype
        return rms_norm(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the pre-norm block boundary in one call.

        The sum stays in the activation dtype (as HF), and it is the next residual.
        """
        if self.fused:
            return torch.ops.graphrunner.fused_add_rms_norm(x, residual, self.weight, self.eps, self.pdl_rows)
        return add_rms_norm_torch(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Functional RMSNorm over the last dim; fp32 statistics, output in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new residual), both like x
    """Torch reference of the fused op: the sum in x's dtype, then `rms_norm` of it."""
    residual = x + residual  # [..., hidden]
    return rms_norm(residual, weight, eps), residual


if HAS_TRITON:
    import triton
    import triton.language as tl

    from graphrunner.kernels.pdl import pdl_wait

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, hidden, eps, stride_x, stride_r,
                             BLOCK: tl.constexpr, GDC: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        pdl_wait(GDC)  # launched with PDL: wait for the kernels before (graphrunner.kernels.pdl)
        i = tl.arange(0, BLOCK)
        ok = i < hidden
        ty = out_ptr.dtype.element_ty
        s = (tl.load(x_ptr + row * stride_x + i, mask=ok, other=0.0).to(tl.float32)
             + tl.load(res_ptr + row * stride_r + i, mask=ok, other=0.0).to(tl.float32)).to(ty)
        tl.store(res_out_ptr + row * hidden + i, s, mask=ok)
        sf = s.to(tl.float32)
        inv = tl.rsqrt(tl.sum(sf * sf, axis=0) / hidden + eps)
        # As HF: normalize in fp32, round to the activation dtype, then multiply by the weight.
        y = (sf * inv).to(ty).to(tl.float32) * tl.load(w_ptr + i, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * hidden + i, y.to(ty), mask=ok)


def add_rms_norm_triton(
    x: torch.Tensor,  # [T, hidden], unit stride along hidden
    residual: torch.Tensor,  # [T, hidden], unit stride along hidden
    weight: torch.Tensor,  # [hidden]
    eps: float,
    pdl_rows: int = 0,  # launches of at most this many tokens use PDL (graphrunner.kernels.pdl)
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new residual): [T, hidden] each, contiguous
    """One program per token: the residual sum, its fp32 statistics and the scaled output."""
    if not HAS_TRITON:
        raise RuntimeError("add_rms_norm_triton needs triton, which failed to import; use add_rms_norm_torch")
    if x.dim() != 2 or residual.shape != x.shape or weight.shape != (x.shape[1],):
        raise ValueError(f"x {tuple(x.shape)}, residual {tuple(residual.shape)} and weight {tuple(weight.shape)} "
                         "must be [T, hidden], [T, hidden] and [hidden]")
    if x.stride(1) != 1 or residual.stride(1) != 1:
        raise ValueError(f"x and residual need unit stride along hidden, got {x.stride()} and {residual.stride()}")
    num_tokens, hidden = x.shape
    out, res_out = _two_like(x)
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        launch = pdl_launch(num_tokens, pdl_rows)
        _add_rms_norm_kernel[(num_tokens,)](x, residual, weight, out, res_out, hidden, eps, x.stride(0),
                                            residual.stride(0), BLOCK=block, GDC=bool(launch),
                                            num_warps=min(16, max(1, block // 256)), **launch)
    return out, res_out


@torch.library.custom_op(FUSED_ADD_RMS_NORM, mutates_args=())
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, pdl_rows: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual) in one Triton kernel (`add_rms_norm_triton`)."""
    return add_rms_norm_triton(x, residual, weight, eps, pdl_rows)


@fused_add_rms_norm.register_fake
def _fused_add_rms_norm_fake(x, residual, weight, eps, pdl_rows=0) -> tuple[torch.Tensor, torch.Tensor]:
    return _two_like(x)


def _two_like(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's two outputs: contiguous, x's shape, dtype and device."""
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(x.shape, dtype=x.dtype, device=x.device))
