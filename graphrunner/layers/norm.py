"""RMSNorm, with a fused residual-add variant.

The statistics are computed in fp32 and the normalized activations cast back before
the weight multiply, exactly as Hugging Face Llama/Qwen do, so bf16 outputs match.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)) over the last dimension."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., hidden] -> same shape and dtype
        return rms_norm(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the pre-norm block boundary in one call.

        The sum stays in the activation dtype (as HF), and it is the next residual.
        """
        residual = x + residual  # [..., hidden]
        return rms_norm(residual, self.weight, self.eps), residual

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Functional RMSNorm over the last dim; fp32 statistics, output in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
