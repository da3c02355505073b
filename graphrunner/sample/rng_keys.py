"""rng.row_keys as one Triton kernel: a sampled step's [R] keys in one graph node, not ~40.

`rng.row_keys` is five `hash32` calls of pure torch integer ops on [R] tensors: about forty
elementwise kernels, each a node of ~1.2 us in a CUDA graph (about 50 us of a sampled step at
any batch size, measured with the profiler at 256 rows on an H100). The kernel below runs the
same int64 arithmetic per row (values below 2**32, multipliers below 2**31: no product
overflows; `>>` of a negative seed is arithmetic in both), so its keys equal rng.row_keys bit
for bit, and it gathers the rows' seeds itself (one more node saved). `row_keys` picks the
kernel for CUDA tensors when Triton is available, else rng.row_keys.
"""

from __future__ import annotations

import torch

from graphrunner.kernels import HAS_TRITON, use_triton
from graphrunner.sample import rng

__all__ = ["row_keys", "row_keys_triton"]

if HAS_TRITON:
    import triton
    import triton.language as tl

    _MASK32 = tl.constexpr(rng._MASK32)
    _MIX = tl.constexpr(rng._MIX)
    _GOLDEN = tl.constexpr(rng._GOLDEN)

    @triton.jit
    def _hash32(x):  # rng.hash32 on int64 lanes
        x = x & _MASK32
        x = x ^ (x >> 16)
        x = (x * _MIX) & _MASK32
        x = x ^ (x >> 16)
        x = (x * _MIX) & _MASK32
        return x ^ (x >> 16)

    @triton.jit
    def row_key(seed, pos):  # rng.row_keys of int64 lanes
        key = _hash32((seed & _MASK32) ^ _hash32(((seed >> 32) & _MASK32) + _GOLDEN))
        return _hash32(key ^ _hash32(pos + 2 * _GOLDEN))

    @triton.jit
    def _row_keys_kernel(seed_ptr, index_ptr, pos_ptr, out_ptr, n, GATHER: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        at = tl.load(index_ptr + i, mask=live, other=0).to(tl.int64) if GATHER else i
        seed = tl.load(seed_ptr + at, mask=live, other=0).to(tl.int64)
        pos = tl.load(pos_ptr + i, mask=live, other=0).to(tl.int64)
        tl.store(out_ptr + i, row_key(seed, pos), mask=live)


def row_keys_triton(seeds: torch.Tensor, positions: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """rng.row_keys(seeds[index] (or seeds), positions) in one launch: [R] int64 in [0, 2**32).

    seeds: int64 ([R], or any length with `index` [R] int64), positions: [R] integer."""
    n = positions.shape[0]
    out = torch.empty(n, dtype=torch.int64, device=positions.device)  # [R]
    if n == 0:
        return out
    block = 128
    gather = index is not None
    _row_keys_kernel[(triton.cdiv(n, block),)](seeds, index if gather else positions, positions, out, n,
                                                GATHER=gather, BLOCK=block)
    return out


def row_keys(seeds: torch.Tensor, positions: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """The keys of rng.row_keys for `seeds[index]` (or `seeds`) at `positions`: the one-launch
    kernel on CUDA, the torch ops elsewhere. [R] int64."""
    if use_triton(positions):
        return row_keys_triton(seeds, positions.contiguous(), index)
    return rng.row_keys(seeds if index is None else seeds[index], positions.long())
