"""One staging scheme for every persistent per-row device tensor.

Admitting a request changes a few values in many persistent tensors (counters, token
history, sampling settings, block-table rows). Writing each with its own tiny H2D copy
would cost a launch per value and, worse, might replace a tensor a captured graph
reads. Instead every state holder stages `(tensor, flat index, value)` writes on the
host into one shared `StagedWrites`, and the runner commits them once per step, before
the step runs: one index upload and one value upload per touched tensor, scattered in
place with `index_copy_` (addresses never change, so graphs stay valid).

Later writes to the same element win. `commit()` clears what it took even when it
fails, so a failed step can never leave writes behind that a later step applies.

Uploads never block the host and never race the copy (async scheduling runs the host a
step ahead of the device): on CUDA every upload goes through `to_device_async`, which
stages the data in a pinned block of PyTorch's caching host allocator. That allocator
records an event on the copying stream and does not hand the block out again until the
copy has completed, so a later commit can never overwrite bytes an in-flight copy still
reads. (A pageable source would make `cudaMemcpyAsync` synchronize the stream.)
"""

from __future__ import annotations

import numpy as np
import torch


def to_device_async(array: np.ndarray, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
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


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An uninitialized host tensor to fill (through `.numpy()`) and copy to `device` with
    `non_blocking=True`: on CUDA a pinned block of the caching host allocator, which is not
    handed out again before the copy that reads it has completed (the module docstring), so
    filling it in place costs no extra host copy; elsewhere ordinary memory."""
    return torch.empty(shape, dtype=dtype, pin_memory=torch.device(device).type == "cuda")


_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {}


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype of a torch dtype, looked up once."""
    found = _NUMPY_DTYPES.get(dtype)
    if found is None:
        found = _NUMPY_DTYPES[dtype] = torch.empty(0, dtype=dtype).numpy().dtype
    return found


class _TensorWrites:
    """The staged writes of one tensor: scalar writes as Python lists (cheap to append
    per admission), array writes as numpy chunks."""

    __slots__ = ("tensor", "index", "values", "index_chunks", "value_chunks")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.index: list[int] = []
        self.values: list[int | float | bool] = []
        self.index_chunks: list[np.ndarray] = []
        self.value_chunks: list[np.ndarray] = []

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(flat index [n] int64, values [n]) in staging order, the last write per index kept."""
        np_dtype = _numpy_dtype(self.tensor.dtype)
        index = [np.asarray(self.index, dtype=np.int64), *self.index_chunks]
        values = [np.asarray(self.values, dtype=np_dtype), *(c.astype(np_dtype, copy=False) for c in self.value_chunks)]
        flat, vals = np.concatenate(index), np.concatenate(values)
        # index_copy_ with repeated indices is nondeterministic on CUDA: keep the last write.
        _, last_from_end = np.unique(flat[::-1], return_index=True)
        if len(last_from_end) != len(flat):
            keep = np.sort(len(flat) - 1 - last_from_end)
            flat, vals = flat[keep], vals[keep]
        return flat, vals


class StagedWrites:
    """Host-staged element writes into persistent device tensors, committed together.

    `stage(t, i, v)` writes scalar `v` at flat element `i` of `t` (for a 1-D `[rows]`
    tensor: row `i`); `stage_array(t, idx, vals)` writes many. Nothing reaches the
    device before `commit()`.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._pending: dict[int, _TensorWrites] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def _writes(self, tensor: torch.Tensor) -> _TensorWrites:
        writes = self._pending.get(id(tensor))
        if writes is None:
            if not tensor.is_contiguous():
                raise ValueError(f"staged tensor of shape {tuple(tensor.shape)} must be contiguous (flat indices)")
            writes = self._pending[id(tensor)] = _TensorWrites(tensor)
        return writes

    def stage(self, tensor: torch.Tensor, index: int, value: int | float | bool) -> None:
        writes = self._writes(tensor)
        writes.index.append(index)
        writes.values.append(value)

    def stage_array(self, tensor: torch.Tensor, index: np.ndarray, values: np.ndarray) -> None:
        """Stage `tensor.view(-1)[index] = values` (index: [n] flat element indices)."""
        index = np.asarray(index, dtype=np.int64).reshape(-1)
        values = np.asarray(values).reshape(-1)
        if index.shape != values.shape:
            raise ValueError(f"staged index has {index.size} entries, values {values.size}")
        if index.size:
            writes = self._writes(tensor)
            writes.index_chunks.append(index)
            writes.value_chunks.append(values)

    def stage_row(self, tensor: torch.Tensor, row: int, values: np.ndarray, start: int = 0) -> None:
        """Stage `tensor[row, start:start + len(values)] = values` for a `[rows, W]` tensor."""
        width = tensor.shape[1]
        base = row * width + start
        self.stage_array(tensor, np.arange(base, base + len(values), dtype=np.int64), values)

    def commit(self) -> None:
        """Scatter every staged write into its tensor (one upload pair per tensor)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        for writes in pending.values():
            flat, values = writes.arrays()
            tensor = writes.tensor
            index = to_device_async(flat, self.device)
            tensor.view(-1).index_copy_(0, index, to_device_async(values, self.device, tensor.dtype))

    def discard(self) -> None:
        """Drop every staged write (a step that failed before its commit)."""
        self._pending = {}
