"""N-gram prompt-lookup drafter: torch reference and Triton (interpreted on CPU) vs a
plain-Python reference written from the definition and vs a KMP port of vLLM's proposer;
padding and stale buffers fully overwritten; argument errors; GPU test at realistic sizes."""

from __future__ import annotations

import random
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.kernels import HAS_TRITON
from graphrunner.spec_decode import ngram
from graphrunner.spec_decode.ngram import propose_ngram

SENTINEL = -7777
# Triton tests run compiled on CUDA tensors where a GPU exists, interpreted on CPU otherwise.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


# --------------------------------------------------------------------------- plain-Python references


def loop_propose(tokens: list[int], min_n: int, max_n: int, k: int, max_len: int) -> list[int]:
    """The definition: longest n first, then the leftmost j with j + n <= s - 1."""
    s = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        for j in range(0, s - n):  # j + n <= s - 1
            if tokens[j : j + n] == tokens[s - n :]:
                start = j + n
                return tokens[start : start + min(k, s - start, max_len - s)]
    return []


def kmp_propose(tokens: list[int], min_n: int, max_n: int, k: int, max_len: int) -> list[int]:
    """vLLM's algorithm (KMP over the reversed history, lps capped at max_n), re-stated."""
    s = len(tokens)
    k = min(k, max_len - s)
    if s < min_n or k <= 0:
        return []
    rev = tokens[::-1]
    lps = [0] * max_n
    longest, pos, cur, i = 0, 0, 0, 1
    while i < s:
        if rev[cur] == rev[i]:
            cur += 1
            if cur >= longest:  # ties go to the later reversed position: the earliest match
                longest, pos = cur, i
            if i < max_n:
                lps[i] = cur
            if cur == max_n:
                cur = lps[max_n - 1]
            i += 1
        elif cur:
            cur = lps[cur - 1]
        else:
            i += 1
    if longest < min_n:
        return []
    start = s - 1 - pos + longest
    return tokens[start : start + min(k, s - start)]


# --------------------------------------------------------------------------- batches


@dataclass
class Batch:
    table: torch.Tensor  # [rows, L] int32; garbage (outside the vocabulary) past each history
    idx_mapping: list[int]  # [R_pad]; padded entries -> the scratch row (the last)
    seq_lens: list[int]  # [R_pad]; 0 for padded entries
    num_spec: int
    min_n: int
    max_n: int

    def history(self, b: int) -> list[int]:
        return self.table[self.idx_mapping[b], : self.seq_lens[b]].tolist()

    def expected(self) -> list[list[int]]:
        L, k = self.table.shape[1], self.num_spec
        return [loop_propose(self.history(b), self.min_n, self.max_n, k, L) for b in range(len(self.seq_lens))]


def make_batch(rng: random.Random, max_num_reqs: int, max_len: int, vocab: int, num_spec: int, min_n: int, extra: int):
    num_rows = max_num_reqs + 1
    table = torch.tensor([[rng.randrange(vocab) for _ in range(max_len)] for _ in range(num_rows)], dtype=torch.int32)
    num_real = rng.randint(0, max_num_reqs)
    num_reqs = rng.randint(max(num_real, 1), max_num_reqs)
    rows = rng.sample(range(max_num_reqs), num_real)
    lens = [rng.choice([rng.randint(0, max_len), max_len, max_len - 1, rng.randint(0, 3)]) for _ in rows]
    for r, s in zip(rows, lens, strict=True):
        table[r, s:] = 100 + rng.randrange(50)  # never part of a history: must never be read as one
    table[max_num_reqs] = 0  # the scratch row: all one token, matches everywhere if ever read
    idx = rows + [max_num_reqs] * (num_reqs - num_real)
    return Batch(table, idx, lens + [0] * (num_reqs - num_real), num_spec, min_n, min_n + extra)


batches = st.builds(
    make_batch,
    rng=st.randoms(use_true_random=False),
    max_num_reqs=st.integers(1, 8),  # Triton grids stay <= 8 programs
    max_len=st.integers(1, 40),
    vocab=st.integers(2, 5),
    num_spec=st.integers(1, 6),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 3),
)


