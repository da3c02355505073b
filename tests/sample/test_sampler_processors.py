"""Bias, allowed ids, min_tokens and penalties vs an independent numpy reference; batch
independence, all-features equivalence, validation and graph safety of the sampler."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.protocol import SamplingParams
from graphrunner.sample import processors
from graphrunner.sample.sampler import Sampler
from graphrunner.state.features import SamplingFeatures, round_logprobs
from graphrunner.state.sampling import SamplingStates
from tests.sample.test_sampler import make_states, run_sampler

EOS = (1,)


def reference_processed(logits: np.ndarray, p: SamplingParams, history: list[int], prompt_len: int,
                        seq_len: int, eos_ids=EOS) -> np.ndarray:
    """Per-row float64 reference of the processors (allowed, bias, min_tokens, penalties)."""
    x = logits.astype(np.float64).copy()
    if p.allowed_token_ids is not None:
        allowed = np.zeros(len(x), dtype=bool)
        allowed[list(p.allowed_token_ids)] = True
        x[~allowed] = -np.inf
    for token, bias in (p.logit_bias or {}).items():
        x[token] += bias
    num_output = max(seq_len - prompt_len, 0)
    if num_output < p.min_tokens:
        for token in list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids)):
            x[token] = -np.inf
    prompt, output = history[:prompt_len], history[prompt_len:seq_len]
    for token in set(prompt) | set(output):
        x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token in set(output):
        x[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return x


@st.composite
def requests(draw, vocab):
    """(params, history, prompt_len) with every processor possibly on."""
    prompt_len = draw(st.integers(1, 8))
    num_output = draw(st.integers(0, 8))
    n = prompt_len + num_output
    history = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    token = st.integers(0, vocab - 1)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=20,
        repetition_penalty=draw(st.sampled_from([1.0, 0.7, 1.3, 2.0])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.5, -0.4, 1.5])),
        presence_penalty=draw(st.sampled_from([0.0, 0.8, -1.0])),
        logit_bias=draw(st.dictionaries(token, st.floats(-5, 5, width=32), max_size=4)),
        allowed_token_ids=(allowed := draw(st.none() | st.lists(token, min_size=1, max_size=vocab, unique=True))),
        stop_token_ids=(stop := draw(st.lists(token, max_size=3))),
        ignore_eos=(ignore_eos := draw(st.booleans())),
        # min_tokens masking every allowed id is refused at admission: no token could be sampled.
        min_tokens=draw(st.integers(0, 10)) if allowed is None or not set(allowed) <= set(stop) | (
            set() if ignore_eos else set(EOS)) else 0,
    )
    return params, history, prompt_len


@settings(deadline=None)
@given(st.data(), st.integers(8, 32), st.integers(1, 5), st.integers(0, 2**31))
def test_greedy_is_argmax_after_processors_vs_numpy(data, vocab, n, seed):
    reqs = [data.draw(requests(vocab)) for _ in range(n)]
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    states = make_states([r[0] for r in reqs], vocab, histories=[r[1] for r in reqs],
                         prompt_lens=[r[2] for r in reqs], eos_ids=EOS)
    seq_lens = [len(r[1]) for r in reqs]
    out = run_sampler(states, logits, list(range(n)), seq_lens).numpy()
    for i, (p, history, prompt_len) in enumerate(reqs):
        ref = reference_processed(logits[i].numpy(), p, history, prompt_len, seq_lens[i])
        # float32 vs float64: the choice must be a maximum up to rounding.
        assert ref[out[i]] >= ref.max() - 1e-4 * max(1.0, abs(ref.max())), (i, out[i], ref)


@settings(deadline=None)
@given(st.data(), st.integers(8, 24), st.integers(0, 2**31))
def test_processor_functions_match_numpy(data, vocab, seed):
    n = 4
    reqs = [data.draw(requests(vocab)) for _ in range(n)]
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    states = make_states([r[0] for r in reqs], vocab, histories=[r[1] for r in reqs],
                         prompt_lens=[r[2] for r in reqs], eos_ids=EOS)
    rows = torch.arange(n)
    seq_len = torch.tensor([len(r[1]) for r in reqs])
    prompt_len = states.prompt_len[rows].long()
    x = processors.apply_allowed(logits, states.allowed_mask[rows], states.use_allowed[rows])
    x = processors.apply_logit_bias(x, states.bias_ids[rows], states.bias_values[rows])
    num_output = (seq_len - prompt_len).clamp(min=0)
    x = processors.apply_min_tokens(x, states.stop_ids[rows], states.min_tokens[rows], num_output)
    counts = processors.token_counts(states.all_token_ids, rows, prompt_len, seq_len, vocab)
    x = processors.apply_penalties(x, counts, states.repetition_penalty[rows], states.frequency_penalty[rows],
                                   states.presence_penalty[rows])
    for i, (p, history, pl) in enumerate(reqs):
        ref = reference_processed(logits[i].numpy(), p, history, pl, len(history))
        got = x[i].numpy().astype(np.float64)
        assert np.array_equal(np.isneginf(got), np.isneginf(ref)), (i, got, ref)
        fin = np.isfinite(ref)
        np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-5, atol=1e-5)


def test_resumed_request_counts_earlier_outputs_as_outputs():
    # A resumed request re-prefills prompt + outputs, but penalties and min_tokens must use
    # the ORIGINAL prompt length: its earlier outputs are outputs.
    vocab = 8
    history = [2, 3, 4, 4]  # prompt [2, 3]; outputs [4, 4] from before the preemption
    p = SamplingParams(temperature=0.0, frequency_penalty=1.0, min_tokens=3, max_tokens=5)
    logits = torch.zeros(1, vocab)
    logits[0, 4] = 1.5  # 1.5 - 2 * 1.0 = -0.5 after the penalty
    logits[0, 1] = 5.0  # EOS: masked (2 outputs < min_tokens = 3)
    logits[0, 5] = 0.2
    resumed = make_states([p], vocab, histories=[history], prompt_lens=[2], eos_ids=EOS)
    assert int(run_sampler(resumed, logits, [0], [4])[0]) == 5
    # Counted as prompt instead, token 4 would escape the frequency penalty.
    wrong = make_states([p], vocab, histories=[history], prompt_lens=[4], eos_ids=EOS)
    assert int(run_sampler(wrong, logits, [0], [4])[0]) == 4
    # And with min_tokens=2 the two earlier outputs already satisfy it: EOS is allowed.
    p2 = SamplingParams(temperature=0.0, frequency_penalty=1.0, min_tokens=2, max_tokens=5)
    resumed2 = make_states([p2], vocab, histories=[history], prompt_lens=[2], eos_ids=EOS)
    assert int(run_sampler(resumed2, logits, [0], [4])[0]) == 1


def test_min_tokens_masks_stop_ids_and_eos_until_reached():
    vocab, n = 16, 200
    p = SamplingParams(temperature=1.0, seed=3, min_tokens=4, stop_token_ids=[7], max_tokens=10)
    logits = torch.zeros(n, vocab)
    logits[:, 1] = 6.0  # EOS, overwhelmingly likely
    logits[:, 7] = 6.0  # a stop id, too
    prompt = [0, 2, 3]
    for num_output in range(0, 7):
        history = prompt + [5] * num_output
        states = make_states([p], vocab, histories=[history], prompt_lens=[len(prompt)], eos_ids=EOS)
        # n draws: positions differ, the output count is the same (seq_len stays fixed per draw
        # here, the noise is varied by drawing n requests with distinct seeds).
        many = [SamplingParams(temperature=1.0, seed=s, min_tokens=4, stop_token_ids=[7], max_tokens=10)
                for s in range(n)]
        states = make_states(many, vocab, histories=[history] * n, prompt_lens=[len(prompt)] * n, eos_ids=EOS)
        out = run_sampler(states, logits, list(range(n)), [len(history)] * n).numpy()
        stops = np.isin(out, [1, 7])
        if num_output < 4:
            assert not stops.any(), (num_output, out)
        else:
            assert stops.mean() > 0.9, (num_output, out)


def test_min_tokens_respects_ignore_eos():
    vocab = 8
    logits = torch.zeros(1, vocab)
    logits[0, 1] = 5.0
    p = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    states = make_states([p], vocab, histories=[[3, 4]], prompt_lens=[2], eos_ids=EOS)
    assert int(run_sampler(states, logits, [0], [2])[0]) == 1  # EOS is not a stop id here


def test_allowed_token_ids_only_those_drawn():
    vocab, n = 32, 2000
    allowed = [3, 9, 17, 31]
    p = SamplingParams(temperature=2.0, seed=1, allowed_token_ids=allowed)
    states = make_states([p], vocab)
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 3
    out = run_sampler(states, logits, [0] * n, list(range(n))).numpy()
    assert set(out.tolist()) == set(allowed)
    greedy = make_states([SamplingParams(temperature=0.0, allowed_token_ids=allowed)], vocab)
    g = run_sampler(greedy, logits[:50], [0] * 50, [1] * 50).numpy()
    assert np.array_equal(g, np.asarray(allowed)[logits[:50, allowed].argmax(-1).numpy()])


MIXED = [
    SamplingParams(temperature=0.8, seed=11, top_k=5, logprobs=2),
    SamplingParams(temperature=0.0, logit_bias={3: 2.0}, repetition_penalty=1.2),
    SamplingParams(temperature=1.2, top_p=0.7, min_p=0.05, seed=3, presence_penalty=0.5, logprobs=5),
    SamplingParams(temperature=1.0, seed=99, allowed_token_ids=[1, 2, 3, 4, 5, 6], min_tokens=2, max_tokens=4),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=0.0),
]


@settings(deadline=None)
@given(st.integers(0, 2**31), st.permutations(list(range(len(MIXED)))), st.integers(0, 500))
def test_seeded_rows_alone_vs_batch_and_all_on_vs_exact(seed, order, position):
    vocab = 40
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(MIXED), vocab, generator=g) * 2
    histories = [torch.randint(0, vocab, (6,), generator=g).tolist() for _ in MIXED]
    states = make_states(MIXED, vocab, histories=histories, prompt_lens=[4] * len(MIXED), eos_ids=EOS)
    all_on = SamplingFeatures.all_on()
    alone = []
    for i in range(len(MIXED)):
        exact = run_sampler(states, logits[i : i + 1], [i], [6 + position], num_logprobs=True)
        full = run_sampler(states, logits[i : i + 1], [i], [6 + position], features=all_on, num_logprobs=True)
        k = MIXED[i].logprobs
        assert int(exact[0][0]) == int(full[0][0])
        if k is not None:
            assert torch.equal(exact[1][:, : k + 1], full[1][:, : k + 1])
            assert torch.equal(exact[2][:, : k + 1], full[2][:, : k + 1])
            assert torch.equal(exact[3], full[3])
        alone.append(int(exact[0][0]))
    for features in (None, all_on):
        batched = run_sampler(states, logits[list(order)], list(order), [6 + position] * len(MIXED), features=features)
        assert batched.tolist() == [alone[i] for i in order]


def test_features_flags():
    states = make_states(
        [SamplingParams(temperature=0.0, top_k=3, min_p=0.5), SamplingParams(temperature=0.0, logit_bias={1: 1.0}),
         SamplingParams(temperature=1.0, top_p=0.5, logprobs=3), SamplingParams(temperature=0.0, min_tokens=1),
         SamplingParams(temperature=0.0, frequency_penalty=0.1)],
        10, eos_ids=EOS,
    )
    assert states.features(np.array([0])) == SamplingFeatures()
    assert states.features(np.array([0])).is_plain_greedy
    f1 = states.features(np.array([0, 1]))
    assert f1.any_logit_bias and not f1.any_random and not f1.is_plain_greedy
    f2 = states.features(np.array([2]))
    assert f2.any_random and f2.any_top_p and not f2.any_top_k and f2.num_logprobs == 5
    assert states.features(np.array([3])).any_min_tokens
    assert states.features(np.array([4])).any_penalties
    assert f1.graph_variant() == SamplingFeatures.all_on()
    assert f2.graph_variant() == SamplingFeatures.all_on()  # logprobs need the all-features graph
    assert SamplingFeatures().graph_variant() == SamplingFeatures()
    assert [round_logprobs(k) for k in (-1, 0, 1, 2, 5, 6, 20)] == [-1, 0, 1, 5, 5, 20, 20]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(min_p=1.5), "min_p=1.5"),
        (dict(repetition_penalty=0.0), "repetition_penalty=0.0"),
        (dict(frequency_penalty=2.5), "frequency_penalty=2.5"),
        (dict(presence_penalty=-3), "presence_penalty=-3"),
        (dict(min_tokens=-1), "min_tokens=-1"),
        (dict(min_tokens=20, max_tokens=10), "max_tokens=10"),
        (dict(prompt_logprobs=-2), "prompt_logprobs=-2"),
        (dict(allowed_token_ids=[]), "empty"),
        (dict(allowed_token_ids=[-1]), "negative"),
        (dict(logit_bias={"x": 1.0}), "'x'"),
        (dict(logit_bias={1: float("nan")}), "finite"),
        (dict(temperature=float("inf")), "temperature"),
    ],
)
def test_sampling_params_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_is_hashable_and_immutable():
    a = SamplingParams(logit_bias={"3": 1.5}, allowed_token_ids=[1, 2], stop_token_ids=[4])
    b = SamplingParams(logit_bias={3: 1.5}, allowed_token_ids=(1, 2), stop_token_ids=(4,))
    assert a == b and hash(a) == hash(b) and a.logit_bias[3] == 1.5
    with pytest.raises(TypeError):
        a.logit_bias[4] = 1.0


def _snapshot(states: SamplingStates):
    tensors = {k: v.clone() for k, v in vars(states).items() if isinstance(v, torch.Tensor)}
    mirrors = {k: v.copy() for k, v in vars(states).items() if isinstance(v, np.ndarray)}
    return tensors, mirrors


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(logit_bias={10: 1.0}), "logit_bias contains token id 10"),
        (SamplingParams(allowed_token_ids=[2, 10]), "allowed_token_ids contains token id 10"),
        (SamplingParams(min_tokens=1, stop_token_ids=[12]), "stop_token_ids contains token id 12"),
        (SamplingParams(logit_bias={i: 1.0 for i in range(5)}), "max_logit_bias=4"),
        (SamplingParams(min_tokens=1, stop_token_ids=[2, 3, 4]), "max_stop_ids=3"),
        (SamplingParams(logprobs=7), "max_logprobs=6"),
        (SamplingParams(prompt_logprobs=7), "max_logprobs=6"),
    ],
)
def test_add_request_rejects_before_any_state_change(params, message):
    vocab = 10
    states = make_states([SamplingParams(temperature=0.7, seed=1)], vocab, eos_ids=EOS,
                         max_logit_bias=4, max_stop_ids=3, max_logprobs=6)
    before = _snapshot(states)
    with pytest.raises(ValueError, match=message):
        states.validate(params, vocab, EOS, prompt_len=1)
    with pytest.raises(ValueError, match=message):
        states.add_request(0, "bad", params, vocab, prompt_len=1, eos_ids=EOS)
    states.apply_staged_writes()
    after = _snapshot(states)
    for k in before[0]:
        assert torch.equal(before[0][k], after[0][k]), k
    for k in before[1]:
        assert np.array_equal(before[1][k], after[1][k]), k


def test_runner_without_history_or_vocab_rejects_what_it_cannot_serve():
    states = SamplingStates(3, torch.device("cpu"))
    with pytest.raises(ValueError, match="all_token_ids"):
        states.add_request(0, "a", SamplingParams(repetition_penalty=1.1), 10, prompt_len=2)
    with pytest.raises(ValueError, match="vocab_size"):
        states.add_request(0, "a", SamplingParams(allowed_token_ids=[1]), 10, prompt_len=2)
    with pytest.raises(ValueError, match="prompt_len"):
        states.add_request(0, "a", SamplingParams(min_tokens=1), 10, eos_ids=EOS)
    # The all-features variant still runs on such states (the skipped stages are unused).
    states.add_request(0, "a", SamplingParams(temperature=0.0), 10)
    states.apply_staged_writes()
    logits = torch.randn(2, 10)
    out = torch.empty(2, dtype=torch.int32)
    Sampler(states)(logits, torch.tensor([0, 2], dtype=torch.int32), torch.tensor([3, 0]),
                    SamplingFeatures.all_on(), out)
    assert torch.equal(out.long(), logits.argmax(-1))


def test_reruns_over_the_same_buffers_follow_new_values():
    # Graph safety on CPU: one set of preallocated buffers, values changed in place between
    # calls (logits, positions, idx_mapping, state rows); each run must match a fresh run.
    vocab, R = 24, 4
    params_a = [SamplingParams(temperature=0.9, seed=i, top_k=6, presence_penalty=0.5, logprobs=3) for i in range(R)]
    params_b = [SamplingParams(temperature=0.0, logit_bias={i: 9.0}, frequency_penalty=0.3) for i in range(R)]
    states = make_states(params_a, vocab, histories=[[1, 2, 3]] * R, prompt_lens=[2] * R, eos_ids=EOS)
    sampler = Sampler(states)
    features = SamplingFeatures.all_on()
    logits = torch.zeros(R, vocab)
    idx = torch.zeros(R, dtype=torch.int32)
    pos = torch.zeros(R, dtype=torch.int32)
    out = torch.zeros(R, dtype=torch.int32)
    lp = torch.zeros(R, 21)
    ids = torch.zeros(R, 21, dtype=torch.int32)
    ranks = torch.zeros(R, dtype=torch.int32)

    def step():
        sampler(logits, idx, pos, features, out, out_logprobs=lp, out_logprob_ids=ids, out_ranks=ranks)
        return out.clone(), lp.clone(), ids.clone(), ranks.clone()

    g = torch.Generator().manual_seed(0)
    logits.copy_(torch.randn(R, vocab, generator=g))
    idx.copy_(torch.arange(R, dtype=torch.int32))
    pos.copy_(torch.full((R,), 3, dtype=torch.int32))
    first = step()
    fresh = run_sampler(states, logits.clone(), list(range(R)), [3] * R, features=features, num_logprobs=True)
    assert torch.equal(first[0], fresh[0]) and torch.equal(first[1], fresh[1])

    for row, p in enumerate(params_b):
        states.add_request(row, f"b{row}", p, vocab, prompt_len=2, eos_ids=EOS)
    states.apply_staged_writes()
    logits.copy_(torch.randn(R, vocab, generator=g))
    idx.copy_(torch.tensor([3, 2, 1, 0], dtype=torch.int32))
    pos.copy_(torch.tensor([3, 3, 3, 3], dtype=torch.int32))
    second = step()
    assert second[0].tolist() == [3, 2, 1, 0]  # the +9 bias of each (new) row wins
    fresh = run_sampler(states, logits.clone(), [3, 2, 1, 0], [3] * R, features=features, num_logprobs=True)
    assert torch.equal(second[0], fresh[0]) and torch.equal(second[1], fresh[1]) and torch.equal(second[3], fresh[3])


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager():
    vocab, R = 4096, 8
    params = [SamplingParams(temperature=0.9, seed=i, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                             logit_bias={i: 1.0}, logprobs=5) for i in range(R - 2)]
    params += [SamplingParams(temperature=0.0, presence_penalty=0.4), SamplingParams(temperature=0.0)]
    hist = [[(7 * i + j) % vocab for j in range(10)] for i in range(R)]
    states = make_states(params, vocab, histories=hist, prompt_lens=[6] * R, eos_ids=EOS, device="cuda")
    sampler = Sampler(states)
    features = SamplingFeatures.all_on()
    logits = torch.randn(R, vocab, device="cuda")
    idx = torch.arange(R, dtype=torch.int32, device="cuda")
    pos = torch.full((R,), 10, dtype=torch.int32, device="cuda")
    out = torch.zeros(R, dtype=torch.int32, device="cuda")
    lp = torch.zeros(R, 21, device="cuda")
    ids = torch.zeros(R, 21, dtype=torch.int32, device="cuda")
    ranks = torch.zeros(R, dtype=torch.int32, device="cuda")

    def step():
        sampler(logits, idx, pos, features, out, out_logprobs=lp, out_logprob_ids=ids, out_ranks=ranks)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for trial in range(3):
        logits.copy_(torch.randn(R, vocab, device="cuda"))
        pos.fill_(10 + trial)
        graph.replay()
        torch.cuda.synchronize()
        got = (out.clone(), lp.clone(), ids.clone(), ranks.clone())
        step()
        assert torch.equal(got[0], out) and torch.equal(got[2], ids) and torch.equal(got[3], ranks)
        torch.testing.assert_close(got[1], lp)


def test_sampled_variant_gives_the_all_features_tokens_on_plain_sampling_batches():
    """The SAMPLED graph variant skips penalties, bias, allowed ids, min_tokens and
    logprobs; on a batch that uses none of them it must sample exactly the tokens of
    the all-features variant (and of the batch's own features)."""
    vocab = 64
    params = [SamplingParams(temperature=0.7, top_k=5, seed=1), SamplingParams(temperature=1.3, top_p=0.8, seed=2),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, min_p=0.2, seed=3),
              SamplingParams(temperature=1.0, seed=4)]
    states = make_states(params, vocab, eos_ids=EOS)
    rows = list(range(len(params)))
    exact = states.features(np.array(rows))
    assert exact.is_plain_sampling and exact.graph_variant() == SamplingFeatures.sampled_only()
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(0)) * 2
    for position in range(6, 30):
        tokens = {
            name: run_sampler(states, logits, rows, [position] * len(rows), features=f).tolist()
            for name, f in (("exact", exact), ("sampled", SamplingFeatures.sampled_only()),
                            ("all", SamplingFeatures.all_on()))
        }
        assert tokens["sampled"] == tokens["all"] == tokens["exact"]
