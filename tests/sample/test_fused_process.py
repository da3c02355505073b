"""Fused logit processing (sample/fused_process.py) and persistent penalty counts.

- The fused Triton pass (under TRITON_INTERPRET=1 on CPU) against the torch processors:
  bit-identical processed logits (NaN where they give NaN) and the same greedy tokens.
- The counts rebuild and the post-update's counting against `processors.token_counts` /
  a Python count of the appended tokens.
- Through the runner (tiny model on CPU, plain and speculative, eager and emulated graphs,
  chunked prefill, preemption, row reuse): after every step each live request's persistent
  counts equal `token_counts` of its history and a count of its host-side tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.kernels import HAS_TRITON
from graphrunner.kernels.input_prep import post_update_torch, post_update_triton
from graphrunner.protocol import SamplingParams
from graphrunner.sample.fused_process import refresh_counts
from graphrunner.sample.processors import PROMPT_FLAG, token_counts
from graphrunner.sample.sampler import Sampler
from graphrunner.state.counts import allocate_counts, as_packed32, from_packed32
from graphrunner.state.features import SamplingFeatures
from graphrunner.state.sampling import SamplingStates
from tests.spec_decode.test_spec_decode import PARAMS, SpecDriver, build, ngram, repetitive

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (TRITON_INTERPRET=1 on CPU)")
INF = float("inf")


def random_states(g: torch.Generator, rows: int, vocab: int, max_model_len: int, slots: int,
                  device: str = "cpu", max_bias: int = 5) -> SamplingStates:
    """States with every per-row setting random (written directly: the kernels' inputs, not validation)."""
    history = torch.randint(0, vocab, (rows, max_model_len), dtype=torch.int32, generator=g)
    s = SamplingStates(rows, torch.device("cpu"), vocab_size=vocab, all_token_ids=history, max_logit_bias=max_bias,
                       max_stop_ids=4, grammar_slots=slots)

    def pick(values, n):
        return torch.tensor(values)[torch.randint(0, len(values), (n,), generator=g)]

    assert s.allowed_mask is not None and s.grammar_mask is not None and s.counts is not None
    s.use_allowed.copy_(torch.rand(rows, generator=g) < 0.5)
    s.use_grammar.copy_(torch.rand(rows, generator=g) < 0.5)
    s.allowed_mask.copy_(torch.randint(-2**31, 2**31 - 1, s.allowed_mask.shape, generator=g, dtype=torch.int32))
    s.grammar_mask.copy_(torch.randint(-2**31, 2**31 - 1, s.grammar_mask.shape, generator=g, dtype=torch.int32))
    for r in range(rows):  # distinct ids within a row (may repeat across rows), unused slots (0, +0.0)
        n = int(torch.randint(0, max_bias + 1, (1,), generator=g))
        ids = torch.randperm(vocab, generator=g)[:n]
        s.bias_ids[r, : len(ids)] = ids
        s.bias_values[r, : len(ids)] = torch.randn(len(ids), generator=g) * 4
    s.stop_ids.copy_(torch.randint(0, vocab, s.stop_ids.shape, generator=g))
    s.min_tokens.copy_(torch.randint(0, 6, (rows,), generator=g, dtype=torch.int32))
    s.prompt_len.copy_(torch.randint(0, max_model_len, (rows,), generator=g, dtype=torch.int32))
    s.repetition_penalty.copy_(pick([1.0, 0.7, 1.3, 2.0], rows))
    s.frequency_penalty.copy_(pick([0.0, 0.5, -0.4], rows))
    s.presence_penalty.copy_(pick([0.0, 0.8, -1.0], rows))
    flags = (torch.rand(rows, vocab, generator=g) < 0.3).to(torch.int32) * PROMPT_FLAG
    s.counts.copy_(from_packed32(flags + torch.randint(0, 4, (rows, vocab), generator=g, dtype=torch.int32),
                                 s.counts.dtype))
    if device != "cpu":
        for name, value in list(vars(s).items()):
            if isinstance(value, torch.Tensor):
                setattr(s, name, value.to(device))
        s.device = torch.device(device)
    return s


def random_logits(g: torch.Generator, n: int, vocab: int) -> torch.Tensor:  # [n, V] with some +-inf
    x = torch.randn(n, vocab, generator=g) * 3
    x[torch.rand(n, vocab, generator=g) < 0.05] = INF
    x[torch.rand(n, vocab, generator=g) < 0.05] = -INF
    return x


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-for-bit up to the sign of zero (NaN where the reference has NaN)."""
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@settings(deadline=None)
@given(seed=st.integers(0, 2**31), num=st.integers(1, 6), vocab=st.sampled_from([1, 7, 33, 64, 100, 2049]),
       slots=st.sampled_from([1, 3]), stages=st.tuples(st.booleans(), st.booleans(), st.booleans()),
       target=st.booleans(), max_bias=st.sampled_from([5, 40]))
def test_fused_processing_equals_the_torch_processors(seed, num, vocab, slots, stages, target, max_bias):
    """max_bias 40: more bias slots than a power of two, so the sparse kernel masks the padding."""
    g = torch.Generator().manual_seed(seed)
    rows, max_model_len = 5, 12
    s = random_states(g, rows, vocab, max_model_len, slots, max_bias=max_bias)
    features = SamplingFeatures(any_logit_bias=stages[0], any_min_tokens=stages[1], any_penalties=stages[2])
    logits = random_logits(g, num, vocab)
    idx = torch.randint(0, rows, (num,), generator=g, dtype=torch.int32)  # repeats allowed
    slot = torch.randint(0, slots, (num,), generator=g) if target else None
    base = torch.randint(0, max_model_len - slots + 1, (num,), generator=g)
    positions = base + (slot if slot is not None else 0)
    fused, torch_impl = Sampler(s, _fused=True), Sampler(s, _fused=False)
    if target:
        got = fused.target_logits(logits, idx, positions, features, slot).clone()
        want = torch_impl.target_logits(logits, idx, positions, features, slot)
    else:
        got = fused._process(logits, idx.long(), positions, features, None).clone()
        want = torch_impl._process(logits, idx.long(), positions, features, None)
    assert_same(got, want)
    out_fused, out_torch = torch.empty(num, dtype=torch.int32), torch.empty(num, dtype=torch.int32)
    fused(logits, idx, positions, features, out_fused)
    torch_impl(logits, idx, positions, features, out_torch)
    assert torch.equal(out_fused, out_torch)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("max_bias", [3, 40])
def test_bias_and_stop_keep_the_sign_of_zero_like_scatter_add(max_bias, device):
    """Zeros at biased ids, id 0 biased beside the unused (0, +0.0) slots, biases of -0.0 and
    +0.0, a row with every slot used: the sparse kernel gives scatter_add's bits, signs of
    zero included (max_bias 40: more slots than a power of two, the padding masked)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    vocab, rows = 70, 4
    s = random_states(torch.Generator().manual_seed(1), rows, vocab, 8, 1, device=device, max_bias=max_bias)
    s.use_allowed.fill_(False), s.use_grammar.fill_(False)
    s.repetition_penalty.fill_(1.0), s.frequency_penalty.zero_(), s.presence_penalty.zero_()
    s.bias_ids.zero_(), s.bias_values.zero_()
    biased = {0: ([0, 5], [-0.0, 2.0]), 1: ([5, 0], [-0.0, 0.0]),
              2: ([0] * (max_bias - 1) + [9], [1.5] + [0.0] * (max_bias - 1)),  # id 0 biased, unused slots, id 9
              3: (list(range(1, max_bias + 1)), [-0.0] * max_bias)}
    for r, (ids, values) in biased.items():
        s.bias_ids[r, : len(ids)] = torch.tensor(ids)
        s.bias_values[r, : len(values)] = torch.tensor(values)
    s.stop_ids.copy_(torch.tensor([[60, 60, 61, 5]] * rows))  # min_tokens 0: adds 0.0 at id 5 only
    s.min_tokens.fill_(0)
    logits = torch.randn(rows, vocab)
    logits[:, [0, 5, 9, 1]] = -0.0
    logits = logits.to(device)
    idx, positions = torch.arange(rows, device=device), torch.full((rows,), 6, device=device)
    features = SamplingFeatures(any_logit_bias=True, any_min_tokens=True, any_penalties=False)
    got = Sampler(s, _fused=True)._process(logits, idx, positions, features, None).clone()
    want = Sampler(s, _fused=False)._process(logits, idx, positions, features, None)
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))


