"""A sampled step's per-row settings, gathered from the persistent state rows in one kernel.

The random-row sampler needs, per batch entry, its row's temperature, top-k, top-p, min-p and
its noise key (rng.row_keys of its seed and position). As torch ops that is an int64 copy of
`idx_mapping`, four gathers and the keys kernel: six graph nodes of ~1.5 us each at any batch
size. `gather_row_params` does it in one Triton launch on CUDA (the same values: gathers are
copies, and the keys are rng_keys.row_key's integer arithmetic, bit-equal to rng.row_keys);
elsewhere the torch ops.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from graphrunner.kernels import HAS_TRITON, use_triton
from graphrunner.sample.rng_keys import row_keys
from graphrunner.state.sampling import SamplingStates

__all__ = ["RowParams", "gather_row_params"]


class RowParams(NamedTuple):
    temperature: torch.Tensor  # [R] float32, 0 = greedy
    keys: torch.Tensor  # [R] int64 in [0, 2**32): rng.row_keys(seed, position)
    top_k: torch.Tensor  # [R] int32, 0 = off
    top_p: torch.Tensor  # [R] float32, 1 = off
    min_p: torch.Tensor  # [R] float32, 0 = off


if HAS_TRITON:
    import triton
    import triton.language as tl

    from graphrunner.sample.rng_keys import row_key

    @triton.jit
    def _gather_kernel(idx_ptr, pos_ptr, temp_src, top_k_src, top_p_src, min_p_src, seed_src, temp_ptr, keys_ptr,
                       top_k_ptr, top_p_ptr, min_p_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        row = tl.load(idx_ptr + i, mask=live, other=0).to(tl.int64)
        tl.store(temp_ptr + i, tl.load(temp_src + row, mask=live), mask=live)
        tl.store(top_k_ptr + i, tl.load(top_k_src + row, mask=live), mask=live)
        tl.store(top_p_ptr + i, tl.load(top_p_src + row, mask=live), mask=live)
        tl.store(min_p_ptr + i, tl.load(min_p_src + row, mask=live), mask=live)
        seed = tl.load(seed_src + row, mask=live, other=0).to(tl.int64)
        pos = tl.load(pos_ptr + i, mask=live, other=0).to(tl.int64)
        tl.store(keys_ptr + i, row_key(seed, pos), mask=live)


def gather_row_params(
    states: SamplingStates,
    idx_mapping: torch.Tensor,  # [R] int32 | int64: batch entry -> state row
    positions: torch.Tensor,  # [R] integer: the position of the token each entry samples
    *,
    kernel: bool | None = None,  # the Triton kernel (None: on CUDA; True on CPU: TRITON_INTERPRET tests)
) -> RowParams:
    """Each entry's sampling settings and noise key, from its state row (one launch on CUDA)."""
    n = idx_mapping.shape[0]
    if not (use_triton(idx_mapping) if kernel is None else kernel) or n == 0:
        rows = idx_mapping.long()  # [R]
        return RowParams(states.temperature[rows], row_keys(states.seed, positions, rows), states.top_k[rows],
                         states.top_p[rows], states.min_p[rows])
    dev = idx_mapping.device

    def empty(dtype: torch.dtype) -> torch.Tensor:  # [R]
        return torch.empty(n, dtype=dtype, device=dev)

    out = RowParams(empty(torch.float32), empty(torch.int64), empty(torch.int32), empty(torch.float32),
                    empty(torch.float32))
    block = 128
    _gather_kernel[(triton.cdiv(n, block),)](
        idx_mapping, positions.contiguous(), states.temperature, states.top_k, states.top_p, states.min_p,
        states.seed, *out, n, BLOCK=block)
    return out
