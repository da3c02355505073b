"""Tier -1 of pivot_select (pivot_reject.py): the unfiltered Gumbel-max draw, served when proven kept.

Tier -1 runs after tier 0 (the guess), for the rows the guess turns down only. Every test runs
pivot_sample_triton with the tier on and off: the tokens must be equal (the existing tiers are
the reference), rows the tier does not accept must keep the tier and the threshold the other
path gives them (so rows the guess serves stay tier 0), and every accepted row's token must lie
in the kept set of the independent sort reference of tests/sample/test_sample_select.py. Boundary tests
place top-k, top-p and min-p exactly at the draw (with a small candidate capacity, so that the
guess turns those rows down), so a check that accepts one token too many (or too few) fails.
On CPU the kernels run under TRITON_INTERPRET=1.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.kernels import HAS_TRITON
from graphrunner.sample import pivot_select, rng
from graphrunner.sample.pivot_refine import TIER_FALLBACK, TIER_GUESS, TIER_PIVOTS, TIER_REFINE
from graphrunner.sample.pivot_reject import TIER_REJECT
from graphrunner.sample.pivot_select import pivot_sample_triton
from graphrunner.sample.triton_sampling import gumbel_argmax_torch
from tests.cuda_graphs import capture_cuda_graph
from tests.sample.test_sample_select import sort_reference

pytestmark = [
    pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]

NEG_INF = float("-inf")
ALL = (True, True, True)


def _sample(x, temperature, keys, top_k, top_p, min_p, flags=ALL, reject=True, **kw):
    rows = x.shape[0]
    out = torch.full((rows,), -1, dtype=torch.int64, device=x.device)
    thr = torch.full((rows,), -7.0, device=x.device)
    tiers = pivot_sample_triton(x, temperature, keys, top_k, top_p, min_p, *flags, out, thr, reject=reject, **kw)
    return out, thr, tiers


def _on_and_off(x, temperature, keys, top_k, top_p, min_p, flags=ALL, **kw):
    """Both paths; asserts what tier -1 must not change. -> (tokens, tiers with the tier on)."""
    on = _sample(x, temperature, keys, top_k, top_p, min_p, flags, True, **kw)
    _same_but_tier_minus_one(on, _sample(x, temperature, keys, top_k, top_p, min_p, flags, False, **kw), temperature)
    return on[0], on[2]


def _same_but_tier_minus_one(on, off, temperature):
    """(tokens, thresholds, tiers) with tier -1 on and off: equal tokens; equal tiers and thresholds but
    for the rows tier -1 serves (NaN threshold), which are never greedy."""
    (tokens, thr, tiers), (want, want_thr, want_tiers) = on, off
    assert torch.equal(tokens, want), (tiers, want_tiers)
    served = tiers == TIER_REJECT
    assert torch.equal(tiers[~served], want_tiers[~served])
    a, b = thr[~served], want_thr[~served]
    assert bool(((a == b) | (a.isnan() & b.isnan())).all())  # (a non-finite row's threshold may be NaN)
    assert bool(thr[served].isnan().all())  # not computed
    assert not bool(served[temperature == 0.0].any())  # greedy rows keep torch.argmax's path


def _kept_by_reference(x, temperature, top_k, top_p, min_p, flags, tokens, tiers):
    """Each accepted row's token is kept by the sort reference (where its top-p is unambiguous)."""
    want, clear = sort_reference(x.float(), temperature, top_k, top_p, min_p, flags)
    for r in torch.nonzero(tiers == TIER_REJECT).flatten().tolist():
        if clear[r]:
            assert bool(want[r, int(tokens[r])]), r


def _draw(x, temperature, keys):
    """i* by torch: the unfiltered Gumbel max of x / T (rng.py's noise), and s = x / T."""
    s = x.float() / temperature[:, None]
    return (s + rng.gumbel(keys, x.shape[1])).argmax(-1), s