def test_fused_processing_of_a_neutral_batch_is_the_identity():
    g = torch.Generator().manual_seed(0)
    s = random_states(g, 4, 50, 8, 1)
    s.use_allowed.fill_(False), s.use_grammar.fill_(False), s.bias_ids.zero_(), s.bias_values.zero_()
    s.min_tokens.zero_(), s.repetition_penalty.fill_(1.0), s.frequency_penalty.zero_(), s.presence_penalty.zero_()
    logits = random_logits(g, 3, 50)
    logits[:, 1:] = logits[:, 1:].masked_fill(logits[:, 1:] == 0, 1.0)
    got = Sampler(s, _fused=True)._process(logits, torch.tensor([0, 1, 3]), torch.tensor([3, 4, 5]),
                                                   SamplingFeatures.all_on(), None)
    assert got.data_ptr() != logits.data_ptr()  # the persistent buffer: the raw logits stay for logprobs
    assert_same(got, logits)


@settings(deadline=None)
@given(seed=st.integers(0, 2**31), num=st.integers(1, 6), clear=st.booleans(), use_kernel=st.booleans(),
       width=st.sampled_from([16, 32]), vocab=st.sampled_from([40, 41]))
def test_refresh_rebuilds_exactly_the_stale_rows(seed, num, clear, use_kernel, width, vocab):
    # int16 counts (the width of max_model_len <= 32768, rows padded to an even stride) and int32
    # ones; an odd vocabulary leaves the last token without a neighbour in its 32-bit word.
    g = torch.Generator().manual_seed(seed)
    rows, max_model_len = 5, 30
    history = torch.randint(0, vocab, (rows, max_model_len), dtype=torch.int32, generator=g)
    counts = allocate_counts(rows, vocab, 30 if width == 16 else 1 << 16, torch.device("cpu"))
    flags = (torch.rand(rows, vocab, generator=g) < 0.5).to(torch.int32) * PROMPT_FLAG
    counts.copy_(from_packed32(flags + torch.randint(0, 2**15, (rows, vocab), dtype=torch.int32, generator=g),
                               counts.dtype))
    before = counts.clone()
    stale = torch.rand(rows, generator=g) < 0.5
    was_stale = stale.clone()
    prompt_len = torch.randint(0, max_model_len, (rows,), dtype=torch.int32, generator=g)
    idx = torch.randint(0, rows, (num,), dtype=torch.int32, generator=g)  # repeats allowed
    known = torch.randint(0, max_model_len + 1, (num,), generator=g)
    refresh_counts(counts, stale, history, idx, prompt_len, known, clear, use_triton_kernel=use_kernel)
    first: dict[int, int] = {}
    for e, r in enumerate(idx.tolist()):
        first.setdefault(r, e)
    for r in range(rows):
        if r in first and was_stale[r]:
            e = first[r]
            want = token_counts(history, torch.tensor([r]), prompt_len[r : r + 1].long(), known[e : e + 1], vocab)[0]
            assert torch.equal(as_packed32(counts[r]), want), r
            assert bool(stale[r]) == (not clear)
        else:
            assert torch.equal(counts[r], before[r]) and bool(stale[r]) == bool(was_stale[r]), r