def run(impl: str, b: Batch, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """One implementation into sentinel-filled, strided views of larger buffers."""
    R, k = len(b.idx_mapping), b.num_spec
    draft_buf = torch.full((R + 2, k + 3), SENTINEL, dtype=torch.int32, device=device)
    num_buf = torch.full((R + 2,), SENTINEL, dtype=torch.int32, device=device)
    getattr(ngram, f"propose_ngram_{impl}")(
        b.table.to(device),
        torch.tensor(b.idx_mapping, dtype=torch.int32, device=device),
        torch.tensor(b.seq_lens, dtype=torch.int32, device=device),
        k,
        b.min_n,
        b.max_n,
        draft_buf[:R, 1 : k + 1],
        num_buf[:R],
    )
    outside = torch.ones_like(draft_buf, dtype=torch.bool)
    outside[:R, 1 : k + 1] = False
    assert (draft_buf[outside] == SENTINEL).all() and (num_buf[R:] == SENTINEL).all()  # no stray writes
    return draft_buf[:R, 1 : k + 1].cpu(), num_buf[:R].cpu()


def check_against_loop(b: Batch, draft: torch.Tensor, num: torch.Tensor) -> None:
    expected = b.expected()
    assert num.tolist() == [len(e) for e in expected]
    assert draft.tolist() == [e + [0] * (b.num_spec - len(e)) for e in expected]  # unused slots are 0


# --------------------------------------------------------------------------- properties


@settings(deadline=None)
@given(b=batches)
def test_torch_matches_loop_reference(b: Batch):
    check_against_loop(b, *run("torch", b))


@needs_triton
@settings(deadline=None)
@given(b=batches, pos_block=st.sampled_from([2, 8, 256]))
def test_triton_matches_loop_reference(b: Batch, pos_block: int):
    # Small position blocks make the scan cross blocks: ties must keep the earlier block's match.
    with mock.patch.object(ngram, "_POS_BLOCK", pos_block):
        check_against_loop(b, *run("triton", b, DEVICE))


@settings(deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2), max_size=30),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 3),
    k=st.integers(1, 5),
    room=st.integers(0, 3),
)
def test_definition_is_vllms_kmp(tokens, min_n, extra, k, room):
    L = len(tokens) + room
    assert loop_propose(tokens, min_n, min_n + extra, k, L) == kmp_propose(tokens, min_n, min_n + extra, k, L)


# --------------------------------------------------------------------------- examples


