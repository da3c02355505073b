"""Logprobs from the fused processing pass's statistics (sample/logprobs_fused.py).

Against two independent references: the torch path of `compute_logprobs` (logsumexp,
count, topk over the raw logits) and a stable descending sort (the top-K order the
kernels promise: equal logits lower id first); and against `logprobs_triton`'s stream,
whose ids and ranks it must equal exactly. Rows mix ties, -inf, rows of only -inf, huge
and tiny magnitudes, NaN and +inf rows (tests/sample/test_logprobs_triton.make_logits), the
sampled token anywhere in its row (top, bottom, random: the rank pass rereads from none
to every group), and tiles forced small so a row spans many tiles and groups.

Through the Sampler (Triton under TRITON_INTERPRET=1 against the torch processors and
logprobs): batches mix rows with and without penalties, masks, bias and min_tokens, and
features with every processor off (the stream path) or some on (the stats path).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.sample import sampler as sampler_module
from graphrunner.sample.fused_process import process_logits_triton
from graphrunner.sample.logprobs_fused import LogprobStats, logprobs_from_stats
from graphrunner.sample.logprobs_triton import logprobs_triton
from graphrunner.sample.sampler import Sampler
from graphrunner.state.features import SamplingFeatures
from tests.sample.test_fused_process import assert_same, random_states
from tests.sample.test_logprobs_triton import BAD_KINDS, INTERPRETER_MARKS, KINDS, close, make_logits, run

pytestmark = INTERPRETER_MARKS
ALL_STAGES = (True, True, True, True)


def pick_tokens(x: torch.Tensor, where: list[str], g: torch.Generator) -> torch.Tensor:  # [R] int64
    """Per row: its top entry, its lowest, or a random one (the rank pass's cheap to dear cases)."""
    key = torch.where(x.isnan(), -torch.inf, x.float())
    rand = torch.randint(0, x.shape[1], (x.shape[0],), generator=g)
    return torch.stack([key[r].argmax() if w == "top" else key[r].argmin() if w == "bottom" else rand[r]
                        for r, w in enumerate(where)])


def stats_logprobs(x, tokens, k, states, tile, stages=ALL_STAGES):
    """(processed, logprobs, ids, ranks) from one dense pass with stats, then `logprobs_from_stats`."""
    n, vocab = x.shape
    stats = LogprobStats.allocate(n + 1, vocab, x.device, tile=tile)  # a scratch taller than the batch
    idx = torch.arange(n, device=x.device) % states.num_rows
    positions = torch.full((n,), 6, device=x.device)
    out = torch.empty_like(x)
    process_logits_triton(x, out, states, idx, positions, stages, stats=stats)
    lp = torch.full((n, k + 3), 7.0, device=x.device)
    ids = torch.full((n, k + 3), -5, dtype=torch.int32, device=x.device)
    ranks = torch.full((n,), -5, dtype=torch.int32, device=x.device)
    logprobs_from_stats(x, tokens, k, lp, ids, ranks, stats)
    return out, lp, ids, ranks


@given(
    seed=st.integers(0, 2**31),
    kinds=st.lists(st.sampled_from(KINDS + BAD_KINDS), min_size=1, max_size=4),
    where=st.lists(st.sampled_from(["top", "bottom", "random"]), min_size=4, max_size=4),
    vocab=st.integers(1, 300),
    k=st.sampled_from([0, 1, 5, 20, 32]),
    tile=st.sampled_from([16, 64, 2048]),
)
def test_stats_logprobs_equal_the_stream_and_the_torch_path(seed, kinds, where, vocab, k, tile):
    k = min(k, vocab)
    g = torch.Generator().manual_seed(seed)
    x = make_logits(seed, kinds, vocab)
    tokens = pick_tokens(x, where[: len(kinds)], g)
    states = random_states(g, 3, vocab, 12, 1)
    processed, lp, ids, ranks = stats_logprobs(x, tokens, k, states, tile)
    # The stats change nothing in the processing: the same pass without them.
    want = process_logits_triton(x, torch.empty_like(x), states, torch.arange(len(kinds)) % 3,
                                 torch.full((len(kinds),), 6), ALL_STAGES)
    assert_same(processed, want)
    stream = [torch.full_like(t, v) for t, v in ((lp, 7.0), (ids, -5), (ranks, -5))]
    logprobs_triton(x, tokens, k, *stream)
    assert torch.equal(ranks, stream[2]) and torch.equal(ids, stream[1])  # exact, both
    finite = torch.where(x.isfinite(), x.abs(), 0.0).amax(dim=-1, keepdim=True).double()
    assert close(lp, stream[0], 1e-5 * (1.0 + finite))  # the logsumexp to fp32 rounding
    clean = [r for r, kind in enumerate(kinds) if kind not in BAD_KINDS]
    if clean:  # the torch reference (NaN and +inf rows: the stream's documented outcome, checked above)
        check_against_reference(x[clean], tokens[clean], k, lp[clean], ids[clean], ranks[clean])


def check_against_reference(x, tokens, k, lp, ids, ranks):
    """The torch path's ranks, float64 log_softmax logprobs, a stable descending sort's top-K ids."""
    want_lp, want_ids, want_ranks = run(x, tokens, k, "torch")
    exact = torch.log_softmax(x.double(), dim=-1)  # [R, V]
    atol = 1e-5 * (1.0 + torch.where(x.isfinite(), x.abs(), 0.0).amax(dim=-1, keepdim=True).double())
    assert torch.equal(ranks, want_ranks) and torch.equal(ids[:, 0].long(), tokens.long())
    assert close(lp[:, :1], exact.gather(1, tokens[:, None]), atol)
    if k > 0:
        order = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]  # ties: lower id first
        assert torch.equal(ids[:, 1 : k + 1].long(), order)
        assert close(lp[:, 1 : k + 1], exact.gather(1, order), atol)
    assert bool((lp[:, k + 1 :] == 7.0).all()) and bool((ids[:, k + 1 :] == -5).all())  # untouched