@settings(deadline=None)
@given(seed=st.integers(0, 2**31), k=st.sampled_from([0, 1, 3]), width=st.sampled_from([16, 32]))
def test_post_update_counts_the_appended_tokens(seed, k, width):
    """Both implementations of post_update vs a Python count: the new token, plus for a
    verifying entry its accepted drafts, never the rejected ones or positions past L."""
    g = torch.Generator().manual_seed(seed)
    rows, vocab, max_model_len, num = 6, 20, 16, 4
    i32 = dict(dtype=torch.int32)
    idx = torch.randperm(rows - 1, generator=g)[:num].to(torch.int32)
    idx[-1] = rows - 1  # a padded entry on the scratch row
    computed = torch.randint(0, max_model_len, (rows,), generator=g, **i32)
    prefill = torch.randint(0, max_model_len, (rows,), generator=g, **i32)
    qlen = torch.randint(1, k + 2, (num,), generator=g, **i32)
    qlen[-1] = 0
    qsl = torch.cat([torch.zeros(1, **i32), qlen.cumsum(0).to(torch.int32)])
    seq_lens = torch.where(qlen > 0, computed[idx.long()] + qlen, 0).to(torch.int32)
    verify = (qlen > 1) & (computed[idx.long()] >= prefill[idx.long()])
    rejected = torch.where(verify, (torch.rand(num, generator=g) * qlen).to(torch.int32).clamp(max=qlen - 1), 0)
    rejected = rejected.to(torch.int32) if k > 0 else None
    sampled = torch.randint(0, vocab, (num,), generator=g, **i32)
    history = torch.randint(0, vocab, (rows, max_model_len), generator=g, **i32)
    counts = allocate_counts(rows, vocab, max_model_len if width == 16 else 1 << 16, torch.device("cpu"))
    flags = (torch.rand(rows, vocab, generator=g) < 0.5).to(torch.int32) * PROMPT_FLAG
    counts.copy_(from_packed32(flags + torch.randint(0, 5, (rows, vocab), generator=g, **i32), counts.dtype))
    want = as_packed32(counts).clone()
    after_history = history.clone()
    for e in range(num - 1):
        r, end = int(idx[e]), int(seq_lens[e]) - (int(rejected[e]) if rejected is not None else 0)
        if int(seq_lens[e]) < int(prefill[r]):
            continue
        if end < max_model_len:
            after_history[r, end] = sampled[e]
        n_new = int(qlen[e]) - int(rejected[e]) if rejected is not None and bool(verify[e]) else 1
        for p in range(end - n_new + 1, end + 1):
            if p < max_model_len:
                want[r, int(after_history[r, p])] += 1
    for impl in (post_update_torch, post_update_triton):
        c, h = counts.clone(), history.clone()
        impl(idx, qsl, seq_lens, sampled, computed.clone(), prefill, torch.zeros(rows, **i32), h,
             rejected, c, k + 1)
        assert torch.equal(h, after_history), impl
        assert c.dtype == counts.dtype and torch.equal(as_packed32(c[: rows - 1]), want[: rows - 1]), impl


