"""The packed penalty counts' two widths (graphrunner/state/counts.py).

The conversions against per-element Python arithmetic; the Triton helpers (add_count,
set_prompt_flag, load_counts) under the interpreter against a Python count, with tokens that
share a 32-bit word and counts at the 15-bit limit (a carry into the neighbour would show);
the layout checks the kernels rely on.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.kernels import HAS_TRITON
from graphrunner.state.counts import (
    MAX_LEN_16,
    PACKED32_FLAG,
    allocate_counts,
    as_packed32,
    check_counts,
    counts_dtype,
    from_packed32,
)


def test_width_follows_max_model_len():
    assert counts_dtype(MAX_LEN_16) == torch.int16 and counts_dtype(MAX_LEN_16 + 1) == torch.int32
    c = allocate_counts(3, 41, 4096, torch.device("cpu"))
    assert c.dtype == torch.int16 and c.shape == (3, 41) and c.stride(0) == 42 and not c.any()
    check_counts(c)
    assert allocate_counts(3, 41, 1 << 20, torch.device("cpu")).dtype == torch.int32


@given(flags=st.lists(st.booleans(), min_size=1, max_size=64), data=st.data())
def test_int16_form_round_trips_every_count_below_the_limit(flags, data):
    counts = data.draw(st.lists(st.integers(0, MAX_LEN_16 - 1), min_size=len(flags), max_size=len(flags)))
    packed = torch.tensor([c + (PACKED32_FLAG if f else 0) for f, c in zip(flags, counts, strict=True)],
                          dtype=torch.int32)
    half = from_packed32(packed, torch.int16)
    assert half.dtype == torch.int16
    unsigned = (half.to(torch.int32) & 0xFFFF).tolist()
    assert unsigned == [c + (1 << 15 if f else 0) for f, c in zip(flags, counts, strict=True)]  # bit 15 the flag
    assert torch.equal(as_packed32(half), packed)
    assert as_packed32(packed) is packed and from_packed32(packed, torch.int32) is packed
    wide = packed.to(torch.int64) + 1  # a sum in the int32 form (draft counts added): already packed32
    assert as_packed32(wide) is wide
    assert as_packed32(half).dtype == torch.int32


def test_conversion_and_layout_errors_name_the_limit():
    with pytest.raises(ValueError, match="32767"):
        from_packed32(torch.tensor([MAX_LEN_16], dtype=torch.int32), torch.int16)
    with pytest.raises(ValueError, match="int16 or int32"):
        check_counts(torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="even row stride"):
        check_counts(torch.zeros(2, 41, dtype=torch.int16))  # stride 41: odd pairs misaligned


if HAS_TRITON:
    import triton
    import triton.language as tl

    from graphrunner.state.counts import add_count, load_counts, set_prompt_flag

    @triton.jit
    def _apply_kernel(counts_ptr, stride, rows_ptr, toks_ptr, flag_ptr, out_ptr, vocab_size, N: tl.constexpr,
                      V_PAD: tl.constexpr):
        # One program: event i adds an output occurrence (flag 0) or sets the prompt flag (flag 1)
        # of token toks[i] in row rows[i], events in order; then row 0 is read back in the int32 form.
        for i in range(N):
            row_ptr = counts_ptr + tl.load(rows_ptr + i).to(tl.int64) * stride
            tok = tl.load(toks_ptr + i + tl.arange(0, 1))
            is_flag = tl.load(flag_ptr + i + tl.arange(0, 1)) != 0
            set_prompt_flag(row_ptr, tok, is_flag)
            add_count(row_ptr, tok, ~is_flag)
        ids = tl.arange(0, V_PAD)
        tl.store(out_ptr + ids, load_counts(counts_ptr, ids, ids < vocab_size), mask=ids < vocab_size)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (TRITON_INTERPRET=1 on CPU)")
@given(width=st.sampled_from([16, 32]), vocab=st.integers(1, 9), data=st.data())
def test_kernel_updates_equal_a_python_count_next_to_full_neighbours(width, vocab, data):
    counts = allocate_counts(2, vocab, 64 if width == 16 else 1 << 16, torch.device("cpu"))
    # Start row 0 at the 15-bit limit less 2 for every token: two more adds reach 32767, never 32768.
    start = torch.full((vocab,), MAX_LEN_16 - 3, dtype=torch.int32)
    counts[0] = from_packed32(start, counts.dtype)
    events = data.draw(st.lists(st.tuples(st.integers(0, 1), st.integers(0, vocab - 1), st.booleans()),
                                min_size=1, max_size=12))
    kept, adds = [], [0] * vocab  # at most two adds per token of row 0 (its limit)
    for row, tok, is_flag in events:
        if row == 0 and not is_flag:
            if adds[tok] == 2:
                continue
            adds[tok] += 1
        kept.append((row, tok, is_flag))
    want = start.clone()
    for row, tok, is_flag in kept:
        if row == 0:
            want[tok] = want[tok] | PACKED32_FLAG if is_flag else want[tok] + 1
    rows, toks, flags = (torch.tensor(col, dtype=torch.int32) for col in zip(*kept, strict=True))
    out = torch.zeros(vocab, dtype=torch.int32)
    _apply_kernel[(1,)](counts, counts.stride(0), rows, toks, flags, out, vocab, N=len(kept),
                        V_PAD=triton.next_power_of_2(vocab))
    assert torch.equal(out, want)
    assert torch.equal(as_packed32(counts[0]), want)


@pytest.mark.gpu
@pytest.mark.parametrize("distinct", [64, 151_936])  # 64: most adds contend for the same few words
def test_gpu_rebuild_of_int16_counts_equals_token_counts(distinct):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from graphrunner.sample.fused_process import refresh_counts
    from graphrunner.sample.processors import token_counts

    g = torch.Generator().manual_seed(distinct)
    rows, vocab, max_model_len = 5, 151_936, 4096
    history = torch.randint(0, distinct, (rows, max_model_len), generator=g, dtype=torch.int32)
    prompt_len = torch.randint(0, max_model_len, (rows,), generator=g, dtype=torch.int32)
    known = torch.randint(0, max_model_len + 1, (rows,), generator=g)
    counts = allocate_counts(rows, vocab, max_model_len, torch.device("cuda"))
    counts.fill_(-1)  # the rebuild must clear what was there
    stale = torch.ones(rows, dtype=torch.bool, device="cuda")
    idx = torch.arange(rows, dtype=torch.int32, device="cuda")
    refresh_counts(counts, stale, history.cuda(), idx, prompt_len.cuda(), known.cuda(), clear=True,
                   use_triton_kernel=True)
    want = token_counts(history, torch.arange(rows), prompt_len.long(), known, vocab)
    assert counts.dtype == torch.int16 and not stale.any()
    assert torch.equal(as_packed32(counts.cpu()), want)
