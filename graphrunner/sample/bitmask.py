"""Token bitmasks applied in place: allowed ids and structured-output grammars.

A row's allowed set is the AND of its allowed-ids mask (`SamplingStates.allowed_mask`, used
when `use_allowed`) and its grammar mask of the sampled slot (`grammar_mask[row, slot]`,
used when `use_grammar`); bit v % 32 of word v // 32 set = token v allowed. Every other
token's logit becomes -inf, exactly what `processors.apply_allowed` gives, but written in
place into the logits: the greedy and sampled variants (which return no logprobs, so need
no raw logits after sampling) pay for a constrained row only what its masks say.

The Triton kernel reads only mask words and stores -inf where a bit is clear: at 64 rows
x 151,936 that is 1.2 MB of words against 39 MB of logits, so a grammar row costs the
sampler about a tenth of one read of its logits. Rows that use no mask return at once.
Graph-safe: the grid is (R, ceil(V / BLOCK)), no host sync.
"""

from __future__ import annotations

import torch

from graphrunner.kernels import HAS_TRITON, use_triton

__all__ = ["apply_bitmasks_inplace"]

_BLOCK = 2048  # tokens per program: 64 int32 words


def _allowed_bits(words: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [R, V] bool
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)  # [32]
    return (((words[:, :, None] >> shifts) & 1) != 0).flatten(1)[:, :vocab_size]


def apply_bitmasks_torch(
    logits: torch.Tensor,  # [R, V] float, written in place
    rows: torch.Tensor,  # [R] int: batch entry -> state row
    slots: torch.Tensor | None,  # [R] int64 sampled slot of each entry (grammar mask); None: slot 0
    use_allowed: torch.Tensor,  # [rows] bool
    allowed_mask: torch.Tensor,  # [rows, W] int32
    use_grammar: torch.Tensor,  # [rows] bool
    grammar_mask: torch.Tensor,  # [rows, S, W] int32
) -> None:
    """The reference (CPU): the same -inf entries as the Triton kernel."""
    r = rows.long()
    vocab_size = logits.shape[1]
    grammar_words = grammar_mask[r, 0] if slots is None else grammar_mask[r, slots.long()]  # [R, W]
    keep = ~use_allowed[r, None] | _allowed_bits(allowed_mask[r], vocab_size)  # [R, V]
    keep &= ~use_grammar[r, None] | _allowed_bits(grammar_words, vocab_size)
    logits.masked_fill_(~keep, float("-inf"))


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["vocab_size"])
    def _bitmask_kernel(x_ptr, x_stride, rows_ptr, slots_ptr, use_allowed_ptr, allowed_ptr, allowed_stride,
                        use_grammar_ptr, grammar_ptr, grammar_stride_row, grammar_stride_slot, vocab_size,
                        HAS_SLOTS: tl.constexpr, BLOCK: tl.constexpr):
        entry = tl.program_id(0)
        row = tl.load(rows_ptr + entry).to(tl.int64)
        by_allowed = tl.load(use_allowed_ptr + row) != 0
        by_grammar = tl.load(use_grammar_ptr + row) != 0
        if by_allowed or by_grammar:
            offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] token ids
            inside = offs < vocab_size
            word, bit = offs // 32, offs % 32
            keep = inside
            if by_allowed:
                words = tl.load(allowed_ptr + row * allowed_stride + word, mask=inside, other=0)
                keep = keep & (((words >> bit) & 1) != 0)
            if by_grammar:
                slot = tl.load(slots_ptr + entry).to(tl.int64) if HAS_SLOTS else 0
                base = grammar_ptr + row * grammar_stride_row + slot * grammar_stride_slot
                words = tl.load(base + word, mask=inside, other=0)
                keep = keep & (((words >> bit) & 1) != 0)
            # Only the dropped entries are written: the logits themselves are never read.
            tl.store(x_ptr + entry.to(tl.int64) * x_stride + offs, float("-inf"), mask=inside & ~keep)


def apply_bitmasks_triton(logits, rows, slots, use_allowed, allowed_mask, use_grammar, grammar_mask) -> None:
    """`apply_bitmasks_torch` as one Triton launch (see the module docstring)."""
    num_entries, vocab_size = logits.shape
    if num_entries == 0:
        return
    if logits.stride(1) != 1 or allowed_mask.stride(1) != 1 or grammar_mask.stride(2) != 1:
        raise ValueError("apply_bitmasks: the logits and the mask words must be contiguous along the vocabulary")
    grid = (num_entries, triton.cdiv(vocab_size, _BLOCK))
    _bitmask_kernel[grid](
        logits, logits.stride(0), rows, slots if slots is not None else rows, use_allowed, allowed_mask,
        allowed_mask.stride(0), use_grammar, grammar_mask, grammar_mask.stride(0), grammar_mask.stride(1),
        vocab_size, HAS_SLOTS=slots is not None, BLOCK=_BLOCK,
    )


def apply_bitmasks_inplace(
    logits: torch.Tensor,  # [R, V] float32, written in place
    rows: torch.Tensor,  # [R] int32/int64 state rows
    slots: torch.Tensor | None,  # [R] int64 sampled slots, None: slot 0
    use_allowed: torch.Tensor,  # [rows] bool
    allowed_mask: torch.Tensor,  # [rows, W] int32
    use_grammar: torch.Tensor,  # [rows] bool
    grammar_mask: torch.Tensor,  # [rows, S, W] int32
) -> None:
    """Set -inf where a row's allowed-ids or grammar mask clears a token (Triton on CUDA, else torch)."""
    words = -(-logits.shape[1] // 32)
    if allowed_mask.shape[-1] < words or grammar_mask.shape[-1] < words:
        raise ValueError(f"bitmasks have {min(allowed_mask.shape[-1], grammar_mask.shape[-1])} words, "
                         f"need {words} for {logits.shape[1]} logits")
    impl = apply_bitmasks_triton if use_triton(logits) else apply_bitmasks_torch
    impl(logits, rows, slots, use_allowed, allowed_mask, use_grammar, grammar_mask)