@pytest.mark.parametrize(
    "tokens, min_n, max_n, k, room, expected",
    [
        ([1, 2, 3, 4, 2, 3], 2, 3, 4, 9, [4, 2, 3]),  # vLLM's docstring example
        ([0, 1, 0, 1, 0, 1], 1, 2, 3, 9, [0, 1, 0]),  # leftmost of the longest (j=0, not j=2)
        ([0, 1, 0, 1, 0, 1], 1, 3, 3, 9, [0, 1]),  # n=3 wins over n=2; its match ends 2 early
        ([5, 7, 5, 7, 9, 5, 7], 2, 2, 4, 9, [5, 7, 9, 5]),
        ([5, 7, 5, 7, 9, 5, 7], 2, 2, 4, 2, [5, 7]),  # at most L - s drafts
        ([5, 7, 5, 7, 9, 5, 7], 2, 2, 4, 0, []),  # a full row proposes nothing
        ([3, 3, 3, 3], 1, 4, 2, 9, [3]),  # n=3 at j=0 overlaps the suffix; one token follows it
        ([1, 2, 3], 1, 3, 2, 9, []),  # no earlier occurrence
        ([4], 1, 1, 2, 9, []),  # a lone token has nothing before it
        ([], 1, 1, 2, 9, []),
    ],
)
def test_examples(tokens, min_n, max_n, k, room, expected):
    L = max(len(tokens) + room, 1)
    assert loop_propose(tokens, min_n, max_n, k, L) == expected
    table = torch.full((2, L), 99, dtype=torch.int32)
    table[1, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
    b = Batch(table, [1, 0], [len(tokens), 0], k, min_n, max_n)
    impls = ["torch", "triton"] if HAS_TRITON else ["torch"]
    for impl in impls:
        draft, num = run(impl, b, "cpu" if impl == "torch" else DEVICE)
        assert num.tolist() == [len(expected), 0]
        assert draft.tolist() == [expected + [0] * (k - len(expected)), [0] * k]


def test_public_api_overwrites_stale_buffers_and_clamps_seq_lens():
    b = make_batch(random.Random(5), 6, 12, 2, 3, 1, 2)
    R = len(b.idx_mapping)
    out_draft = torch.full((R, 3), SENTINEL, dtype=torch.int32)
    out_num = torch.full((R,), SENTINEL, dtype=torch.int32)
    args = (b.table, torch.tensor(b.idx_mapping, dtype=torch.int32), torch.tensor(b.seq_lens, dtype=torch.int32))
    propose_ngram(*args, 3, b.min_n, b.max_n, out_draft, out_num)
    check_against_loop(b, out_draft, out_num)
    # Out-of-range lengths read nothing outside the row: > L counts as L, < 0 as 0.
    table = torch.tensor([[1, 2, 1, 2]], dtype=torch.int32)
    out_draft.fill_(SENTINEL)
    out_num.fill_(SENTINEL)
    idx = torch.zeros(R, dtype=torch.int32)
    lens = torch.tensor([9, -3] + [0] * (R - 2), dtype=torch.int32)
    propose_ngram(table, idx, lens, 3, 1, 2, out_draft, out_num)
    assert out_num.tolist() == [0] * R and out_draft.eq(0).all()


def test_argument_errors():
    table = torch.zeros(3, 8, dtype=torch.int32)
    idx = torch.zeros(2, dtype=torch.int32)
    lens = torch.zeros(2, dtype=torch.int32)
    draft, num = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    good = dict(all_token_ids=table, idx_mapping=idx, seq_lens=lens, num_spec=4, min_n=1, max_n=3)
    outs = dict(out_draft=draft, out_num_draft=num)
    cases = [
        (dict(min_n=0), r"min_n=0, max_n=3: need 1 <= min_n <= max_n"),
        (dict(min_n=4), r"min_n=4, max_n=3: need 1 <= min_n <= max_n"),
        (dict(num_spec=0, out_draft=draft[:, :0]), r"num_spec=0 must be at least 1"),
        (dict(num_spec=3), r"out_draft has shape \(2, 4\), expected \(2, 3\)"),
        (dict(all_token_ids=table[0]), r"all_token_ids has shape \(8,\), expected \[rows, L\]"),
        (dict(all_token_ids=table.long()), r"all_token_ids has dtype torch.int64"),
        (dict(idx_mapping=idx[:0]), r"idx_mapping has shape \(0,\), expected \[R_pad\] with R_pad >= 1"),
        (dict(seq_lens=lens[:1]), r"seq_lens has shape \(1,\), expected \(2,\)"),
        (dict(out_num_draft=num.long()), r"out_num_draft has dtype torch.int64"),
        (dict(out_draft=draft.to("meta")), r"out_draft is on meta, all_token_ids on cpu"),
    ]
    for change, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            propose_ngram(**{**good, **outs, **change})
    assert draft.eq(0).all() and num.eq(0).all()  # a rejected call writes nothing


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@settings(deadline=None)
@given(seed=st.integers(0, 2**30), vocab=st.sampled_from([2, 5, 50, 32000]), min_n=st.integers(1, 4))
def test_gpu_triton_matches_torch_large(seed, vocab, min_n):
    # R_pad = 256 entries over 257 rows of L = 4096 tokens; max_n = 4, k = 4.
    b = make_batch(random.Random(seed), 256, 4096, vocab, 4, min_n, 4 - min_n)
    ref = run("torch", b, "cuda")
    got = run("triton", b, "cuda")
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    rng = random.Random(seed)
    for e in rng.sample(range(len(b.seq_lens)), min(8, len(b.seq_lens))):  # spot-check the definition
        want = loop_propose(b.history(e), b.min_n, b.max_n, 4, 4096)
        assert ref[1][e].item() == len(want) and ref[0][e, : len(want)].tolist() == want
