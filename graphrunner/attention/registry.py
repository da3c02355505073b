"""Pick an attention backend by device and, optionally, by name."""

from __future__ import annotations

from collections.abc import Callable

import torch

from graphrunner.attention.base import AttentionBackend
from graphrunner.attention.torch_ref import TorchReferenceBackend
from graphrunner.kernels import HAS_TRITON


def _make_triton() -> AttentionBackend:
    from graphrunner.attention.triton_attn import TritonPagedAttentionBackend

    return TritonPagedAttentionBackend()


# name -> factory. Triton is graph-safe on CUDA; the torch reference syncs with the host
# and is meant for CPU (on CUDA it only serves eager runs and comparisons).
_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "triton": _make_triton,
    "torch": TorchReferenceBackend,
}


def get_attention_backend(device: torch.device | str, name: str | None = None) -> AttentionBackend:
    """Return a new backend instance.

    `name=None` picks "triton" on CUDA (or "torch" when triton does not import) and
    "torch" elsewhere. An explicit "triton" without triton raises RuntimeError.
    """
    if name is None:
        name = "triton" if torch.device(device).type == "cuda" and HAS_TRITON else "torch"
    try:
        factory = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; allowed: {sorted(_BACKENDS)}") from None
    return factory()


__all__ = ["get_attention_backend"]
