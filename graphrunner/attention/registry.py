"""Pick an attention backend by device and, optionally, by name."""

from __future__ import annotations

from collections.abc import Callable

import torch

from graphrunner.attention.base import AttentionBackend
from graphrunner.attention.torch_ref import TorchReferenceBackend
from graphrunner.config import KernelConfig
from graphrunner.kernels import HAS_TRITON


def _make_triton(kernel: KernelConfig, device: torch.device) -> AttentionBackend:
    from graphrunner.attention.triton_attn import TritonPagedAttentionBackend

    return TritonPagedAttentionBackend(kernel, device)


def _make_torch(kernel: KernelConfig, device: torch.device) -> AttentionBackend:
    return TorchReferenceBackend()


# name -> factory. Triton is graph-safe on CUDA; the torch reference syncs with the host
# and is meant for CPU (on CUDA it only serves eager runs and comparisons).
_BACKENDS: dict[str, Callable[[KernelConfig, torch.device], AttentionBackend]] = {
    "triton": _make_triton,
    "torch": _make_torch,
}


def get_attention_backend(device: torch.device | str, name: str | None = None,
                          kernel: KernelConfig | None = None) -> AttentionBackend:
    """Return a new backend instance for `device`, planned under `kernel` (default: `KernelConfig()`).

    `name=None` picks "triton" on CUDA (or "torch" when triton does not import) and
    "torch" elsewhere. An explicit "triton" without triton raises RuntimeError.
    """
    device = torch.device(device)
    if name is None:
        name = "triton" if device.type == "cuda" and HAS_TRITON else "torch"
    try:
        factory = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; allowed: {sorted(_BACKENDS)}") from None
    return factory(kernel or KernelConfig(), device)


__all__ = ["get_attention_backend"]