def key_values(keys: torch.Tensor) -> torch.Tensor:  # [G] int64 sort keys -> [G] float32 values
    ordered = (keys >> 32).to(torch.int32)
    return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).view(torch.float32)


def test_rank_pass_rereads_only_the_groups_above_the_chosen_logit():
    vocab, tile = 4096, 256
    x = torch.arange(vocab, dtype=torch.float32).flip(0)[None].clone()  # falling: token t has rank t + 1
    for token, groups in ((0, 0), (200, 2), (4095, 32)):  # 128 entries per group
        stats = LogprobStats.allocate(1, vocab, x.device, tile=tile)
        states = random_states(torch.Generator().manual_seed(0), 1, vocab, 8, 1)
        process_logits_triton(x, torch.empty_like(x), states, torch.zeros(1, dtype=torch.long), torch.tensor([6]),
                              ALL_STAGES, stats=stats)
        over = key_values(stats.group_keys[0]) > x[0, token]
        assert int(over.sum()) == groups
        _, _, _, ranks = stats_logprobs(x, torch.tensor([token]), 5, states, tile)
        assert int(ranks[0]) == token + 1


def run_sampler(sampler, logits, idx, pos, features, k):
    n = logits.shape[0]
    out = torch.zeros(n, dtype=torch.int32)
    lp, ids = torch.zeros(n, k + 1), torch.zeros(n, k + 1, dtype=torch.int32)
    ranks = torch.zeros(n, dtype=torch.int32)
    sampler(logits, idx, pos, features, out, out_logprobs=lp, out_logprob_ids=ids, out_ranks=ranks)
    return out, lp, ids, ranks


