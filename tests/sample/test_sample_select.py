"""pivot_select (the sort-free sampler kernels) against an independent sort reference.

The reference sorts each row and applies min-p, then top-k, then top-p with the one tie
rule the kernels share: every token tied with the last kept value is kept (so the
kept set is always `s >= threshold`). Top-p masses are float64 there and float32 /
fixed point in the kernels, so an example whose top_p lies within 1e-5 of a prefix
mass is rejected (`assume`): there the boundary is a matter of rounding.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py), with a
small candidate capacity so that every tier runs: the guess, the pivots, their refinement
(flat rows whose windows overflow the capacity) and the exact fallback.
"""

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from graphrunner.kernels import HAS_TRITON
from graphrunner.sample import rng
from graphrunner.sample.pivot_refine import TIER_FALLBACK, TIER_GUESS, TIER_PIVOTS, TIER_REFINE
from graphrunner.sample.pivot_select import pivot_sample_triton
from graphrunner.sample.triton_sampling import gumbel_argmax_torch, gumbel_argmax_triton, sampling_threshold_triton

pytestmark = [
    pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]

NEG_INF = float("-inf")
TOP_P_MARGIN = 1e-5


def sort_reference(x, temperature, top_k, top_p, min_p, flags=(True, True, True)):
    """Kept mask [R, V] by sorting (float64 masses) and whether top-p is unambiguous per row.

    x / T as the sampler scales it (T = 0 counts as 1); min-p: s >= max(s) + log(min_p);
    top-k: s >= the k-th largest (k <= 0 or >= V: off); top-p: s >= the value at which
    the descending prefix mass first reaches top_p (top_p >= 1: off).
    """
    use_top_k, use_top_p, use_min_p = flags
    s = x.float() / torch.where(temperature == 0.0, 1.0, temperature)[:, None]
    rows, vocab = s.shape
    kept = torch.ones_like(s, dtype=torch.bool)
    clear = []
    for r in range(rows):
        row = s[r]
        keep = torch.ones(vocab, dtype=torch.bool)
        if use_min_p and min_p[r] > 0:
            keep &= row >= row.max() + torch.log(min_p[r])
        if use_top_k and 0 < int(top_k[r]) < vocab:
            masked = torch.where(keep, row, NEG_INF)
            keep &= row >= masked.sort(descending=True).values[int(top_k[r]) - 1]
        ok = True
        if use_top_p and top_p[r] < 1.0:
            masked = torch.where(keep, row, NEG_INF).double()
            values = masked.sort(descending=True).values
            probs = torch.softmax(values, 0)
            mass = probs.cumsum(0)
            # Prefix masses at the end of each run of equal values: where a boundary can fall.
            ends = torch.cat([values[1:] != values[:-1], torch.tensor([True])])
            ok = bool(((mass[ends] - float(top_p[r])).abs() > TOP_P_MARGIN).all())
            reached = torch.nonzero(mass >= float(top_p[r])).flatten()
            keep &= row >= values[int(reached[0]) if len(reached) else 0].float()
        kept[r] = keep
        clear.append(ok)
    return kept, clear


def _run(x, temperature, keys, top_k, top_p, min_p, flags=(True, True, True), reject=False, **kw):
    # Tiers 0-3 and their thresholds (tier -1 serves rows without one: tests/sample/test_sample_reject.py).
    rows = x.shape[0]
    out = torch.full((rows,), -1, dtype=torch.int64, device=x.device)
    thr = torch.empty(rows, device=x.device)
    path = pivot_sample_triton(x, temperature, keys, top_k, top_p, min_p, *flags, out, thr, reject=reject, **kw)
    return out, thr, path


