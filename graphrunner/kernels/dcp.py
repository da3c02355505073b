"""Decode context parallelism (DCP): the paged KV cache of every request sharded across D ranks.

Layout. A request's tokens are dealt to the D ranks in runs of I tokens (I is
`cp_kv_cache_interleave_size`): run k = p // I holds global positions [k*I, (k+1)*I) and
goes to rank k % D. So the token at global position p lives on

    rank       (p // I) % D
    local_pos  (p // (I * D)) * I + p % I      (its index among that rank's tokens)

Example, D = 2, I = 2:  p = 0 1 2 3 4 5 6 7 8
                         rank = 0 0 1 1 0 0 1 1 0
                    local_pos = 0 1 0 1 2 3 2 3 4

A rank's tokens of one request, in order, are the dense range `0 .. local_len - 1` of
local positions, and these are paged exactly like an unsharded cache: each rank has its
own block table (rows of *its* physical blocks), local block = `local_pos // block_size`
and slot = `block_table[b, local_pos // block_size] * block_size + local_pos % block_size`.
With D = 1 every token is local and local_pos = p: the ordinary slot mapping.

Of a request's first L tokens, rank r holds
`local_len(L, r) = (L // (I*D)) * I + clamp(L % (I*D) - r*I, 0, I)`; the lengths over the
ranks sum to L and rank 0 holds the most. KV sizing follows: a request of L tokens needs
`dcp_local_capacity(L)` slots on a rank (the ceil rule: `ceil(L / D)` when I = 1, less
than I above it otherwise), so a per-GPU KV pool serves D times as many tokens as
without DCP.

Kernels (graph-safe, like the rest of `graphrunner.kernels`: a torch reference and a
Triton kernel with identical results, every output element written, no host sync, no
value-dependent shapes, Triton never specialized on batch sizes):
- `dcp_slot_mapping`: each token's rank-local slot, -1 where another rank owns it or the
  token is padding; the KV-write kernel skips -1, so each rank writes only its own KV.
- `dcp_local_seq_lens`: each batch entry's `local_len(seq_len, rank)`, what this rank's
  attention reads (padded entries, seq_len 0, get 0).
"""

from __future__ import annotations

import torch

from graphrunner.kernels import HAS_TRITON, check_tensor, use_triton
from graphrunner.kernels.input_prep import token_entries

_I32 = (torch.int32,)
_I64 = (torch.int64,)


# --------------------------------------------------------------------------- layout


def _check_layout(interleave: int, dcp_size: int, dcp_rank: int | None = None) -> None:
    if interleave <= 0:
        raise ValueError(f"interleave={interleave} (cp_kv_cache_interleave_size) must be positive")
    if dcp_size <= 0:
        raise ValueError(f"dcp_size={dcp_size} must be positive")
    if dcp_rank is not None and not 0 <= dcp_rank < dcp_size:
        raise ValueError(f"dcp_rank={dcp_rank} is out of range [0, {dcp_size})")