# --------------------------------------------------------------------------- through the runner


class CountingDriver(SpecDriver):
    """SpecDriver that checks every live request's persistent counts after each step."""

    checked = 0

    def step(self, preempt: str | None = None) -> None:
        super().step(preempt)
        state = self.runner.state
        sampling, requests = state.sampling, state.requests
        vocab = sampling.vocab_size
        for rid, r in self.reqs.items():
            row = requests.req_id_to_index.get(rid)
            if row is None or r.done or not r.params.uses_penalties:
                continue
            known = r.known if r.computed >= r.prefill_len else r.prefill_len
            got = as_packed32(sampling.counts[row].cpu())
            want = token_counts(requests.all_token_ids.cpu(), torch.tensor([row]), torch.tensor([len(r.prompt)]),
                                torch.tensor([known]), vocab)[0]
            assert torch.equal(got, want), (rid, self.steps)
            tokens = r.prompt + r.outputs  # the host's own account, independent of the device history
            host = np.zeros(vocab, dtype=np.int64)
            host[np.asarray(r.prompt, dtype=np.int64)] = PROMPT_FLAG
            np.add.at(host, np.asarray(tokens[len(r.prompt) : known], dtype=np.int64), 1)
            assert np.array_equal(got.numpy(), host), (rid, self.steps)
            self.checked += 1


@pytest.fixture(scope="module")
def counting_runners():
    return {("NONE", 0): build("NONE", None), ("FULL", 0): build("FULL", None),
            ("NONE", 3): build("NONE", ngram(3)), ("FULL", 2): build("FULL", ngram(2))}


@settings(deadline=None)
@given(seed=st.integers(0, 2**32 - 1), chunk=st.sampled_from([3, 32]),
       preemptions=st.dictionaries(st.integers(1, 10), st.sampled_from(["r0", "r1", "r2"]), max_size=2))
@pytest.mark.parametrize("key", [("NONE", 0), ("FULL", 0), ("NONE", 3), ("FULL", 2)])
def test_runner_counts_follow_the_history(counting_runners, key, seed, chunk, preemptions):
    import random
    rng = random.Random(seed)
    penal = [p for p in PARAMS if p.uses_penalties]
    workload = []
    for i in range(rng.randint(3, 6)):  # more requests than rows: rows are reused
        n = rng.randint(1, 20)
        prompt = repetitive(rng, n) if rng.random() < 0.5 else [rng.randrange(2048) for _ in range(n)]
        params = penal[i % len(penal)] if i % 3 != 2 else SamplingParams(temperature=0.0, max_tokens=6,
                                                                            ignore_eos=True)
        workload.append((prompt, params))
    driver = CountingDriver(counting_runners[key], chunk)
    for i, (prompt, params) in enumerate(workload):
        driver.add(f"r{i}", prompt, params)
    driver.run(preemptions)
    assert driver.checked > 0


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_native_fused_processing_matches_torch_and_replays_in_a_cuda_graph():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(1)
    rows, vocab, num, max_model_len = 9, 151_936, 8, 64
    s = random_states(g, rows, vocab, max_model_len, 3, device="cuda", max_bias=40)  # 40 of 64 padded slots
    features = SamplingFeatures(any_logit_bias=True, any_min_tokens=True, any_penalties=True)
    idx = torch.randperm(rows, generator=g)[:num].to(torch.int32).cuda()
    positions = torch.randint(2, max_model_len, (num,), generator=g).cuda()
    slot = torch.randint(0, 3, (num,), generator=g).cuda()
    logits = random_logits(g, num, vocab).cuda()
    fused, torch_impl = Sampler(s, _fused=True), Sampler(s, _fused=False)
    for args in ((None,), (slot,)):
        got = fused._process(logits, idx.long(), positions, features, None, *args).clone()
        assert_same(got, torch_impl._process(logits, idx.long(), positions, features, None, *args))
    out = torch.empty(num, dtype=torch.int32, device="cuda")
    fused(logits, idx, positions, features, out)  # warm-up (compiles) outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused(logits, idx, positions, features, out)
    for _ in range(3):
        logits.copy_(random_logits(g, num, vocab).cuda())
        graph.replay()
        want = torch.empty_like(out)
        torch_impl(logits, idx, positions, features, want)
        assert torch.equal(out, want)