@st.composite
def batches(draw, max_rows=4, vocabs=(8, 64, 300)):
    """Logits with ties and -inf, temperatures from tiny to huge, every filter edge value."""
    rows = draw(st.integers(1, max_rows))
    vocab = draw(st.sampled_from(vocabs))
    seed = draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * draw(st.sampled_from([0.01, 1.0, 4.0, 40.0]))
    if draw(st.booleans()):
        x = torch.round(x)  # many exact ties
    if draw(st.booleans()):
        x[torch.rand(rows, vocab, generator=g) < draw(st.sampled_from([0.1, 0.5, 0.9]))] = NEG_INF
        x[:, draw(st.integers(0, vocab - 1))] = 0.0  # every row keeps a finite logit
    temperature = torch.tensor([draw(st.sampled_from([0.0, 1e-3, 0.1, 0.7, 1.0, 2.5, 1e4])) for _ in range(rows)])
    top_k = torch.tensor([draw(st.sampled_from([0, 1, 2, 5, vocab // 2, vocab - 1, vocab, vocab + 3]))
                          for _ in range(rows)], dtype=torch.int32)
    top_p = torch.tensor([draw(st.sampled_from([1.0, 0.999, 0.9, 0.5, 0.1, 1e-6])) for _ in range(rows)])
    min_p = torch.tensor([draw(st.sampled_from([0.0, 0.0, 1e-4, 0.05, 0.5, 1.0])) for _ in range(rows)])
    keys = rng.row_keys(torch.randint(0, 2**62, (rows,), generator=g), torch.arange(rows))
    flags = draw(st.tuples(st.booleans(), st.booleans(), st.booleans()))
    return x, temperature, keys, top_k, top_p, min_p, flags


def _check_against_reference(batch, **kw):
    x, temperature, keys, top_k, top_p, min_p, flags = batch
    want, clear = sort_reference(x, temperature, top_k, top_p, min_p, flags)
    assume(all(clear))
    tokens, thr, _ = _run(x, temperature, keys, top_k, top_p, min_p, flags, **kw)
    s = x.float() / torch.where(temperature == 0.0, 1.0, temperature)[:, None]
    got = s >= thr[:, None]
    assert torch.equal(got, want), (thr, flags)
    # The token is the Gumbel-max draw over exactly that kept set (rng.py's noise); greedy
    # rows (T = 0) take torch.argmax(x), unfiltered.
    ref_tokens = torch.empty_like(tokens)
    gumbel_argmax_torch(x, temperature, keys, thr, ref_tokens)
    assert torch.equal(tokens, ref_tokens)


@given(batch=batches(), capacity=st.sampled_from([16, 64, 1024]), block=st.sampled_from([None, 64]),
       splits=st.sampled_from([None, 1, 3]), segment=st.sampled_from([None, 1, 2]))
@settings(deadline=None)
def test_kept_set_equals_the_sort_reference(batch, capacity, block, splits, segment):
    # segment 1-2 at block 64: min-p rows take the one-pass stats (their candidates in the first read)
    _check_against_reference(batch, capacity=capacity, block=block, splits=splits, segment=segment)


@pytest.mark.parametrize("ascending", [False, True])
def test_one_pass_rows_are_served_by_the_guess_tier_exactly(ascending):
    # Min-p rows over 32 tiles of 64 with a bound update every 2 tiles: tier 0 serves them from the
    # stats pass's candidates, with the sort reference's kept set and the same tokens and thresholds
    # as the two-pass guess (segment 64: no one-pass). Ascending logits (adversarial: every token is
    # above the segments before it, so all are candidates) overflow tier 0: the tiers below stay exact.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 2048, generator=g) * 3.0
    if ascending:
        x = x.sort(dim=-1).values + torch.linspace(0, 2, 2048)
    temperature = torch.tensor([0.8, 1.0, 0.5, 0.0])
    keys = rng.row_keys(torch.arange(4), torch.arange(4))
    top_k = torch.tensor([50, 0, 5, 50], dtype=torch.int32)
    top_p = torch.tensor([0.9, 0.95, 1.0, 0.9])
    min_p = torch.tensor([0.05, 0.1, 0.02, 0.05])
    want, clear = sort_reference(x, temperature, top_k, top_p, min_p)
    assert all(clear)
    one = _run(x, temperature, keys, top_k, top_p, min_p, block=64, splits=1, segment=2)
    two = _run(x, temperature, keys, top_k, top_p, min_p, block=64, splits=1, segment=64)
    assert one[2][:3].tolist() == [TIER_PIVOTS if ascending else TIER_GUESS] * 3
    s = x / torch.where(temperature == 0.0, 1.0, temperature)[:, None]
    assert torch.equal(s[:3] >= one[1][:3, None], want[:3])
    assert torch.equal(one[0], two[0]) and torch.equal(one[1][:3], two[1][:3])


def test_each_tier_serves_its_rows():
    # 300 tokens in at most 3 x 64 buckets, k = 200: no bucket bound, so the pivot tier serves
    # row 0, or its refinement once its window overflows a capacity of 16; k = 3: the guess.
    # Integer logits (ties of ~50 tokens, no window closes) and k = 150 at capacity 16: the fallback.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 300, generator=g)
    x[2] = torch.round(x[2])
    args = (torch.ones(3), rng.row_keys(torch.arange(3), torch.arange(3)),
            torch.tensor([200, 3, 150], dtype=torch.int32), torch.ones(3), torch.zeros(3))
    want, _ = sort_reference(x, *[args[0], *args[2:]])
    for capacity, path in ((16, [TIER_REFINE, TIER_GUESS, TIER_FALLBACK]), (1024, [TIER_PIVOTS, TIER_GUESS, 1])):
        tokens, thr, flags = _run(x, *args, capacity=capacity, block=64)
        assert flags.tolist() == path
        assert torch.equal(x >= thr[:, None], want)
        ref = torch.empty_like(tokens)
        gumbel_argmax_torch(x, args[0], args[1], thr, ref)
        assert torch.equal(tokens, ref)


def _exact(x, args, flags=(True, True, True), **kw):
    """Runs the kernels and checks the kept set and the token against the references; -> tiers."""
    temperature, keys, top_k, top_p, min_p = args
    want, clear = sort_reference(x, temperature, top_k, top_p, min_p, flags)
    assert all(clear)
    tokens, thr, path = _run(x, *args, flags, **kw)
    s = x / torch.where(temperature == 0.0, 1.0, temperature)[:, None]
    assert torch.equal(s >= thr[:, None], want)
    ref = torch.empty_like(tokens)
    gumbel_argmax_torch(x, temperature, keys, thr, ref)
    assert torch.equal(tokens, ref)
    return path.tolist()


def test_the_guess_serves_every_filter_mix_of_a_peaked_row():
    # A peaked row (LLM-like): 5 boosted tokens. Min-p, top-k, top-p alone (the mass guess,
    # mode 2), all three, and no filter (every token drawn) are each proven by the guess tier.
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 1000, generator=g)
    x[:, torch.randperm(1000, generator=g)[:5]] += torch.tensor([12.0, 11.0, 10.5, 10.0, 9.0])
    args = (torch.tensor([0.8, 1.0, 0.7, 1.2, 0.9]), rng.row_keys(torch.arange(5), torch.arange(5)),
            torch.tensor([0, 20, 0, 50, 0], dtype=torch.int32), torch.tensor([1.0, 1.0, 0.9, 0.9, 1.0]),
            torch.tensor([0.05, 0.0, 0.0, 0.05, 0.0]))
    assert _exact(x, args, block=64) == [0, 0, 0, 0, 0]


def test_a_wrong_mass_guess_falls_to_the_pivots_exactly():
    # A flat row: the bucket maxima (64 of ~16 tokens) hold far less than the row's mass, so
    # the top-p guess is too high; select must see it (not enough mass above g) and defer.
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 1000, generator=g) * 0.01
    args = (torch.ones(1), rng.row_keys(torch.arange(1), torch.arange(1)), torch.zeros(1, dtype=torch.int32),
            torch.tensor([0.9]), torch.zeros(1))
    assert _exact(x, args, block=64, splits=1) == [1]


@st.composite
def flat_batches(draw):
    """Nearly flat rows (random-weight logits): tier 1's window of the top-p threshold or of the
    k-th value holds far more tokens than the test's capacity; bf16 ties and -inf entries."""
    rows = draw(st.integers(1, 3))
    vocab = draw(st.sampled_from([1000, 2000]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn(rows, vocab, generator=g) * draw(st.sampled_from([0.05, 0.1, 0.5]))
    if draw(st.booleans()):
        x = x.bfloat16().float()  # runs of equal values, as a bf16 LM head gives
    if draw(st.booleans()):
        x[torch.rand(rows, vocab, generator=g) < 0.1] = NEG_INF
    temperature = torch.tensor([draw(st.sampled_from([0.5, 0.8, 1.0, 1.5])) for _ in range(rows)])
    top_k = torch.tensor([draw(st.sampled_from([0, 0, vocab // 3, vocab // 2, vocab - 50, vocab - 1]))
                          for _ in range(rows)], dtype=torch.int32)
    top_p = torch.tensor([draw(st.sampled_from([1.0, 0.999, 0.95, 0.9, 0.5])) for _ in range(rows)])
    min_p = torch.tensor([draw(st.sampled_from([0.0, 0.0, 1e-3, 0.5])) for _ in range(rows)])
    keys = rng.row_keys(torch.randint(0, 2**62, (rows,), generator=g), torch.arange(rows))
    flags = draw(st.sampled_from([(True, True, True), (False, True, False), (True, False, False),
                                  (True, True, False), (False, True, True)]))
    return x, temperature, keys, top_k, top_p, min_p, flags


@given(batch=flat_batches(), splits=st.sampled_from([None, 3]))
@settings(deadline=None)
def test_flat_rows_are_refined_exactly_instead_of_the_fallback(batch, splits):
    # Capacity 256 of V <= 2000: tier 1's windows overflow on such rows, two refining passes fit them.
    x, temperature, keys, top_k, top_p, min_p, flags = batch
    want, clear = sort_reference(x, temperature, top_k, top_p, min_p, flags)
    assume(all(clear))
    tokens, thr, tiers = _run(x, temperature, keys, top_k, top_p, min_p, flags, capacity=256, splits=splits)
    s = x / temperature[:, None]
    assert torch.equal(s >= thr[:, None], want), (thr, tiers)
    ref = torch.empty_like(tokens)
    gumbel_argmax_torch(x, temperature, keys, thr, ref)
    assert torch.equal(tokens, ref)
    assert TIER_FALLBACK not in tiers.tolist()


def _ulp_ties(g, rows, vocab):
    """Values 1 + j ulp, j in 0..8: every window narrows to adjacent floats (one tied value)."""
    one = torch.tensor(1.0)
    return one + torch.randint(0, 9, (rows, vocab), generator=g).float() * (torch.nextafter(one, one + 1) - one)


@pytest.mark.parametrize("case", ["top_p", "top_k_and_top_p", "bf16_ties", "ulp_ties", "kth_is_minus_inf"])
def test_the_refinement_serves_flat_rows(case):
    # Rows the fallback served before: a window of tier 1 holds hundreds of tokens, more than the capacity.
    g = torch.Generator().manual_seed(7)
    rows, vocab = 3, 1500
    x = torch.randn(rows, vocab, generator=g) * 0.1
    top_k, top_p = torch.zeros(rows, dtype=torch.int32), torch.tensor([0.95, 0.9, 0.99])
    if case == "top_k_and_top_p":
        top_k = torch.tensor([700, 1000, 1300], dtype=torch.int32)
    elif case == "bf16_ties":
        x = x.bfloat16().float()
    elif case == "ulp_ties":
        x, top_k, top_p = _ulp_ties(g, rows, vocab), torch.tensor([0, 700, 1400], dtype=torch.int32), top_p - 0.4
    elif case == "kth_is_minus_inf":  # more -inf entries than V - k: the k-th value is -inf
        x[torch.rand(rows, vocab, generator=g) < 0.3] = NEG_INF
        top_k, top_p = torch.full((rows,), vocab - 10, dtype=torch.int32), torch.ones(rows)
    args = (torch.full((rows,), 0.8), rng.row_keys(torch.arange(rows), torch.arange(rows)), top_k, top_p,
            torch.zeros(rows))
    # Two windows split 6 ways each per pass (one window: 13 ways): twice the capacity.
    assert _exact(x, args, capacity=128 if case == "top_k_and_top_p" else 64) == [TIER_REFINE] * rows


def test_all_minus_inf_row_draws_token_zero_and_spares_the_others():
    # Documented outcome: a row of only -inf goes to the fallback and draws token 0.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 64, generator=g) * 2
    args = (torch.full((3,), 0.8), rng.row_keys(torch.arange(3), torch.arange(3)),
            torch.tensor([5, 0, 10], dtype=torch.int32), torch.tensor([0.9, 0.8, 1.0]), torch.tensor([0.0, 0.1, 0.05]))
    clean, clean_thr, _ = _run(x, *args, block=64)
    x[1] = NEG_INF
    got, thr, flags = _run(x, *args, block=64)
    assert got[1] == 0 and flags[1] == TIER_FALLBACK
    assert torch.equal(got[[0, 2]], clean[[0, 2]]) and torch.equal(thr[[0, 2]], clean_thr[[0, 2]])


@given(kind=st.sampled_from(["nan", "inf", "-inf", "nan-row", "inf-row"]), bad=st.integers(0, 2),
       seed=st.integers(0, 2**31))
@settings(deadline=None)
def test_non_finite_logits_stay_in_their_row(kind, bad, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 64, generator=g) * 3
    args = (torch.tensor([0.7, 1.0, 1.3]), rng.row_keys(torch.randint(0, 2**40, (3,), generator=g), torch.arange(3)),
            torch.tensor([4, 0, 20], dtype=torch.int32), torch.tensor([0.9, 0.6, 1.0]), torch.tensor([0.0, 0.05, 0.1]))
    clean, clean_thr, _ = _run(x, *args, capacity=32, block=64)
    poison = {"nan": math.nan, "inf": math.inf, "-inf": NEG_INF, "nan-row": math.nan, "inf-row": math.inf}[kind]
    if kind.endswith("-row"):
        x[bad] = poison
    else:
        x[bad, torch.randint(0, 64, (5,), generator=g)] = poison
    got, thr, _ = _run(x, *args, capacity=32, block=64)
    others = [r for r in range(3) if r != bad]
    assert torch.equal(got[others], clean[others]) and torch.equal(thr[others], clean_thr[others])
    assert 0 <= int(got[bad]) < 64


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@given(batch=batches(max_rows=16, vocabs=(1000, 32000)))
@settings(deadline=None)
def test_gpu_kept_set_equals_the_sort_reference(batch):
    cuda = tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in batch)
    x, temperature, keys, top_k, top_p, min_p, flags = cuda
    want, clear = sort_reference(*(t.cpu() for t in (x, temperature, top_k, top_p, min_p)), flags)
    assume(all(clear))
    tokens, thr, _ = _run(*cuda[:6], flags)
    s = x / torch.where(temperature == 0.0, 1.0, temperature)[:, None]
    assert torch.equal((s >= thr[:, None]).cpu(), want)
    ref = torch.empty_like(tokens)
    gumbel_argmax_torch(x, temperature, keys, thr, ref)
    assert torch.equal(tokens, ref)


@pytest.mark.gpu
def test_gpu_full_vocab_graph_replay_is_deterministic_and_exact_for_min_p_top_k():
    rows, vocab = 64, 151936
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(rows, vocab, generator=g) * 3).cuda()
    temperature = (torch.rand(rows, generator=g) + 0.3).cuda()
    keys = rng.row_keys(torch.arange(rows), torch.arange(rows)).cuda()
    top_k = torch.randint(1, 3000, (rows,), generator=g).to(torch.int32).cuda()
    top_p, min_p = torch.ones(rows).cuda(), (torch.rand(rows, generator=g) * 0.2).cuda()
    out = torch.empty(rows, dtype=torch.int64, device="cuda")
    thr = torch.empty(rows, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        pivot_sample_triton(x, temperature, keys, top_k, top_p, min_p, True, True, True, out, thr, reject=False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pivot_sample_triton(x, temperature, keys, top_k, top_p, min_p, True, True, True, out, thr, reject=False)
    results = []
    for _ in range(3):
        graph.replay()
        results.append((out.clone(), thr.clone()))
    assert all(torch.equal(a, results[0][0]) and torch.equal(b, results[0][1]) for a, b in results)
    want, _ = sort_reference(x.cpu(), temperature.cpu(), top_k.cpu(), top_p.cpu(), min_p.cpu())
    s = x / temperature[:, None]
    assert torch.equal((s >= thr[:, None]).cpu(), want)


@pytest.mark.gpu
def test_gpu_flat_full_vocab_rows_are_refined_and_draw_the_fallbacks_tokens():
    # Flat rows, as random weights give (bf16 ties) at T 0.8, top-p 0.95: 95% of the mass in ~80% of
    # the vocabulary. Tier 2 serves every row; the one-program fallback draws the same tokens.
    rows, vocab = 256, 151936
    g = torch.Generator().manual_seed(16)
    x = (torch.randn(rows, vocab, generator=g) * 0.5).bfloat16().float().cuda()
    temperature, top_p = torch.full((rows,), 0.8, device="cuda"), torch.full((rows,), 0.95, device="cuda")
    keys = rng.row_keys(torch.arange(rows), torch.arange(rows)).cuda()
    top_k, min_p = torch.zeros(rows, dtype=torch.int32, device="cuda"), torch.zeros(rows, device="cuda")
    tokens, thr, tiers = _run(x, temperature, keys, top_k, top_p, min_p, (False, True, False))
    assert tiers.tolist() == [TIER_REFINE] * rows
    want_thr = torch.empty(rows, device="cuda")
    sampling_threshold_triton(x, temperature, top_k, top_p, min_p, False, True, False, want_thr)
    want = torch.empty_like(tokens)
    gumbel_argmax_triton(x, temperature, keys, want_thr, want)
    assert torch.equal(tokens, want)
    s = x / temperature[:, None]
    kept, want_kept = (s >= thr[:, None]).sum(1), (s >= want_thr[:, None]).sum(1)  # [R]
    assert (kept - want_kept).abs().max() <= 2000  # a top-p boundary within fp32 rounding of the mass


def test_greedy_rows_get_torch_argmax_even_with_non_finite_logits():
    # T = 0: the unfiltered torch.argmax of x (first NaN, else first maximum; 0 for all -inf).
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g)
    x[1, [7, 40]] = math.nan
    x[2, [3, 50]] = math.inf
    x[3] = NEG_INF
    x[4, [10, 30]] = x[4].max() + 1.0  # a tie: the first id
    args = (torch.zeros(5), rng.row_keys(torch.arange(5), torch.arange(5)), torch.full((5,), 3, dtype=torch.int32),
            torch.full((5,), 0.5), torch.full((5,), 0.1))
    got, _, _ = _run(x, *args, capacity=32, block=64)
    assert got.tolist() == x.argmax(-1).tolist() == [int(x[0].argmax()), 7, 3, 0, 10]


def test_the_decode_sizes_share_few_kernel_specializations(monkeypatch):
    """Capturing every decode size compiles each distinct set of a kernel's constexprs once (on a cold
    cache, 0.3-2 s each): over an H200's (132 SMs) 67 sizes and a 151,936-token vocab the sampled path
    stays near 50 sets, where split-count-sized reduction widths made 119. Kernels are recorded, not
    run: their host plans depend on shapes only."""
    import inspect

    from triton.runtime import interpreter

    from graphrunner.kernels import split_pad
    from graphrunner.sample import triton_sampling as ts

    seen: set[tuple] = set()

    def record(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        constexprs = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
        bound = dict(zip(params, args, strict=False)) | kwargs  # positional args fill the first names
        seen.add((self.fn.__name__, tuple(sorted((n, v) for n, v in bound.items() if n in constexprs))))

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", record)
    monkeypatch.setattr(ts, "sm_count", lambda device, *, cpu: 132)
    vocab = 151936
    for rows in [1, 2, 4, *range(8, 513, 8)]:
        zeros = torch.zeros(rows)
        pivot_sample_triton(torch.empty(rows, vocab), zeros, torch.zeros(rows, dtype=torch.int64),
                            torch.zeros(rows, dtype=torch.int32), zeros, zeros, True, True, False,
                            torch.zeros(rows, dtype=torch.int64), torch.zeros(rows))
    pads = {dict(c).get("S_PAD") for _, c in seen} - {None}
    assert pads == {split_pad(1), split_pad(149)} == {16, 256}
    assert len(seen) <= 50, sorted(seen)
    assert [split_pad(n) for n in (1, 16, 17, 256, 257)] == [16, 16, 256, 256, 4096]