@given(
    seed=st.integers(0, 2**31),
    kinds=st.lists(st.sampled_from(KINDS + ("nan",)), min_size=1, max_size=5),
    vocab=st.sampled_from([7, 100, 257]),
    stages=st.tuples(st.booleans(), st.booleans(), st.booleans()),
    k=st.sampled_from([0, 3, 20]),
    tile=st.sampled_from([16, 64]),
)
def test_sampler_logprobs_from_the_fused_pass_equal_the_torch_path(seed, kinds, vocab, stages, k, tile):
    k = min(k, vocab)
    g = torch.Generator().manual_seed(seed)
    states = random_states(g, 5, vocab, 12, 1)  # rows with and without penalties, masks, bias
    features = SamplingFeatures(any_logit_bias=stages[0], any_min_tokens=stages[1], any_penalties=stages[2],
                                num_logprobs=k)
    x = make_logits(seed, kinds, vocab)
    n = len(kinds)
    idx = torch.randint(0, 5, (n,), generator=g, dtype=torch.int32)
    pos = torch.randint(0, 12, (n,), generator=g)
    fused = Sampler(states, _fused=True)
    fused._stats = LogprobStats.allocate(n, vocab, x.device, tile=tile)
    used: list[int] = []
    real = sampler_module.logprobs_from_stats
    sampler_module.logprobs_from_stats = lambda *a: used.append(1) or real(*a)  # a spy (no fixture under @given)
    try:
        got = run_sampler(fused, x, idx, pos, features, k)
    finally:
        sampler_module.logprobs_from_stats = real
    assert bool(used) == any(stages)  # the stats path serves every batch that has a processing pass
    want = run_sampler(Sampler(states, _fused=False), x, idx, pos, features, k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[3], want[3])  # tokens, ranks
    assert torch.equal(got[2][:, 0], want[2][:, 0])
    finite = torch.where(x.isfinite(), x.abs(), 0.0).amax(dim=-1, keepdim=True).double()
    assert close(got[1][:, :1], want[1][:, :1], 1e-5 * (1.0 + finite))
    if not any(stages):  # compute_logprobs (on CPU: the torch path, as the reference)
        assert torch.equal(got[2], want[2])
        return
    clean = [r for r, kind in enumerate(kinds) if kind != "nan"]  # torch.topk lists NaN first (documented)
    if k > 0 and clean:
        order = torch.sort(x[clean], dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(got[2][clean, 1:].long(), order)
        assert close(got[1][clean, 1:], want[1][clean, 1:], 1e-5 * (1.0 + finite[clean]))


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_all_features_logprobs_at_scale_and_in_a_cuda_graph():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(3)
    rows, vocab, n, k = 257, 151_936, 256, 20
    states = random_states(g, rows, vocab, 64, 1, device="cuda")
    kinds = [KINDS[r % len(KINDS)] if r % 3 == 0 else "randn" for r in range(n)]
    x = make_logits(0, kinds, vocab, device="cuda")
    idx = torch.randperm(rows, generator=g)[:n].to(torch.int32).cuda()
    pos = torch.randint(2, 64, (n,), generator=g).cuda()
    features = SamplingFeatures.all_on()
    fused, ref = Sampler(states, _fused=True), Sampler(states, _fused=False)
    bufs = [torch.zeros(n, dtype=torch.int32, device="cuda"), torch.zeros(n, k + 1, device="cuda"),
            torch.zeros(n, k + 1, dtype=torch.int32, device="cuda"), torch.zeros(n, dtype=torch.int32, device="cuda")]

    def call():
        fused(x, idx, pos, features, bufs[0], out_logprobs=bufs[1], out_logprob_ids=bufs[2], out_ranks=bufs[3])

    call()  # compiles outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for seed in (1, 2):
        x.copy_(make_logits(seed, kinds[::-1], vocab, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        stream = [torch.zeros_like(b) for b in bufs[1:]]
        logprobs_triton(x, bufs[0], k, *stream)
        assert torch.equal(bufs[3], stream[2]) and torch.equal(bufs[2], stream[1]), seed
        finite = torch.where(x.isfinite(), x.abs(), 0.0).amax(dim=-1, keepdim=True).double()
        assert close(bufs[1], stream[0], 1e-5 * (1.0 + finite)), seed
        want = [torch.zeros_like(b) for b in bufs]
        ref(x, idx, pos, features, want[0], out_logprobs=want[1], out_logprob_ids=want[2], out_ranks=want[3])
        assert torch.equal(bufs[0], want[0]) and torch.equal(bufs[3], want[3]), seed
