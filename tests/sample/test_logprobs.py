"""Logprobs and ranks vs torch.log_softmax; prompt logprobs vs a full-prompt reference."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.kernels import HAS_TRITON
from graphrunner.protocol import Logprob, SamplingParams
from graphrunner.sample.logprobs import (
    LogprobsTensors,
    PromptLogprobsCollector,
    compute_logprobs,
    logprob_dicts,
    prompt_logprob_targets,
    prompt_logprobs,
)
from tests.sample.test_sampler import make_states, run_sampler


def reference(logits: torch.Tensor, tokens: torch.Tensor, k: int):
    """Full-vocabulary reference: log_softmax, then rank by counting strictly larger logprobs."""
    full = torch.log_softmax(logits.double(), dim=-1)  # [N, V]
    chosen = full.gather(1, tokens.long()[:, None])[:, 0]
    ranks = (full > chosen[:, None]).sum(-1) + 1
    top = full.topk(k, dim=-1) if k > 0 else None
    return chosen, ranks, top


IMPLS = ["torch", pytest.param("triton", marks=[
    pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
])]


@pytest.mark.parametrize("impl", IMPLS)  # "triton" runs the kernels under TRITON_INTERPRET=1 on CPU
@settings(deadline=None)
@given(st.integers(2, 300), st.integers(1, 16), st.integers(0, 20), st.integers(0, 2**31))
def test_compute_logprobs_matches_log_softmax(impl, vocab, n, k, seed):
    k = min(k, vocab)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 4
    tokens = torch.randint(0, vocab, (n,), generator=g)
    lp = torch.full((n, k + 3), 7.0)  # wider than needed: extra columns stay untouched
    ids = torch.full((n, k + 3), -5, dtype=torch.int32)
    ranks = torch.zeros(n, dtype=torch.int32)
    compute_logprobs(logits, tokens, k, lp, ids, ranks, impl=impl)
    chosen, want_ranks, top = reference(logits, tokens, k)
    torch.testing.assert_close(lp[:, 0].double(), chosen, rtol=0, atol=1e-5)
    assert torch.equal(ids[:, 0].long(), tokens)
    assert torch.equal(ranks.long(), want_ranks)
    if k > 0:
        torch.testing.assert_close(lp[:, 1 : k + 1].double(), top.values, rtol=0, atol=1e-5)
        assert torch.equal(ids[:, 1 : k + 1].long(), top.indices)
    assert bool((lp[:, k + 1 :] == 7.0).all()) and bool((ids[:, k + 1 :] == -5).all())


@settings(deadline=None)
@given(st.integers(0, 2**31), st.sampled_from([0, 1, 3, 5]))
def test_sampler_logprobs_are_of_the_raw_distribution(seed, k):
    # Bias, penalties and temperature change the sampled token, not the reported logprobs:
    # they are vLLM's raw logprobs (of the model's logits).
    vocab, n = 50, 6
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 2
    params = [SamplingParams(temperature=0.7 * (i % 3), seed=i, logprobs=k, logit_bias={i: 3.0},
                             repetition_penalty=1.3, top_k=10) for i in range(n)]
    states = make_states(params, vocab, histories=[[1, 2, 3, 4]] * n, prompt_lens=[2] * n)
    out, lp, ids, ranks = run_sampler(states, logits, list(range(n)), [4] * n, num_logprobs=True)
    assert states.features(np.arange(n)).num_logprobs >= k
    chosen, want_ranks, top = reference(logits, out, k)
    torch.testing.assert_close(lp[:, 0].double(), chosen, rtol=0, atol=1e-5)
    assert torch.equal(ranks.long(), want_ranks)
    if k > 0:
        assert torch.equal(ids[:, 1 : k + 1].long(), top.indices)


def test_logprob_dicts_have_vllm_shape():
    lp = np.array([[-0.5, -0.5, -1.5], [-3.0, -0.2, -0.9]], dtype=np.float32)
    ids = np.array([[4, 4, 7], [9, 1, 2]])
    ranks = np.array([1, 6])
    d = logprob_dicts(lp, ids, ranks)
    assert d[0] == {4: Logprob(-0.5, 1), 7: Logprob(-1.5, 2)}
    assert d[1] == {9: Logprob(-3.0, 6), 1: Logprob(pytest.approx(-0.2), 1), 2: Logprob(pytest.approx(-0.9), 2)}


def test_prompt_logprob_targets():
    tokens = [10, 11, 12, 13, 14]
    assert prompt_logprob_targets(tokens, 0, 2, 5) == [11, 12]
    assert prompt_logprob_targets(tokens, 2, 3, 5) == [13, 14]  # position 4 has no prompt target
    assert prompt_logprob_targets(tokens, 4, 1, 5) == []
    # A resumed request: tokens hold prompt + earlier outputs; only the prompt counts.
    assert prompt_logprob_targets(tokens + [15, 16], 2, 5, 5) == [13, 14]


@settings(deadline=None)
@given(st.integers(2, 40), st.integers(1, 4), st.lists(st.integers(1, 12), min_size=1, max_size=5),
       st.integers(1, 7), st.integers(0, 2**31))
def test_prompt_logprobs_across_chunks_match_full_prompt(prompt_len, k, sched_chunks, slice_size, seed):
    # The prompt is prefilled in scheduler chunks (sched_chunks, cycling); each chunk's
    # prompt logprobs run in slices of slice_size. The assembled result must equal the
    # full-prompt reference.
    vocab, hidden_size = 30, 8
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
    hidden = torch.randn(prompt_len, hidden_size, generator=g)
    head = torch.randn(hidden_size, vocab, generator=g)

    def compute_logits(h):
        return h @ head

    collector = PromptLogprobsCollector(prompt_len, k)
    start, i = 0, 0
    while start < prompt_len:
        n = min(sched_chunks[i % len(sched_chunks)], prompt_len - start)
        targets = prompt_logprob_targets(tokens, start, n, prompt_len)
        if targets:
            part = prompt_logprobs(hidden[start : start + len(targets)], torch.tensor(targets), k,
                                   compute_logits=compute_logits, chunk_size=slice_size)
            collector.add_chunk(start, part)
        start, i = start + n, i + 1
    assert collector.done
    result = collector.result()
    assert len(result) == prompt_len and result[0] is None

    logits = compute_logits(hidden[:-1])  # [P-1, V]: position p predicts token p + 1
    chosen, ranks, top = reference(logits, torch.tensor(tokens[1:]), k)
    for p in range(1, prompt_len):
        entry = result[p]
        assert entry[tokens[p]].rank == int(ranks[p - 1])
        assert entry[tokens[p]].logprob == pytest.approx(float(chosen[p - 1]), abs=1e-4)
        for j in range(k):
            tid = int(top.indices[p - 1, j])
            assert entry[tid].logprob == pytest.approx(float(top.values[p - 1, j]), abs=1e-4)


def test_prompt_logprobs_from_logits_and_errors():
    logits = torch.randn(5, 9)
    targets = torch.tensor([0, 3, 8, 2, 2])
    res = prompt_logprobs(logits, targets, 2, chunk_size=2)
    assert isinstance(res, LogprobsTensors) and res.logprobs.shape == (5, 3)
    torch.testing.assert_close(res.logprobs[:, 0], torch.log_softmax(logits, -1)[torch.arange(5), targets])
    with pytest.raises(ValueError, match="chunk_size=0"):
        prompt_logprobs(logits, targets, 2, chunk_size=0)
    with pytest.raises(ValueError, match="4 targets for 5 positions"):
        prompt_logprobs(logits, targets[:4], 2)
