"""Graph-safe kernels of the step outside the model (input preparation, bookkeeping).

Every kernel here has two implementations with identical results: a Triton kernel,
used when the tensors live on CUDA and triton imports, and a torch reference made of
vectorized torch ops, used elsewhere (CPU CI). Both write into preallocated outputs
and never synchronize with the host, so either can run inside a captured CUDA graph.

`HAS_TRITON` is decided once at import; it is a constant, not a switch to flip.
"""

from __future__ import annotations

import functools

import torch

try:  # triton is optional: without it every kernel falls back to its torch reference
    import triton  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    HAS_TRITON = False


def use_triton(tensor: torch.Tensor) -> bool:
    """True when `tensor`'s kernels should run the Triton implementation."""
    return HAS_TRITON and tensor.is_cuda


def check_tensor(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    """Raise ValueError unless `tensor` has exactly `shape` and one of `dtypes`.

    Host-side metadata checks only (no device access), so they are safe during capture.
    """
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} has dtype {tensor.dtype}, expected one of: {allowed}")


def split_pad(num_splits: int) -> int:
    """The constexpr width (a power of two >= num_splits) of a per-row reduction over a row's
    `num_splits` partial results: 16, 256 or 4096, not the next power of two. The split count follows
    the batch size (fewer rows, more splits), and each distinct width is a Triton specialization of
    every kernel that reduces over the splits: with next-power-of-two widths, capturing an H200's 67
    decode sizes compiled the sampled sampler's 13 kernels 9 times over (119 compiles, most of a
    52 s cold capture). The wider masked reductions cost a few lanes of a [S, 16] tile per row."""
    pad = 16
    while pad < num_splits:
        pad *= 16
    return pad


@functools.cache
def _device_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device | str, *, cpu: int) -> int:
    """Streaming multiprocessors of a CUDA `device` (host-side and cached: safe during capture); `cpu`
    elsewhere, the count a kernel's launch plan assumes under the CPU interpreter (TRITON_INTERPRET=1)."""
    device = torch.device(device)
    if device.type != "cuda":
        return cpu
    return _device_sm_count(device.index if device.index is not None else torch.cuda.current_device())


__all__ = ["HAS_TRITON", "use_triton", "check_tensor", "sm_count", "split_pad"]
