"""The packed penalty counts of `SamplingStates.counts`: per (row, token), a prompt flag and
the output count in one integer.

Two widths, chosen by max_model_len so that no output count can reach the flag (exact both
ways; a request holds at most max_model_len - 1 outputs):

- int16 where max_model_len <= 32768: bit 15 is the prompt flag, bits 0-14 the output count.
  Half the bytes of int32: with penalties on, the fused processing pass reads the whole
  [R, V] table every step (78 MB instead of 156 MB at 256 rows x 151,936).
- int32 otherwise: bit 24 the flag, bits 0-23 the count (`PACKED32_FLAG`, the form the torch
  processors compute in, `processors.token_counts`).

The Triton kernels update int16 counts with 32-bit atomics on the word that holds the pair
(2i, 2i + 1): `allocate_counts` gives rows an even stride, so every pair is 4-byte aligned,
and a half never carries into its neighbour (its value stays <= 0xFFFF). The torch
references read through `as_packed32` and write back through `from_packed32`.
"""

from __future__ import annotations

import torch

from graphrunner.kernels import HAS_TRITON

PACKED32_FLAG = 1 << 24  # the prompt flag of the int32 form
PACKED16_FLAG = 1 << 15  # the prompt flag of the int16 form (as an unsigned half)
MAX_LEN_16 = PACKED16_FLAG  # the longest max_model_len the int16 form holds exactly


def counts_dtype(max_model_len: int) -> torch.dtype:
    """int16 where every output count fits in 15 bits, else int32."""
    return torch.int16 if max_model_len <= MAX_LEN_16 else torch.int32


def prompt_flag(dtype: torch.dtype) -> int:
    """The prompt flag of the form `dtype`, as an unsigned value of its width."""
    if dtype not in (torch.int16, torch.int32):
        raise ValueError(f"packed counts are int16 or int32, got {dtype}")
    return PACKED16_FLAG if dtype == torch.int16 else PACKED32_FLAG


def allocate_counts(num_rows: int, vocab_size: int, max_model_len: int, device: torch.device) -> torch.Tensor:
    """Zeroed [num_rows, vocab_size] counts of the width `counts_dtype` picks (int16 rows padded
    to an even stride, so the kernels' 32-bit atomics stay aligned)."""
    dtype = counts_dtype(max_model_len)
    stride = vocab_size + (vocab_size & 1) if dtype == torch.int16 else vocab_size
    return torch.zeros(num_rows, stride, dtype=dtype, device=device)[:, :vocab_size]


def check_counts(counts: torch.Tensor) -> None:
    """Raise ValueError unless `counts` is a form the kernels update: int32, or int16 whose pairs
    (2i, 2i + 1) are 4-byte aligned (an even row stride and an aligned start, as `allocate_counts`)."""
    prompt_flag(counts.dtype)
    if counts.dim() != 2 or counts.stride(1) != 1:
        raise ValueError(f"counts must be [rows, V] with unit stride in V, got shape {tuple(counts.shape)}, "
                         f"strides {counts.stride()}")
    if counts.dtype == torch.int16 and (counts.stride(0) % 2 or counts.data_ptr() % 4):
        raise ValueError(f"int16 counts need an even row stride and a 4-byte aligned start (got stride "
                         f"{counts.stride(0)}, address {counts.data_ptr():#x}); allocate them with allocate_counts")


def as_packed32(counts: torch.Tensor) -> torch.Tensor:  # the PACKED32_FLAG form
    """int16 counts in the int32 form (a copy); counts already in it (int32, or wider sums of
    them such as processors.add_draft_counts') are returned as they are."""
    if counts.dtype != torch.int16:
        return counts
    half = counts.to(torch.int32) & 0xFFFF  # the unsigned 16-bit value
    flag = torch.where(half >= PACKED16_FLAG, PACKED32_FLAG, 0).to(torch.int32)
    return (half & (PACKED16_FLAG - 1)) | flag


def from_packed32(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int32-form counts in the form `dtype` (the inverse of `as_packed32`)."""
    if dtype == torch.int32:
        return packed
    prompt_flag(dtype)  # checks the width
    count = packed & (PACKED32_FLAG - 1)
    # Checked where it costs no device sync (the references run inside captured steps too); on a
    # device, counts_dtype's choice by max_model_len already bounds every count below the limit.
    if not packed.is_cuda and bool((count >= PACKED16_FLAG).any()):
        raise ValueError(f"an output count of {int(count.max())} does not fit the int16 counts "
                         f"(limit {PACKED16_FLAG - 1}: max_model_len <= {MAX_LEN_16})")
    signed = torch.where(packed >= PACKED32_FLAG, count - PACKED16_FLAG, count)  # bit 15 as int16's sign
    return signed.to(torch.int16)


if HAS_TRITON:
    import triton
    import triton.language as tl

    _F16 = tl.constexpr(PACKED16_FLAG)
    _F32 = tl.constexpr(PACKED32_FLAG)

    @triton.jit
    def load_counts(row_ptr, ids, mask):
        """A row's packed counts at `ids` as int32 in the int32 form (flag bit 24), 0 where off."""
        # (one return after a static if/else: the compiler types every return of a function)
        c = tl.load(row_ptr + ids, mask=mask, other=0)
        if row_ptr.dtype.element_ty == tl.int16:
            half = c.to(tl.int32) & 0xFFFF
            packed = (half & (_F16 - 1)) | tl.where(half >= _F16, _F32, 0)
        else:
            packed = c
        return packed

    @triton.jit
    def _word(row_ptr, tok, bits):
        # (the 32-bit word holding tok's count, `bits` moved to tok's half of it)
        if row_ptr.dtype.element_ty == tl.int16:
            word = (row_ptr + (tok & ~1)).to(tl.pointer_type(tl.int32))
            moved = bits << ((tok & 1) * 16).to(tl.int32)
        else:
            word = row_ptr + tok
            moved = bits
        return word, moved

    @triton.jit
    def add_count(row_ptr, tok, mask):
        """+1 output occurrence of `tok` in a row's counts (atomic; int16 through its 32-bit word)."""
        word, one = _word(row_ptr, tok, (tok * 0 + 1).to(tl.int32))
        tl.atomic_add(word, one, mask=mask)

    @triton.jit
    def set_prompt_flag(row_ptr, tok, mask):
        """Set the prompt flag of `tok` in a row's counts (atomic)."""
        if row_ptr.dtype.element_ty == tl.int16:
            flag = (tok * 0 + _F16).to(tl.int32)
        else:
            flag = (tok * 0 + _F32).to(tl.int32)
        word, bit = _word(row_ptr, tok, flag)
        tl.atomic_or(word, bit, mask=mask)
