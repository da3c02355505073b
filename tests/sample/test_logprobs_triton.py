"""The one-pass logprobs kernels against the torch path (Triton under TRITON_INTERPRET=1 on CPU).

Rows mix what a logsumexp, a rank count or a top-K can get wrong: long runs of equal
logits (ties across blocks and chunks), -inf entries (more than V - K of them, so the
top-K reaches into them), rows of only -inf, huge (1e30, near fp32 max) and tiny
(1e-30) magnitudes, -0.0 against 0.0. Blocks and chunk counts are forced small, so
several chunks of several blocks run per row and the row's last block is partial.

The top-K comes from the K groups (GROUP consecutive entries) with the best maxima; the
group size and the select program's tile of group keys are forced small too (so a
row has many groups, read over several tiles), one test checks that the select stage
rereads only those K groups, and one feeds layouts that put the top-K, or ties at the
K-th group max, where the group rule could go wrong.

Reference: the torch path of `compute_logprobs` (ranks exact, logprobs to fp32
rounding) and a float64 log_softmax; the top-K ids against a stable descending sort,
which lists equal logits lower id first, the order the kernels promise.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.kernels import HAS_TRITON
from graphrunner.sample import logprobs as logprobs_module
from graphrunner.sample import logprobs_triton as kernels_module
from graphrunner.sample.logprobs import compute_logprobs, time_logprobs
from graphrunner.sample.logprobs_triton import MAX_TOPK, logprobs_plan, logprobs_triton

INTERPRETER_MARKS = [  # also the marks of tests/sample/test_logprobs_fused.py
    pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable"),
    # The Triton interpreter converts 1-element arrays to ints (numpy >= 1.25 warns, per call),
    # and evaluates -inf - -inf in numpy (the kernels mask that NaN out on purpose).
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]
pytestmark = INTERPRETER_MARKS

NAN, INF = float("nan"), float("inf")
KINDS = ("randn", "ties", "neg_inf", "mostly_neg_inf", "all_neg_inf", "huge", "tiny", "signed_zeros")
BAD_KINDS = ("nan", "all_nan", "pos_inf", "pos_inf_nan")


def make_logits(seed: int, kinds: list[str], vocab: int, device="cpu") -> torch.Tensor:  # [R, V] float32
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(len(kinds), vocab, generator=g, device=device) * 3
    for r, kind in enumerate(kinds):
        hit = torch.rand(vocab, generator=g, device=device) < 3.0 / vocab  # ~3 positions (maybe none)
        if kind in BAD_KINDS:
            hit[vocab // 2] = True  # a faulty row always has its fault
        if kind in ("ties", "signed_zeros", "nan", "pos_inf"):
            x[r] = torch.randint(-2, 3, (vocab,), generator=g, device=device).float()  # long runs of ties
        if kind == "neg_inf":
            x[r, hit] = -INF
        elif kind == "mostly_neg_inf":
            x[r, ~hit] = -INF  # fewer finite entries than K: the top-K lists -inf entries, lower id first
        elif kind == "all_neg_inf":
            x[r] = -INF
        elif kind in ("huge", "tiny"):
            x[r] *= 1e37 if kind == "huge" else 1e-30
        elif kind == "signed_zeros":
            x[r] = torch.where(hit, 0.0, -0.0) - (x[r] < 0).float()  # the max is 0, as -0.0 and 0.0
        elif kind in ("nan", "pos_inf", "pos_inf_nan"):
            x[r, hit] = NAN if kind == "nan" else INF
            x[r, 0] = NAN if kind == "pos_inf_nan" else x[r, 0]
        elif kind == "all_nan":
            x[r] = NAN
    return x


def run(x: torch.Tensor, tokens: torch.Tensor, k: int, impl: str, extra: int = 2, **plan):
    """(logprobs, ids, ranks) of one implementation, into outputs wider than K+1."""
    n = x.shape[0]
    lp = torch.full((n, k + 1 + extra), 7.0, device=x.device)
    ids = torch.full((n, k + 1 + extra), -5, dtype=torch.int32, device=x.device)
    ranks = torch.full((n,), -5, dtype=torch.int32, device=x.device)
    if impl == "triton":
        logprobs_triton(x, tokens, k, lp, ids, ranks, **plan)
    else:
        compute_logprobs(x, tokens, k, lp, ids, ranks, impl=impl)
    return lp, ids, ranks


def close(got: torch.Tensor, want: torch.Tensor, atol: torch.Tensor) -> bool:
    """Per-row tolerance; equal infinities and NaN against NaN count as close."""
    got, want = got.double(), want.double()
    return bool(((got - want).abs() <= atol).logical_or(got == want).logical_or(got.isnan() & want.isnan()).all())


def check_against_torch(x: torch.Tensor, tokens: torch.Tensor, k: int, **plan) -> None:
    lp, ids, ranks = run(x, tokens, k, "triton", **plan)
    ref = x.float()
    want_lp, _, want_ranks = run(ref, tokens, k, "torch")
    exact = torch.log_softmax(ref.double(), dim=-1)  # [R, V]
    finite = torch.where(ref.isfinite(), ref.abs(), 0.0).amax(dim=-1, keepdim=True).double()  # [R, 1]
    atol = 1e-5 * (1.0 + finite)  # fp32 rounding of logit - logsumexp scales with the logits
    assert torch.equal(ranks, want_ranks)
    assert torch.equal(ids[:, 0].long(), tokens.long())
    assert close(lp[:, :1], want_lp[:, :1], atol)
    assert close(lp[:, :1], exact.gather(1, tokens.long()[:, None]), atol)
    if k > 0:
        order = torch.sort(ref, dim=-1, descending=True, stable=True).indices[:, :k]  # ties: lower id first
        got = ids[:, 1 : k + 1].long()
        assert torch.equal(got, order)
        assert torch.equal(ref.gather(1, got), ref.topk(k, dim=-1).values)  # values exactly torch's
        assert close(lp[:, 1 : k + 1], exact.gather(1, got), atol)
        assert close(lp[:, 1 : k + 1], want_lp[:, 1 : k + 1], atol)  # same values, so the torch path's logprobs
    assert bool((lp[:, k + 1 :] == 7.0).all()) and bool((ids[:, k + 1 :] == -5).all())  # untouched


@given(
    seed=st.integers(0, 2**31),
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=5),
    vocab=st.integers(1, 300),
    k=st.sampled_from([0, 1, 5, 20]),
    dtype=st.sampled_from([torch.float32, torch.float32, torch.bfloat16]),
    block=st.sampled_from([16, 32, 64, None]),
    num_chunks=st.sampled_from([None, 1, 2, 3, 5]),
    pad=st.sampled_from([0, 3]),
    token_dtype=st.sampled_from([torch.int64, torch.int32]),
)
def test_matches_torch_path(seed, kinds, vocab, k, dtype, block, num_chunks, pad, token_dtype):
    k = min(k, vocab)
    wide = make_logits(seed, kinds, vocab + pad).to(dtype)
    x = wide[:, :vocab]  # pad > 0: a row stride other than V
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, vocab, (len(kinds),), generator=g).to(token_dtype)
    check_against_torch(x, tokens, k, block=block, num_chunks=num_chunks)


@given(
    seed=st.integers(0, 2**31),
    kinds=st.lists(st.sampled_from(KINDS + ("rising", "falling", "one_group")), min_size=1, max_size=4),
    vocab=st.integers(1, 400),
    k=st.sampled_from([1, 5, 20, 32]),
    group=st.sampled_from([16, 32, 64]),
    group_tile=st.sampled_from([1, 2, 8]),
    num_chunks=st.sampled_from([1, 3]),
)
def test_group_rule_over_group_sizes_and_key_tiles(seed, kinds, vocab, k, group, group_tile, num_chunks):
    # Groups of 16..64 entries in blocks of 64 (1..4 groups per block), the K best group
    # keys kept over tiles of 1..8 keys. "rising" and "falling" put the top-K at one end
    # of the row, "one_group" puts it inside a single group.
    k = min(k, vocab)
    x = make_logits(seed, [kind if kind in KINDS else "randn" for kind in kinds], vocab)
    for r, kind in enumerate(kinds):
        ramp = torch.arange(vocab, dtype=torch.float32)
        if kind in ("rising", "falling"):
            x[r] = ramp if kind == "rising" else -ramp
        elif kind == "one_group":
            at = (seed % vocab) // group * group  # a group's start
            x[r, at : at + group] += 100.0
    tokens = torch.randint(0, vocab, (len(kinds),), generator=torch.Generator().manual_seed(seed))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels_module, "_GROUP", group)
        mp.setattr(kernels_module, "_GROUP_TILE", group_tile)
        check_against_torch(x, tokens, k, block=64, num_chunks=num_chunks)


def test_ties_at_the_kth_group_max_keep_the_lower_ids():
    # Groups of 16, K = 5. Row 0: group 0 holds the max (9) and four entries equal to the
    # K-th group max (3), which every later group also reaches; the top-K is id 0 then
    # ids 1..4, all in group 0, though groups 1..K-1 tie at 3. Row 1: every group's max is
    # 3 at its last entry and group 2 also holds 7: the top-K is 7, then the first four
    # groups' 3s. Row 2: only -inf after group 0's three finite entries.
    vocab, k = 160, 5
    x = torch.zeros(3, vocab)
    x[0, 0], x[0, 1:5], x[0, 16::16] = 9.0, 3.0, 3.0
    x[1, 15::16], x[1, 40] = 3.0, 7.0
    x[2, 3:] = -INF
    lp, ids, _ = run(x, torch.tensor([0, 1, 2]), k, "triton", block=16, num_chunks=3)
    assert ids[0, 1 : k + 1].tolist() == [0, 1, 2, 3, 4]
    assert ids[1, 1 : k + 1].tolist() == [40, 15, 31, 47, 63]
    assert ids[2, 1 : k + 1].tolist() == [0, 1, 2, 3, 4]
    check_against_torch(x, torch.tensor([0, 1, 2]), k, block=16, num_chunks=3)


def test_select_rereads_only_the_k_best_groups(monkeypatch):
    # Between the two kernels, every entry outside the K best groups becomes 1e30: if the
    # select stage read any of them (or skipped the group keys), the top-K would list it.
    # The lse and ranks come from the stream pass, so the outputs must be the original's.
    vocab, k, group = 400, 5, 16
    x = make_logits(3, ["randn", "ties", "neg_inf", "randn"], vocab)
    tokens = torch.tensor([0, 100, 200, 399])
    want = run(x.clone(), tokens, k, "triton", block=32, num_chunks=3)
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices  # [R, V]
    keep = torch.zeros_like(x, dtype=torch.bool)
    for r in range(x.shape[0]):  # the K best groups: by max, then lower group id (the stable sort)
        best = torch.sort(x[r].view(-1, group).amax(dim=1), descending=True, stable=True).indices[:k]
        keep[r].view(-1, group)[best] = True
        assert bool(keep[r, order[r, :k]].all())  # the module docstring's claim, in torch
    stream = kernels_module._stream_kernel

    class PoisonAfterStream:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                stream[grid](*args, **kwargs)
                args[0].masked_fill_(~keep, 1e30)
            return launch

    monkeypatch.setattr(kernels_module, "_GROUP", group)
    monkeypatch.setattr(kernels_module, "_stream_kernel", PoisonAfterStream())
    poisoned = x.clone()
    got = run(poisoned, tokens, k, "triton", block=32, num_chunks=3)
    assert bool((poisoned == 1e30).any())  # the poison was applied
    for a, b in zip(got[1:], want[1:], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(got[0][:, 1:], want[0][:, 1:])  # column 0 rereads the chosen logit (poisoned or not)


def test_ties_across_chunks_list_the_lower_id_first():
    # A row of one value everywhere: the top-K is ids 0..K-1 whatever chunk holds them,
    # and every token has rank 1. Another row: the max repeated at the end of each chunk.
    # A third: -0.0 and 0.0 alternate (equal values: ids in order, whatever the sign).
    vocab, k = 200, 20
    x = torch.zeros(3, vocab)
    x[1, 15::16] = 5.0
    x[2, ::2] = -0.0
    tokens = torch.tensor([150, 31, 4])
    for num_chunks in (1, 3, 7):
        lp, ids, ranks = run(x, tokens, k, "triton", block=16, num_chunks=num_chunks)
        assert ids[0, 1 : k + 1].tolist() == list(range(k)) == ids[2, 1 : k + 1].tolist()
        assert ids[1, 1 : 1 + 12].tolist() == list(range(15, vocab, 16))
        assert ids[1, 13 : k + 1].tolist() == list(range(k - 12))
        assert ranks.tolist() == [1, 1, 1]
        torch.testing.assert_close(lp[0, : k + 1], torch.full((k + 1,), -torch.log(torch.tensor(200.0)).item()))


@given(
    seed=st.integers(0, 2**31),
    bad=st.lists(st.sampled_from(BAD_KINDS), min_size=1, max_size=3),
    where=st.integers(0, 4),
    k=st.sampled_from([0, 1, 5, 20]),
)
def test_non_finite_rows_leave_the_other_rows_unchanged(seed, bad, where, k):
    vocab, num_chunks = 120, 3  # chunks fixed: the other rows' rounding does not depend on R
    good = make_logits(seed, ["randn", "ties", "neg_inf", "randn"], vocab)
    bad_rows = make_logits(seed + 1, bad, vocab)
    x = torch.cat([good[:where], bad_rows, good[where:]])
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (x.shape[0],), generator=g)
    is_bad = torch.zeros(x.shape[0], dtype=torch.bool)
    is_bad[where : where + len(bad)] = True
    alone = run(good, tokens[~is_bad], k, "triton", block=16, num_chunks=num_chunks)
    mixed = run(x, tokens, k, "triton", block=16, num_chunks=num_chunks)
    for got, want in zip(mixed, alone, strict=True):
        assert torch.equal(got[~is_bad], want)  # bit for bit
    lp, ids, ranks = (t[is_bad] for t in mixed)
    want_lp, _, want_ranks = run(x[is_bad], tokens[is_bad], k, "torch")
    assert torch.equal(ranks, want_ranks)  # NaN never counts: the torch path's rank
    assert bool(((ids[:, : k + 1] >= 0) & (ids[:, : k + 1] < vocab)).all())
    # The torch path's logprobs, NaN for NaN and -inf for -inf: with a NaN all are NaN; with
    # +inf (first in both top-Ks) NaN for the +inf entries, then -inf.
    assert close(lp[:, : k + 1], want_lp[:, : k + 1], torch.zeros(1))
    assert not bool(lp[:, : k + 1].isfinite().any())  # NaN, or -inf next to +inf
    for row, kind in zip(lp, bad, strict=True):
        if "nan" in kind:
            assert bool(row[: k + 1].isnan().all())


def test_nan_entries_never_enter_the_top_k():
    x = torch.tensor([[1.0, NAN, 3.0, NAN, 2.0, -INF], [NAN] * 6])
    lp, ids, ranks = run(x, torch.tensor([1, 5]), 5, "triton", block=16)
    assert ids[0, 1:6].tolist() == [2, 4, 0, 1, 3]  # NaN counts as -inf: lower id first
    assert ids[1, 1:6].tolist() == [0, 1, 2, 3, 4]
    assert ranks.tolist() == [1, 1]
    assert bool(lp[:, :6].isnan().all())


def test_plan_caps_the_chunks_and_covers_the_row():
    plan = logprobs_plan(1, 151936, 132)
    assert plan.num_chunks <= 64 and plan.num_chunks * plan.chunk >= 151936 > (plan.num_chunks - 1) * plan.chunk
    assert logprobs_plan(256, 151936, 132).num_chunks == 3  # R x C reaches 4 programs per SM
    assert logprobs_plan(1, 10**6, 132, block=16, num_chunks=1000).num_chunks == 64


def test_empty_batch_and_bad_arguments():
    x = torch.randn(3, 10)
    tokens = torch.tensor([1, 2, 3])
    run(x[:0], tokens[:0], 5, "triton")  # nothing to do, no error
    with pytest.raises(ValueError, match="num_logprobs=11 exceeds the vocabulary size 10"):
        run(x, tokens, 11, "triton")
    with pytest.raises(ValueError, match=f"0 <= K <= {MAX_TOPK}"):
        run(torch.randn(3, 100), tokens, MAX_TOPK + 1, "triton")
    with pytest.raises(ValueError, match="unit stride"):
        run(x.t().contiguous().t(), tokens, 2, "triton")
    with pytest.raises(ValueError, match=r"token_ids has shape \(2,\)"):
        run(x, tokens[:2], 2, "triton")
    with pytest.raises(ValueError, match=r"out_logprobs has shape \(3, 2\), expected \[3, >= 3\]"):
        logprobs_triton(x, tokens, 2, torch.empty(3, 2), torch.empty(3, 3, dtype=torch.int32),
                        torch.empty(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="impl='fast'"):
        run(x, tokens, 2, "fast")


def test_auto_is_the_torch_path_off_cuda(monkeypatch):
    def spy(*args, **kwargs):
        raise AssertionError("the Triton path ran on CPU tensors under impl='auto'")

    monkeypatch.setattr(logprobs_module, "logprobs_triton", spy)
    run(torch.randn(2, 30), torch.tensor([0, 29]), 5, "auto")


def test_timing_helper_runs_both_paths():
    for impl in ("torch", "triton"):
        assert time_logprobs(2, 50, 5, impl=impl, iters=1, device="cpu") > 0


@pytest.mark.gpu
def test_gpu_matches_torch_at_scale_and_replays_in_a_cuda_graph():
    rows, vocab, k = 256, 151936, 20
    kinds = [KINDS[r % len(KINDS)] if r % 3 == 0 else "randn" for r in range(rows)]
    x = make_logits(0, kinds, vocab, device="cuda")
    x[1::7, 1000:] = x[1::7, :1].clone()  # long runs tied with an early value, across chunks
    x[2::11] = torch.arange(vocab, dtype=torch.float32, device="cuda")  # rising: the top-K in the last groups
    x[5::11, 70000:70128] += 50.0  # the top-K inside one group of 128 in the middle of the row
    tokens = torch.randint(0, vocab, (rows,), device="cuda")
    assert logprobs_module.use_triton(x)
    for n in (1, 7, 64, rows):
        for kk in (0, 1, 5, k):
            check_against_torch(x[:n], tokens[:n], kk)
    check_against_torch(x.bfloat16(), tokens, k)

    lp = torch.empty(rows, k + 1, device="cuda")
    ids = torch.empty(rows, k + 1, dtype=torch.int32, device="cuda")
    ranks = torch.empty(rows, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile before capture
        compute_logprobs(x, tokens, k, lp, ids, ranks)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compute_logprobs(x, tokens, k, lp, ids, ranks)
    for seed in (1, 2):
        x.copy_(make_logits(seed, kinds[::-1], vocab, device="cuda"))
        tokens.copy_(torch.randint(0, vocab, (rows,), device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        want_lp, want_ids, want_ranks = run(x, tokens, k, "triton", extra=0)
        assert torch.equal(ranks, want_ranks) and torch.equal(ids, want_ids), seed
        torch.testing.assert_close(lp, want_lp, rtol=0, atol=0, equal_nan=True)
        _, _, torch_ranks = run(x, tokens, k, "torch", extra=0)
        assert torch.equal(ranks, torch_ranks), seed