def dcp_local_capacity(num_tokens: int, interleave: int, dcp_size: int) -> int:
    """Slots a rank needs for a request of `num_tokens` tokens: the most any rank holds.

    That is rank 0's share, `(L // (I*D)) * I + min(L % (I*D), I)`: `ceil(L / D)` when
    I = 1, less than I above it otherwise, and never more than `ceil(L / (I*D)) * I`.
    Per-rank block tables need `ceil(dcp_local_capacity(max_model_len, I, D) / block_size)`
    columns.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens} must be non-negative")
    _check_layout(interleave, dcp_size)
    span = interleave * dcp_size
    return (num_tokens // span) * interleave + min(num_tokens % span, interleave)


# --------------------------------------------------------------------------- torch references


def dcp_slot_mapping_torch(
    block_table: torch.Tensor,  # [R, M] int32, this rank's rows
    query_start_loc: torch.Tensor,  # [R + 1] int32
    positions: torch.Tensor,  # [T] int64
    block_size: int,
    interleave: int,
    dcp_size: int,
    dcp_rank: int,
    out: torch.Tensor,  # [T] int64
) -> None:
    """Torch reference of `dcp_slot_mapping`."""
    max_blocks = block_table.shape[1]
    entry, _, is_real = token_entries(query_start_loc, out.shape[0])
    run = torch.div(positions, interleave, rounding_mode="floor")
    owned = is_real & (torch.remainder(run, dcp_size) == dcp_rank)
    local = torch.div(run, dcp_size, rounding_mode="floor") * interleave + torch.remainder(positions, interleave)
    # Clamped so that the gather stays in bounds for tokens that are not ours (or padding).
    col = torch.div(local, block_size, rounding_mode="floor").clamp_(0, max_blocks - 1)
    slot = block_table[entry, col].long() * block_size + torch.remainder(local, block_size)
    out.copy_(torch.where(owned, slot, torch.full_like(slot, -1)))


def dcp_local_seq_lens_torch(
    seq_lens: torch.Tensor,  # [R] int32
    interleave: int,
    dcp_size: int,
    dcp_rank: int,
    out: torch.Tensor,  # [R] int32
) -> None:
    """Torch reference of `dcp_local_seq_lens`."""
    span = interleave * dcp_size
    partial = (torch.remainder(seq_lens, span) - dcp_rank * interleave).clamp_(0, interleave)
    out.copy_(torch.div(seq_lens, span, rounding_mode="floor") * interleave + partial)


# --------------------------------------------------------------------------- Triton kernels

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["num_reqs", "num_tokens"])
    def _dcp_slot_mapping_kernel(
        bt_ptr,
        bt_stride,
        qsl_ptr,
        pos_ptr,
        out_ptr,
        num_reqs,
        num_tokens,
        max_blocks,
        block_size,
        interleave,
        dcp_size,
        dcp_rank,
        BLOCK: tl.constexpr,
    ):
        # One program per batch entry, plus one (pid == num_reqs) for the padded token tail.
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        if pid < num_reqs:
            start = tl.load(qsl_ptr + pid)
            qlen = tl.load(qsl_ptr + pid + 1) - start
            row_ptr = bt_ptr + pid.to(tl.int64) * bt_stride
            for i in range(0, qlen, BLOCK):
                o = i + offs
                m = o < qlen
                pos = tl.load(pos_ptr + start + o, mask=m, other=0)  # int64, >= 0 for real tokens
                run = pos // interleave
                owned = m & (run % dcp_size == dcp_rank)
                local = (run // dcp_size) * interleave + pos % interleave
                col = tl.minimum(local // block_size, max_blocks - 1)
                block = tl.load(row_ptr + col, mask=owned, other=0).to(tl.int64)
                slot = block * block_size + local % block_size
                tl.store(out_ptr + start + o, tl.where(owned, slot, -1), mask=m)
        else:
            tail = tl.load(qsl_ptr + num_reqs)
            for i in range(tail, num_tokens, BLOCK):
                o = i + offs
                tl.store(out_ptr + o, tl.full([BLOCK], -1, dtype=tl.int64), mask=o < num_tokens)

    @triton.jit(do_not_specialize=["num_reqs"])
    def _dcp_local_seq_lens_kernel(
        seq_lens_ptr, out_ptr, num_reqs, interleave, dcp_size, dcp_rank, BLOCK: tl.constexpr
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < num_reqs
        seq_len = tl.load(seq_lens_ptr + offs, mask=m, other=0)  # int32, >= 0
        span = interleave * dcp_size
        partial = tl.minimum(tl.maximum(seq_len % span - dcp_rank * interleave, 0), interleave)
        tl.store(out_ptr + offs, (seq_len // span) * interleave + partial, mask=m)


_TOKEN_BLOCK = 1024  # tokens per loop iteration of the slot-mapping kernel
_REQ_BLOCK = 128  # entries per program of the local-seq-lens kernel


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not importable; use the torch reference implementation")


def dcp_slot_mapping_triton(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    interleave: int,
    dcp_size: int,
    dcp_rank: int,
    out: torch.Tensor,
) -> None:
    """Triton implementation of `dcp_slot_mapping` (R_pad + 1 programs)."""
    _require_triton()
    if block_table.stride(1) != 1 or not (
        query_start_loc.is_contiguous() and positions.is_contiguous() and out.is_contiguous()
    ):
        raise ValueError("dcp_slot_mapping_triton needs unit-stride block-table rows and contiguous 1-D tensors")
    num_reqs = block_table.shape[0]
    _dcp_slot_mapping_kernel[(num_reqs + 1,)](
        block_table,
        block_table.stride(0),
        query_start_loc,
        positions,
        out,
        num_reqs,
        out.shape[0],
        block_table.shape[1],
        block_size,
        interleave,
        dcp_size,
        dcp_rank,
        BLOCK=_TOKEN_BLOCK,
    )


def dcp_local_seq_lens_triton(
    seq_lens: torch.Tensor, interleave: int, dcp_size: int, dcp_rank: int, out: torch.Tensor
) -> None:
    """Triton implementation of `dcp_local_seq_lens` (vectorized over entries)."""
    _require_triton()
    if not (seq_lens.is_contiguous() and out.is_contiguous()):
        raise ValueError("dcp_local_seq_lens_triton needs contiguous seq_lens and out")
    num_reqs = out.shape[0]
    _dcp_local_seq_lens_kernel[(triton.cdiv(num_reqs, _REQ_BLOCK),)](
        seq_lens, out, num_reqs, interleave, dcp_size, dcp_rank, BLOCK=_REQ_BLOCK
    )


# --------------------------------------------------------------------------- public API


def dcp_slot_mapping(
    block_table: torch.Tensor,  # [R_pad, M] int32, this rank's gathered rows
    query_start_loc: torch.Tensor,  # [R_pad + 1] int32
    positions: torch.Tensor,  # [T_pad] int64, global positions
    block_size: int,
    interleave: int,
    dcp_size: int,
    dcp_rank: int,
    out: torch.Tensor,  # [T_pad] int64
) -> None:
    """Write this rank's KV-cache slot of every token (module docstring for the layout).

    A real token at global position p, owned by this rank, gets
    `block_table[b, local_pos // block_size] * block_size + local_pos % block_size`;
    tokens owned by another rank and padded tokens (`t >= query_start_loc[R_pad]`)
    get -1. Positions of real tokens must be non-negative.
    """
    if block_table.dim() != 2 or block_table.shape[0] < 1:
        raise ValueError(f"block_table has shape {tuple(block_table.shape)}, expected [R_pad, M] with R_pad >= 1")
    if block_size <= 0:
        raise ValueError(f"block_size={block_size} must be positive")
    _check_layout(interleave, dcp_size, dcp_rank)
    num_reqs = block_table.shape[0]
    num_tokens = out.shape[0]
    check_tensor("block_table", block_table, tuple(block_table.shape), _I32)
    check_tensor("query_start_loc", query_start_loc, (num_reqs + 1,), _I32)
    check_tensor("positions", positions, (num_tokens,), _I64)
    check_tensor("out", out, (num_tokens,), _I64)
    impl = dcp_slot_mapping_triton if use_triton(out) else dcp_slot_mapping_torch
    impl(block_table, query_start_loc, positions, block_size, interleave, dcp_size, dcp_rank, out)


def dcp_local_seq_lens(
    seq_lens: torch.Tensor,  # [R_pad] int32, global sequence lengths (0 for padded entries)
    interleave: int,
    dcp_size: int,
    dcp_rank: int,
    out: torch.Tensor,  # [R_pad] int32
) -> None:
    """Write how many of each entry's first `seq_lens[b]` tokens this rank holds.

    `out[b] = (L // (I*D)) * I + clamp(L % (I*D) - dcp_rank*I, 0, I)` with L = seq_lens[b]
    (non-negative); 0 for padded entries.
    """
    if seq_lens.dim() != 1 or seq_lens.shape[0] < 1:
        raise ValueError(f"seq_lens has shape {tuple(seq_lens.shape)}, expected [R_pad] with R_pad >= 1")
    _check_layout(interleave, dcp_size, dcp_rank)
    check_tensor("seq_lens", seq_lens, (seq_lens.shape[0],), _I32)
    check_tensor("out", out, (seq_lens.shape[0],), _I32)
    impl = dcp_local_seq_lens_triton if use_triton(out) else dcp_local_seq_lens_torch
    impl(seq_lens, interleave, dcp_size, dcp_rank, out)


__all__ = [
    "dcp_local_capacity",
    "dcp_slot_mapping",
    "dcp_local_seq_lens",
    "dcp_slot_mapping_torch",
    "dcp_local_seq_lens_torch",
    "dcp_slot_mapping_triton",
    "dcp_local_seq_lens_triton",
]