@st.composite
def batches(draw):
    """Flat and peaked rows, ties, -inf and NaN entries, every filter edge, bf16 / fp32, strided rows."""
    rows = draw(st.integers(1, 4))
    vocab = draw(st.sampled_from([64, 300, 1000]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn(rows, vocab, generator=g) * draw(st.sampled_from([0.05, 0.5, 3.0]))
    if draw(st.booleans()):  # peaked: a few boosted tokens
        x[:, torch.randperm(vocab, generator=g)[:3]] += torch.tensor([9.0, 8.0, 6.0])
    if draw(st.booleans()):
        x = torch.round(x * 4) / 4  # ties
    if draw(st.booleans()):
        x[torch.rand(rows, vocab, generator=g) < 0.2] = NEG_INF
        x[:, 0] = 0.0
    if draw(st.booleans()):  # a row with NaN entries (never accepted), or all NaN
        x[draw(st.integers(0, rows - 1)), torch.randint(0, vocab, (draw(st.sampled_from([1, vocab])),),
                                                         generator=g)] = math.nan
    if draw(st.booleans()):
        x = x.bfloat16()
    if draw(st.booleans()):  # a row stride wider than V
        x = torch.cat([x, torch.zeros(rows, 5, dtype=x.dtype)], 1)[:, :vocab]
    temperature = torch.tensor([draw(st.sampled_from([0.0, 0.5, 0.8, 1.0, 2.0])) for _ in range(rows)])
    top_k = torch.tensor([draw(st.sampled_from([0, 1, 5, vocab // 2, vocab - 1, vocab, vocab + 3]))
                          for _ in range(rows)], dtype=torch.int32)
    top_p = torch.tensor([draw(st.sampled_from([1.0, 0.99, 0.95, 0.9, 0.5, 1e-6])) for _ in range(rows)])
    min_p = torch.tensor([draw(st.sampled_from([0.0, 0.0, 0.01, 0.1, 1.0])) for _ in range(rows)])
    keys = rng.row_keys(torch.randint(0, 2**62, (rows,), generator=g), torch.arange(rows))
    flags = draw(st.tuples(st.booleans(), st.booleans(), st.booleans()))
    return x, temperature, keys, top_k, top_p, min_p, flags


@given(batch=batches(), capacity=st.sampled_from([64, 1024]), splits=st.sampled_from([None, 1, 3]))
@settings(deadline=None)
def test_tokens_equal_the_existing_tiers_and_accepted_rows_are_kept(batch, capacity, splits):
    x, temperature, keys, top_k, top_p, min_p, flags = batch
    tokens, tiers = _on_and_off(x, temperature, keys, top_k, top_p, min_p, flags, capacity=capacity, splits=splits,
                                block=64)
    nan_rows = x.float().isnan().any(1)
    assert not bool((tiers == TIER_REJECT)[nan_rows].any())  # NaN rows go to the exact tiers
    _kept_by_reference(x, temperature, top_k, top_p, min_p, flags, tokens, tiers)


def _flat(rows, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=g) * 0.5).bfloat16().float()  # [R, V] random-weight-like
    return x, torch.full((rows,), 0.8), rng.row_keys(torch.arange(rows) + seed, torch.arange(rows))


@pytest.mark.parametrize(("top_p", "min_p", "flags", "tier"), [(0.95, 0.0, (False, True, False), TIER_REJECT),
                                                               (0.9, 0.05, ALL, TIER_REJECT),
                                                               (1.0, 0.02, (False, False, True), TIER_REJECT),
                                                               (1.0, 0.0, (False, False, False), TIER_GUESS)])
def test_flat_rows_are_served_by_their_draw(top_p, min_p, flags, tier):
    # Flat rows: the top-p mass over most of the vocabulary (tiers 1-2 at capacity 64). Tier -1
    # must serve most of them (~top_p of the draws are kept): the test fails if the tier is bypassed.
    # Without a filter the guess draws over all tokens itself: every row is tier 0's, never tier -1's.
    rows, vocab = 8, 2000
    x, temperature, keys = _flat(rows, vocab, 3)
    args = (torch.zeros(rows, dtype=torch.int32), torch.full((rows,), top_p), torch.full((rows,), min_p))
    tokens, tiers = _on_and_off(x, temperature, keys, *args, flags, capacity=64)
    assert int((tiers == tier).sum()) >= (rows if tier == TIER_GUESS else rows // 2), tiers
    _kept_by_reference(x, temperature, *args, flags, tokens, tiers)


def test_top_k_at_the_draw():
    # k = the number of tokens above s*: s* is the (k+1)-th value, dropped; k + 1 keeps it.
    rows, vocab = 4, 300
    x, temperature, keys = _flat(rows, vocab, 5)
    star, s = _draw(x, temperature, keys)
    above = (s > s.gather(1, star[:, None])).sum(1).to(torch.int32)  # [R]
    assert above.tolist() == [56, 39, 109, 2]
    off = (torch.ones(rows), torch.zeros(rows))
    # 64-token blocks: 64 buckets of ~5 tokens, so the plan's bucket bound is loose and pass B counts;
    # 16 candidates: the guess turns down k >= 16 (rows 0-2); row 3 (k <= 3) is the guess's, never tier -1's.
    kw = dict(block=64, splits=1, capacity=16)
    _, tiers = _on_and_off(x, temperature, keys, above, *off, (True, False, False), **kw)
    assert (tiers != TIER_REJECT).all(), tiers
    tokens, tiers = _on_and_off(x, temperature, keys, above + 1, *off, (True, False, False), **kw)
    assert tiers.tolist() == [TIER_REJECT] * 3 + [TIER_GUESS] and torch.equal(tokens, star), tiers


def _prefix_mass(x, temperature, keys):
    """i*, and the float64 mass share of the tokens strictly above s* (what top-p compares)."""
    star, s = _draw(x, temperature, keys)
    e = torch.exp((s - s.amax(1, keepdim=True)).double())
    above = torch.where(s > s.gather(1, star[:, None]), e, 0.0).sum(1) / e.sum(1)
    return star, above


def test_top_p_at_the_draw():
    # top_p just above the mass above s*: kept (accepted); just below: dropped (not accepted);
    # within the rounding margin (2**-12): deferred to the exact tiers, the same token either way.
    rows, vocab = 4, 500
    x, temperature, keys = _flat(rows, vocab, 9)
    star, above = _prefix_mass(x, temperature, keys)
    assert bool((above > 0.05).all() and (above < 0.95).all())
    off_k, off_min_p = torch.zeros(rows, dtype=torch.int32), torch.zeros(rows)
    only_p = (False, True, False)
    for scale, accepted in ((1.01, True), (0.99, False), (1.00002, False)):
        top_p = (above * scale).float()
        tokens, tiers = _on_and_off(x, temperature, keys, off_k, top_p, off_min_p, only_p, capacity=64)
        assert bool(((tiers == TIER_REJECT) == accepted).all()), (scale, tiers)
        if accepted:
            assert torch.equal(tokens, star)


def test_a_draw_at_the_row_max_is_kept_by_any_top_p_and_min_p_one():
    # No mass lies above a draw tied with the row max: even top_p 0.01 (or min_p 1: no count) keeps it.
    # Rows of 300 equal values (all kept, by the tie rule) overflow the guess's 16 candidates, so tier -1
    # serves them; a peaked row (its top token at 30) is proven by the guess: tier -1 never sees it.
    g = torch.Generator().manual_seed(2)
    x = torch.zeros(4, 300)
    x[3] = torch.randn(300, generator=g)
    x[3, 17] = 30.0
    temperature, keys = torch.ones(4), rng.row_keys(torch.arange(4), torch.arange(4))
    args = (torch.zeros(4, dtype=torch.int32), torch.tensor([0.01, 0.5, 1.0, 0.01]), torch.tensor([0.0, 1.0, 1.0, 0.0]))
    tokens, tiers = _on_and_off(x, temperature, keys, *args, (False, True, True), capacity=16)
    assert tiers.tolist() == [TIER_REJECT] * 3 + [TIER_GUESS] and torch.equal(tokens, _draw(x, temperature, keys)[0])
    assert int(tokens[3]) == 17


def test_min_p_at_the_draw():
    # min_p at exp(s* - M) keeps s* up to float32 rounding of the threshold.
    rows, vocab = 4, 300
    x, temperature, keys = _flat(rows, vocab, 11)
    star, s = _draw(x, temperature, keys)
    ratio = torch.exp(s.gather(1, star[:, None]).squeeze(1) - s.amax(1))  # [R]
    assert bool((ratio < 0.99).all())  # no draw is the max (min_p 1.001 x ratio must drop it)
    off = (torch.zeros(rows, dtype=torch.int32), torch.ones(rows))
    for min_p, accepted in ((ratio * 0.999, True), (torch.clamp(ratio * 1.001, max=1.0), False)):
        # 16 candidates: the guess turns down every row (> 100 tokens above min-p's threshold).
        tokens, tiers = _on_and_off(x, temperature, keys, *off, min_p, (False, False, True), capacity=16)
        assert bool(((tiers == TIER_REJECT) == accepted).all()), tiers


def test_non_finite_rows_are_never_accepted():
    # A row of only -inf, a +inf entry, NaN entries: the exact tiers (and the fallback) serve them.
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 64, generator=g)
    x[0] = NEG_INF
    x[1, 5] = math.inf
    x[2, [3, 9]] = math.nan
    args = (torch.full((4,), 0.8), rng.row_keys(torch.arange(4), torch.arange(4)), torch.zeros(4, dtype=torch.int32),
            torch.full((4,), 0.9), torch.zeros(4))
    _, tiers = _on_and_off(x, *args, block=64)
    assert TIER_REJECT not in tiers[:3].tolist()


_POISON = {torch.float32: math.nan, torch.int32: 2**30 + 7}  # never written by a kernel (ids are < V)


@pytest.fixture
def poisoned(monkeypatch):
    """pivot_select's scratch filled with garbage (flags with -1, tier -1's own), as a CUDA graph's reused
    pool may hold: a kernel reading a buffer no kernel wrote for that row changes a tier or a token.
    -> the buffers of the last call."""
    real, seen = pivot_select._scratch, {}

    def scratch(*args):
        bufs = real(*args)
        for name, buf in bufs.items():
            buf.fill_(TIER_REJECT if name == "flags" else _POISON[buf.dtype])
        seen.clear()
        seen.update(bufs)
        return bufs

    monkeypatch.setattr(pivot_select, "_scratch", scratch)
    return seen


def _mixed_rows():
    """Seven rows of 300, top-k only, for capacity 16: the guess (a peaked row, k = 3), tier -1 (k = the
    draw's rank), the pivots and the refinement (k one less: the draw is out), a greedy row, a row with
    NaN entries (its draw would be kept: the gate refuses it) and a +inf entry (the fallback)."""
    rows, vocab = 7, 300
    x, temperature, keys = _flat(rows, vocab, 21)
    g = torch.Generator().manual_seed(21)
    x[0, torch.randperm(vocab, generator=g)[:3]] += torch.tensor([12.0, 11.0, 10.0])
    temperature[4] = 0.0
    star, s = _draw(x, torch.where(temperature == 0.0, 1.0, temperature), keys)
    above = (s > s.gather(1, star[:, None])).sum(1).to(torch.int32)  # [R]: the draw's rank - 1
    top_k = above + torch.tensor([3, 1, 0, 0, 1, 1, 1], dtype=torch.int32)
    x[5, [7, 99]] = math.nan
    x[6, 40] = math.inf
    return x, temperature, keys, top_k, torch.ones(rows), torch.zeros(rows), (True, False, False)


def test_each_tier_serves_its_rows_after_the_guess_with_garbage_scratch(poisoned):
    # No memset: tier 0's select writes every row's flag, the plan every row's candidate count. Tier -1's
    # passes run for rows flagged 1 and sampled only: the guess's rows and greedy rows keep their poison.
    batch = _mixed_rows()
    x, temperature, keys, top_k, top_p, min_p, flags = batch
    off = _sample(*batch, reject=False, block=64, capacity=16)
    tokens, thr, tiers = _sample(*batch, reject=True, block=64, capacity=16)  # last: `poisoned` holds its buffers
    _same_but_tier_minus_one((tokens, thr, tiers), off, temperature)
    assert tiers.tolist() == [TIER_GUESS, TIER_REJECT, TIER_PIVOTS, TIER_REFINE, TIER_REFINE, TIER_REFINE,
                              TIER_FALLBACK]
    assert int(tokens[5]) == int(_draw(x.nan_to_num(-math.inf), temperature, keys)[0][5])  # the refused draw
    _kept_by_reference(x, temperature, top_k, top_p, min_p, flags, tokens, tiers)
    ref = torch.empty_like(tokens)
    gumbel_argmax_torch(x, temperature, keys, thr.nan_to_num(0.0), ref)  # the thresholds' draws (tiers 0-2)
    assert torch.equal(tokens[[0, 2, 3, 4]], ref[[0, 2, 3, 4]])
    untouched = {"draw": [0, 4], "draw_idx": [0, 4], "reject_cnt": [0, 4, 5, 6], "reject_mass": [0, 4, 5, 6]}
    for name, rows in untouched.items():
        buf = poisoned[name][rows].float()
        assert bool(buf.isnan().all() if poisoned[name].dtype == torch.float32 else (buf == 2**30 + 7).all()), name


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@given(batch=batches())
@settings(deadline=None)
def test_gpu_tokens_equal_the_existing_tiers(batch):
    x, temperature, keys, top_k, top_p, min_p, flags = (t.cuda() if isinstance(t, torch.Tensor) else t
                                                        for t in batch)
    tokens, tiers = _on_and_off(x, temperature, keys, top_k, top_p, min_p, flags)
    _kept_by_reference(x.cpu(), temperature.cpu(), top_k.cpu(), top_p.cpu(), min_p.cpu(), flags, tokens.cpu(),
                       tiers.cpu())


@pytest.mark.gpu
def test_gpu_flat_full_vocab_rows_take_tier_minus_one_and_replay_deterministically():
    # Flat rows at scale: 256 flat rows x 151,936 at T 0.8, top-p 0.95; then the same call in a CUDA graph.
    rows, vocab = 256, 151936
    g = torch.Generator().manual_seed(16)
    x = (torch.randn(rows, vocab, generator=g) * 0.5).bfloat16().float().cuda()
    temperature, keys = torch.full((rows,), 0.8, device="cuda"), rng.row_keys(torch.arange(rows), torch.arange(rows))
    args = (keys.cuda(), torch.zeros(rows, dtype=torch.int32, device="cuda"), torch.full((rows,), 0.95, device="cuda"),
            torch.zeros(rows, device="cuda"))
    tokens, tiers = _on_and_off(x, temperature, *args, (False, True, False))
    assert int((tiers == TIER_REJECT).sum()) >= rows * 0.8
    out, thr = torch.empty(rows, dtype=torch.int64, device="cuda"), torch.empty(rows, device="cuda")
    graph = capture_cuda_graph(
        lambda: pivot_sample_triton(x, temperature, *args, False, True, False, out, thr, reject=True))
    for _ in range(3):
        graph.replay()
        assert torch.equal(out, tokens)


def _gpu_mixed_rows(rows=128, vocab=151936):
    """Peaked rows (randn x 3, the bench's: the guess) and flat ones (bf16 randn x 0.5: tier -1 or the
    refinement) alternating, a greedy row in eight, top-p 0.95, top-k 50 on a peaked row in two, min-p 0.05
    on a row in five, on the GPU."""
    g = torch.Generator().manual_seed(17)
    x = torch.randn(rows, vocab, generator=g) * 3.0  # [R, V]
    x[1::2] = (torch.randn(rows // 2, vocab, generator=g) * 0.5).bfloat16().float()
    i = torch.arange(rows)
    temperature = torch.where(i % 8 == 0, 0.0, 0.8)
    top_k = torch.where(i % 4 == 2, 50, 0).to(torch.int32)
    min_p = torch.where(i % 5 == 0, 0.05, 0.0)
    return tuple(t.cuda() for t in (x, temperature, rng.row_keys(i, i), top_k, torch.full((rows,), 0.95), min_p))


@pytest.mark.gpu
def test_gpu_guess_rows_never_run_tier_minus_one_and_flat_rows_take_it(poisoned):
    # Full vocabulary, garbage scratch: the tokens of the tiers without tier -1; tier -1's scratch of
    # every row the guess serves is never written; most flat rows are served by their draw.
    batch = _gpu_mixed_rows()
    off = _sample(*batch, ALL, False)
    tokens, thr, tiers = _sample(*batch, ALL, True)
    _same_but_tier_minus_one((tokens, thr, tiers), off, batch[1])
    guess = tiers == TIER_GUESS
    assert int(guess[0::2].sum()) >= 32, tiers  # most peaked rows are the guess's
    for name in ("draw", "draw_idx", "reject_cnt", "reject_mass"):
        buf = poisoned[name][guess].float()
        assert bool(buf.isnan().all() if poisoned[name].dtype == torch.float32 else (buf == 2**30 + 7).all()), name
    flat = tiers[1::2]  # every flat row is sampled (greedy rows are even)
    assert int((flat == TIER_REJECT).sum()) >= 0.8 * flat.numel(), flat


@pytest.mark.gpu
def test_gpu_graph_replays_on_new_logits_give_the_eager_tokens():
    # No memset in the graph: a replay on other logits (rows rolled: peaked <-> flat) finds the last
    # replay's flags, counts and draws in its scratch, and must still give the eager call's tokens.
    x, *rest = _gpu_mixed_rows(rows=64)
    static_x = x.clone()
    out, thr = torch.empty(64, dtype=torch.int64, device="cuda"), torch.empty(64, device="cuda")
    graph = capture_cuda_graph(lambda: pivot_sample_triton(static_x, *rest, *ALL, out, thr, reject=True))
    for shift in (0, 1, 0, 3):
        static_x.copy_(x.roll(shift, 0))
        graph.replay()
        want, want_thr, _ = _sample(x.roll(shift, 0), *rest, ALL, True)
        assert torch.equal(out, want), shift
        assert torch.equal(thr.isnan(), want_thr.isnan()) and torch.equal(thr.nan_to_num(), want_thr.nan_to_num())
