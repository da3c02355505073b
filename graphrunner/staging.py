"""Staged writes into persistent per-row device tensors.

Admitting a request changes a handful of scalars per row in several tensors. Writing
each one with its own tiny H2D copy would cost a launch per value; staging them on the
host and scattering once per tensor at `apply()` keeps admission O(tensors), not
O(requests x tensors), and leaves the device tensors' addresses untouched (graphs that
captured them stay valid).

Uploads never block the host and never race the copy (async scheduling runs the host a
step ahead of the device): on CUDA every upload goes through `to_device_async`, which
stages the data in a pinned block of PyTorch's caching host allocator. That allocator
records an event on the copying stream and does not hand the block out again until the
copy has completed, so a later `apply()` can never overwrite bytes an in-flight copy
still reads. (A pageable source would make `cudaMemcpyAsync` synchronize the stream.)
"""

from __future__ import annotations

import numpy as np
import torch


def to_device_async(array: np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`array` on `device` (as `dtype`), copied without blocking the host on CUDA.

    The source is a fresh pinned block from the caching host allocator (see the module
    docstring), so the caller may reuse or drop `array` at once. On a CPU the result is
    an ordinary tensor (it may share memory with `array`; copy before mutating it).
    """
    device = torch.device(device)
    src = torch.from_numpy(np.ascontiguousarray(array))
    if dtype is not None and src.dtype != dtype:
        src = src.to(dtype)
    if device.type != "cuda":
        return src.to(device)
    pinned = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    pinned.copy_(src)
    return pinned.to(device, non_blocking=True)


class StagedRowWrites:
    """Collects `row -> value` writes for several `[rows]` tensors; `apply()` scatters them."""

    def __init__(self, tensors: dict[str, torch.Tensor], device: torch.device):
        for name, t in tensors.items():
            if t.dim() != 1:
                raise ValueError(f"staged tensor {name!r} must be 1-D [rows], got shape {tuple(t.shape)}")
        self._tensors = tensors
        self._device = device
        self._rows: list[int] = []
        self._values: dict[str, list] = {name: [] for name in tensors}

    def stage(self, row: int, **values) -> None:
        missing = set(self._tensors) - set(values)
        unknown = set(values) - set(self._tensors)
        if missing or unknown:
            raise ValueError(f"stage() needs exactly {sorted(self._tensors)}; missing {sorted(missing)}, unknown {sorted(unknown)}")
        self._rows.append(row)
        for name, value in values.items():
            self._values[name].append(value)

    def __len__(self) -> int:
        return len(self._rows)

    def apply(self) -> None:
        if not self._rows:
            return
        # Later writes to the same row win: keep the last occurrence of each row.
        rows = np.asarray(self._rows, dtype=np.int64)
        _, last_from_end = np.unique(rows[::-1], return_index=True)
        keep = np.sort(len(rows) - 1 - last_from_end)
        index = to_device_async(rows[keep], self._device)
        for name, tensor in self._tensors.items():
            values = np.asarray(self._values[name])[keep]
            tensor.index_copy_(0, index, to_device_async(values, self._device, tensor.dtype))
        self._rows.clear()
        for v in self._values.values():
            v.clear()
