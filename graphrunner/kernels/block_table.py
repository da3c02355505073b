"""Block-table kernels: the per-step gather of a batch's rows and its slot mapping.

Both are graph-safe: they write into preallocated outputs and never synchronize with
the host. Each has a torch reference (CPU, and the tests' oracle) and a Triton kernel.
"""

from __future__ import annotations

import torch

from graphrunner.kernels import HAS_TRITON, check_tensor, use_triton
from graphrunner.kernels.input_prep import token_entries

_I32 = (torch.int32,)
_I64 = (torch.int64,)


def gather_block_table(table: torch.Tensor, idx_mapping: torch.Tensor, out: torch.Tensor) -> None:
    """`out[b, :] = table[idx_mapping[b], :]` for every batch entry b (graph-safe)."""
    # table: [rows, M] int32; idx_mapping: [R_pad] int32; out: [R_pad, M] int32
    num_reqs = idx_mapping.shape[0]
    check_tensor("idx_mapping", idx_mapping, (num_reqs,), _I32)
    check_tensor("out", out, (num_reqs, table.shape[1]), _I32)
    impl = gather_block_table_triton if use_triton(out) else gather_block_table_torch
    impl(table, idx_mapping, out)


# --------------------------------------------------------------------------- torch references


def gather_block_table_torch(table: torch.Tensor, idx_mapping: torch.Tensor, out: torch.Tensor) -> None:
    """Torch reference of `BlockTables.gather`: `out[b] = table[idx_mapping[b]]`."""
    # copy_ rather than index_select(out=...): `out` may be any view of a persistent buffer.
    out.copy_(table.index_select(0, idx_mapping))


def compute_slot_mapping_torch(
    block_table: torch.Tensor,  # [R, M] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    positions: torch.Tensor,  # [T] int64
    block_size: int,
    out: torch.Tensor,  # [T] int64
) -> None:
    """Torch reference of `compute_slot_mapping`."""
    max_blocks = block_table.shape[1]
    entry, _, is_real = token_entries(query_start_loc, out.shape[0])
    # Clamped so that padded tokens' gather stays in bounds; real tokens are in range.
    col = torch.div(positions, block_size, rounding_mode="floor").clamp_(0, max_blocks - 1)
    block = block_table[entry, col].long()  # [T]
    slot = block * block_size + torch.remainder(positions, block_size)
    out.copy_(torch.where(is_real, slot, torch.full_like(slot, -1)))


# --------------------------------------------------------------------------- Triton kernels

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _gather_kernel(table_ptr, table_stride, idx_ptr, out_ptr, out_stride, width, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        row = tl.load(idx_ptr + b).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        for i in range(0, width, BLOCK):
            o = i + offs
            m = o < width
            tl.store(out_ptr + b * out_stride + o, tl.load(table_ptr + row * table_stride + o, mask=m), mask=m)

    @triton.jit(do_not_specialize=['num_reqs', 'num_tokens'])
    def _slot_mapping_kernel(
        bt_ptr,
        bt_stride,
        qsl_ptr,
        pos_ptr,
        out_ptr,
        num_reqs,
        num_tokens,
        max_blocks,
        block_size,
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
                pos = tl.load(pos_ptr + start + o, mask=m, other=0)
                col = tl.minimum(tl.maximum(pos // block_size, 0), max_blocks - 1)
                block = tl.load(row_ptr + col, mask=m, other=0).to(tl.int64)
                tl.store(out_ptr + start + o, block * block_size + pos % block_size, mask=m)
        else:
            tail = tl.load(qsl_ptr + num_reqs)
            for i in range(tail, num_tokens, BLOCK):
                o = i + offs
                tl.store(out_ptr + o, tl.full([BLOCK], -1, dtype=tl.int64), mask=o < num_tokens)


_COL_BLOCK = 256  # block-table columns per loop iteration
_TOKEN_BLOCK = 1024  # tokens per loop iteration


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not importable; use the torch reference implementation")


def gather_block_table_triton(table: torch.Tensor, idx_mapping: torch.Tensor, out: torch.Tensor) -> None:
    """Triton implementation of `BlockTables.gather` (one program per batch entry)."""
    _require_triton()
    if table.stride(1) != 1 or out.stride(1) != 1 or not idx_mapping.is_contiguous():
        raise ValueError("gather_block_table_triton needs unit-stride rows and a contiguous idx_mapping")
    _gather_kernel[(idx_mapping.shape[0],)](
        table, table.stride(0), idx_mapping, out, out.stride(0), table.shape[1], BLOCK=_COL_BLOCK
    )


def compute_slot_mapping_triton(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
) -> None:
    """Triton implementation of `compute_slot_mapping` (R_pad + 1 programs)."""
    _require_triton()
    if block_table.stride(1) != 1 or not (
        query_start_loc.is_contiguous() and positions.is_contiguous() and out.is_contiguous()
    ):
        raise ValueError("compute_slot_mapping_triton needs unit-stride block-table rows and contiguous 1-D tensors")
    num_reqs = block_table.shape[0]
    _slot_mapping_kernel[(num_reqs + 1,)](
        block_table,
        block_table.stride(0),
        query_start_loc,
        positions,
        out,
        num_reqs,
        out.shape[0],
        block_table.shape[1],
        block_size,
        BLOCK=_TOKEN_BLOCK,
    )


# --------------------------------------------------------------------------- public API


def compute_slot_mapping(
    block_table: torch.Tensor,  # [R_pad, M] int32, the batch's gathered rows
    query_start_loc: torch.Tensor,  # [R_pad + 1] int32
    positions: torch.Tensor,  # [T_pad] int64
    block_size: int,
    out: torch.Tensor,  # [T_pad] int64
) -> None:
    """Write each token's KV-cache slot: `block_table[b, pos // bs] * bs + pos % bs`.

    Padded tokens (`t >= query_start_loc[R_pad]`) get slot -1, which the KV-write
    kernel skips (docs/architecture.md §4).
    """
    if block_table.dim() != 2 or block_table.shape[0] < 1:
        raise ValueError(f"block_table has shape {tuple(block_table.shape)}, expected [R_pad, M] with R_pad >= 1")
    if block_size <= 0:
        raise ValueError(f"block_size={block_size} must be positive")
    num_reqs = block_table.shape[0]
    num_tokens = out.shape[0]
    check_tensor("block_table", block_table, tuple(block_table.shape), _I32)
    check_tensor("query_start_loc", query_start_loc, (num_reqs + 1,), _I32)
    check_tensor("positions", positions, (num_tokens,), _I64)
    check_tensor("out", out, (num_tokens,), _I64)
    impl = compute_slot_mapping_triton if use_triton(out) else compute_slot_mapping_torch
    impl(block_table, query_start_loc, positions, block_size, out)


__all__ = [
    "gather_block_table",
    "compute_slot_mapping",
    "compute_slot_mapping_torch",
    "compute_slot_mapping_triton",
    "gather_block_table_torch",
    "gather_block_table_triton",
]
