"""In-place token bitmasks (graphrunner/sample/bitmask.py) against the processors' reference:
the Triton kernel (interpreted on CPU, native on GPU) and the torch path give exactly the
-inf entries of `processors.apply_allowed` over the AND of the allowed-ids and grammar masks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.kernels import HAS_TRITON
from graphrunner.sample.bitmask import apply_bitmasks_inplace, apply_bitmasks_torch
from graphrunner.sample.processors import apply_allowed


def _case(seed: int, num_entries: int, vocab: int, slots: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    num_rows = num_entries + 3
    words = -(-vocab // 32)
    logits = torch.randn(num_entries, vocab, generator=g) * 4
    logits[0, : min(3, vocab)] = float("-inf")
    rows = torch.randperm(num_rows, generator=g)[:num_entries].to(torch.int32)
    slot_ids = torch.randint(0, slots, (num_entries,), generator=g)
    use_allowed = torch.rand(num_rows, generator=g) < 0.5
    use_grammar = torch.rand(num_rows, generator=g) < 0.5
    # Sparse and dense masks: a few allowed tokens in some rows, most in others.
    density = torch.rand(num_rows, 1, 1, generator=g)
    bits = torch.rand(num_rows, slots + 1, words * 32, generator=g) < density  # [rows, S+1, 32W]
    packed = torch.from_numpy(np.packbits(bits.numpy(), axis=-1, bitorder="little").view("<u4").view(np.int32).copy())
    allowed_mask, grammar_mask = packed[:, 0].contiguous(), packed[:, 1:].contiguous()  # [rows, W], [rows, S, W]
    tensors = (logits, rows, slot_ids, use_allowed, allowed_mask, use_grammar, grammar_mask)
    return tuple(t.to(device) for t in tensors)


def _reference(logits, rows, slots, use_allowed, allowed_mask, use_grammar, grammar_mask):
    """The sampler's out-of-place path: one AND of both masks (unused = all ones), then apply_allowed."""
    r = rows.long()
    allowed = torch.where(use_allowed[r, None], allowed_mask[r], -1)
    grammar = torch.where(use_grammar[r, None], grammar_mask[r, slots], -1)
    return apply_allowed(logits, allowed & grammar, use_allowed[r] | use_grammar[r])


@given(seed=st.integers(0, 2**16), num_entries=st.integers(1, 6), vocab=st.integers(1, 5000),
       slots=st.integers(1, 3))
def test_torch_path_matches_the_processors(seed, num_entries, vocab, slots):
    logits, *rest = _case(seed, num_entries, vocab, slots)
    expected = _reference(logits, *rest)
    apply_bitmasks_torch(logits, *rest)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
@given(seed=st.integers(0, 2**16), num_entries=st.integers(1, 4), vocab=st.integers(1, 4500),
       slots=st.integers(1, 3), with_slots=st.booleans())
def test_triton_kernel_matches_the_processors(seed, num_entries, vocab, slots, with_slots):
    """Under TRITON_INTERPRET=1 on CPU: -inf exactly where a used mask clears a bit, every other
    logit bit-identical (the kernel never writes it); slot 0 when no slots are given."""
    from graphrunner.sample.bitmask import apply_bitmasks_triton

    logits, rows, slot_ids, *masks = _case(seed, num_entries, vocab, slots)
    slot_arg = slot_ids if with_slots else None
    expected = _reference(logits, rows, slot_ids if with_slots else torch.zeros_like(slot_ids), *masks)
    apply_bitmasks_triton(logits, rows, slot_arg, *masks)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


def test_too_few_mask_words_are_refused():
    logits, rows, slots, use_allowed, allowed_mask, use_grammar, grammar_mask = _case(0, 2, 100, 1)
    with pytest.raises(ValueError, match="bitmasks have 3 words, need 4 for 100 logits"):
        apply_bitmasks_inplace(logits, rows, slots, use_allowed, allowed_mask[:, :3], use_grammar, grammar_mask)


@pytest.mark.gpu
def test_gpu_kernel_matches_and_replays_in_a_cuda_graph():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    logits, rows, slots, *masks = _case(7, 64, 151936, 2, device="cuda")
    expected = _reference(logits, rows, slots, *masks)
    work = logits.clone()
    apply_bitmasks_inplace(work, rows, slots, *masks)
    torch.testing.assert_close(work, expected, rtol=0, atol=0)
    work.copy_(logits)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_bitmasks_inplace(work, rows, slots, *masks)
    work.copy_(logits)
    graph.replay()
    torch.testing.assert_close(work, expected, rtol=0, atol=0)
