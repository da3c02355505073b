"""One bad request must never poison the engine.

Every bad input raises ValueError (naming the value) before the request becomes live,
and afterwards the same `LLM` gives exactly the greedy tokens a fresh one gives. A step
that raises aborts its `generate` call's requests, so the next call works.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("graphrunner.runner", reason="graphrunner.runner is not importable")

from graphrunner.engine import LLM  # noqa: E402
from graphrunner.protocol import SEED_MAX, SEED_MIN, NewRequestData, SamplingParams  # noqa: E402

MODEL = "builtin:tiny-llama"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 300, 2, 901], [1000, 3, 44]]


def make_llm(**kw) -> LLM:
    kw = {"device": "cpu", "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 64,
          "num_kv_blocks": 64, "block_size": 4, **kw}
    return LLM(MODEL, **kw)


@pytest.fixture(scope="module")
def fresh_tokens() -> list[list[int]]:
    """The greedy tokens of PROMPTS on an LLM that never saw a bad request."""
    return [o.token_ids for o in make_llm().generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return make_llm()


@pytest.fixture(scope="module")
def async_llm() -> LLM:
    return make_llm(async_scheduling=True)


def assert_healthy(llm: LLM, fresh_tokens: list[list[int]]) -> None:
    """Nothing of a failed call is left, and a valid request gives the fresh-LLM tokens."""
    assert not llm.scheduler.has_unfinished_requests()
    assert llm.scheduler.block_allocator.num_free == llm.scheduler.num_blocks
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == fresh_tokens
    assert all(o.finish_reason == "length" for o in outs)
    assert not llm.scheduler.has_unfinished_requests()


# ---- SamplingParams: type and range of every field ------------------------------------

BAD_PARAMS = [
    (dict(seed="abc"), "seed='abc'"),
    (dict(seed=2**70), f"seed={2**70}"),
    (dict(seed=SEED_MAX + 1), f"seed={SEED_MAX + 1}"),
    (dict(seed=1.5), "seed=1.5"),
    (dict(top_k=2.5), "top_k=2.5"),
    (dict(top_k=-2), "top_k=-2"),
    (dict(top_k="5"), "top_k='5'"),
    (dict(max_tokens=2.5), "max_tokens=2.5"),
    (dict(max_tokens=True), "max_tokens=True"),
    (dict(max_tokens=0), "max_tokens=0"),
    (dict(max_tokens=None), "max_tokens=None"),
    (dict(min_tokens=2**40, max_tokens=2**41), f"min_tokens={2**40}"),
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(temperature="0.5"), "temperature='0.5'"),
    (dict(temperature=True), "temperature=True"),
    (dict(temperature=1e39), "float32 range"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(min_p=float("inf")), "min_p=inf"),
    (dict(repetition_penalty=-1), "repetition_penalty=-1"),
    (dict(presence_penalty=float("nan")), "presence_penalty=nan"),
    (dict(ignore_eos="yes"), "ignore_eos='yes'"),
    (dict(logprobs=1.0), "logprobs=1.0"),
    (dict(prompt_logprobs=True), "prompt_logprobs=True"),
    (dict(stop_token_ids=["5"]), r"stop_token_ids\[0\]='5'"),
    (dict(stop_token_ids=[1, 1.7]), r"stop_token_ids\[1\]=1.7"),
    (dict(stop_token_ids="12"), "stop_token_ids='12'"),
    (dict(allowed_token_ids=[3, -4]), "negative token id: -4"),
    (dict(allowed_token_ids=[True]), r"allowed_token_ids\[0\]=True"),
    (dict(logit_bias={1.7: 1.0}), "logit_bias key 1.7"),
    (dict(logit_bias={1: "big"}), r"logit_bias\[1\]='big'"),
    (dict(logit_bias={1: float("-inf")}), r"logit_bias\[1\]=-inf"),
    (dict(logit_bias=[1, 2]), r"logit_bias=\[1, 2\]"),
    (dict(logit_bias={1: 3.4e38}), r"logit_bias\[1\]=3.4e\+38 must be a finite float in \[-1e\+30, 1e\+30\]"),
]


@pytest.mark.parametrize("kwargs, match", BAD_PARAMS, ids=[str(k) for k, _ in BAD_PARAMS])
def test_bad_sampling_params_raise_a_value_error_naming_the_value(llm, fresh_tokens, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(PROMPTS, SamplingParams(**kwargs))
    assert_healthy(llm, fresh_tokens)


def test_valid_edge_values_are_accepted_and_normalised():
    p = SamplingParams(max_tokens=np.int64(5), seed=np.uint64(SEED_MAX), top_k=-1, temperature=1,
                       ignore_eos=np.bool_(True), stop_token_ids=np.array([1, 2]), logit_bias={"3": np.float32(1.5)})
    assert (p.max_tokens, p.seed, p.top_k, p.temperature, p.ignore_eos) == (5, SEED_MAX, -1, 1.0, True)
    assert type(p.max_tokens) is int and type(p.seed) is int and type(p.temperature) is float
    assert p.stop_token_ids == (1, 2) and all(type(t) is int for t in p.stop_token_ids)
    assert dict(p.logit_bias) == {3: 1.5}
    assert SamplingParams(seed=SEED_MIN).seed == SEED_MIN
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()
    assert hash(p) == hash(SamplingParams(**{f: getattr(p, f) for f in p.__dataclass_fields__}))


def test_extreme_valid_seeds_and_top_k_generate(llm, fresh_tokens):
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=s, top_k=k)
              for s, k in ((SEED_MIN, -1), (SEED_MAX, 2**40), (-1, 0))]
    outs = llm.generate([PROMPTS[0]] * 3, params)
    assert all(len(o.token_ids) <= 4 and all(0 <= t < llm.vocab_size for t in o.token_ids) for o in outs)
    assert_healthy(llm, fresh_tokens)


def test_params_changed_after_construction_are_caught_at_admission(llm, fresh_tokens):
    """A bad seed reaching the runner. Params mutated behind the
    frozen dataclass's back are re-checked before the request is queued."""
    for field, value in (("seed", "abc"), ("seed", 2**70), ("top_k", 2.5), ("max_tokens", 2.5)):
        params = SamplingParams(max_tokens=3)
        object.__setattr__(params, field, value)
        with pytest.raises(ValueError, match=f"{field}={value!r}"):
            llm.generate(PROMPTS, params)
        assert not llm.scheduler.has_unfinished_requests()
    assert_healthy(llm, fresh_tokens)


# ---- vocabulary-dependent checks (the runner's) ------------------------------------


VOCAB_PARAMS = [
    (dict(stop_token_ids=[5, 10**6]), "stop_token_ids contains token id 1000000 outside the vocabulary"),
    (dict(stop_token_ids=[2048]), "stop_token_ids contains token id 2048"),
    (dict(min_tokens=2, stop_token_ids=[2048]), "stop_token_ids contains token id 2048"),
    (dict(allowed_token_ids=[1, 5000]), "allowed_token_ids contains token id 5000"),
    (dict(logit_bias={9999: 1.0}), "logit_bias contains token id 9999"),
    (dict(logprobs=10**6), "logprobs=1000000 exceeds max_logprobs"),
    (dict(min_tokens=2, allowed_token_ids=[5, 7], stop_token_ids=[7, 5]), "no allowed token could be sampled"),
]


@pytest.mark.parametrize("kwargs, match", VOCAB_PARAMS)
def test_token_ids_outside_the_vocabulary_are_rejected(llm, fresh_tokens, kwargs, match):
    assert llm.vocab_size == 2048  # the messages above assume tiny-llama's vocabulary
    with pytest.raises(ValueError, match=match):
        llm.generate(PROMPTS, SamplingParams(**kwargs))
    assert_healthy(llm, fresh_tokens)


# ---- prompts ------------------------------------------------------------------------


BAD_PROMPTS = [
    ([1, 1.7, 3], "request '.*' prompt: token id 1.7 at position 1 is not an int"),
    ([1, "5"], "token id '5' at position 1 is not an int"),
    ([True, 2], "token id True at position 0 is not an int"),
    ([1, None], "token id None at position 1"),
    ([1, -1], "token id -1 is out of range"),
    ([1, 2048], "token id 2048 is out of range for vocab_size=2048"),
    ([], "prompt is empty"),
    (list(range(65)), "prompt length 65 exceeds max_model_len=64"),
    ("abc", "must be a list of token ids"),
]


@pytest.mark.parametrize("prompt, match", BAD_PROMPTS)
def test_bad_prompt_rejects_the_whole_call_up_front(llm, fresh_tokens, prompt, match):
    """The bad prompt is the second one: the first, valid, is not run either."""
    with pytest.raises(ValueError, match=match):
        llm.generate([PROMPTS[0], prompt], GREEDY)
    assert_healthy(llm, fresh_tokens)


def test_numpy_prompts_are_accepted(llm, fresh_tokens):
    outs = llm.generate([np.array(p, dtype=np.int64) for p in PROMPTS], GREEDY)
    assert [o.token_ids for o in outs] == fresh_tokens


def test_new_request_data_rejects_non_int_token_ids():
    with pytest.raises(ValueError, match="request 'r' prompt_token_ids: token id 1.7 at position 2 is not an int"):
        NewRequestData("r", [1, 2, 1.7], SamplingParams(), [0])
    with pytest.raises(ValueError, match="request 'r' output_token_ids: token id '5' at position 0"):
        NewRequestData("r", [1, 2], SamplingParams(), [0], output_token_ids=["5"])
    assert NewRequestData("r", [1, np.int32(2)], SamplingParams(), [0]).all_token_ids == [1, 2]


def test_bad_sampling_params_objects_are_type_errors(llm, fresh_tokens):
    with pytest.raises(TypeError, match=r"sampling_params\[1\] must be a SamplingParams, got dict"):
        llm.generate(PROMPTS, [GREEDY, {"temperature": 0.0}])
    with pytest.raises(TypeError, match="got dict"):
        llm.generate(PROMPTS, {"temperature": 0.0})
    assert_healthy(llm, fresh_tokens)


# ---- a step that raises aborts its call's requests ---------------------------------


def _fail_on_call(monkeypatch, obj, name: str, n: int) -> None:
    """Make `obj.name` raise RuntimeError on its n-th call (1-based) from now on."""
    orig = getattr(obj, name)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise RuntimeError(f"injected failure in {name}")
        return orig(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)


@pytest.mark.parametrize("engine", ["sync", "async"])
@pytest.mark.parametrize(
    "where, n",
    [("execute_model", 1), ("execute_model", 3), ("sample_tokens", 1), ("sample_tokens", 4)],
)
def test_failed_step_aborts_the_call_and_the_next_call_works(request, monkeypatch, fresh_tokens, engine, where, n):
    llm = request.getfixturevalue("llm" if engine == "sync" else "async_llm")
    with monkeypatch.context() as m:
        _fail_on_call(m, llm.runner, where, n)
        with pytest.raises(RuntimeError, match=f"injected failure in {where}"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True))
    assert not llm._in_flight
    assert_healthy(llm, fresh_tokens)
    assert_healthy(llm, fresh_tokens)  # and again: nothing stale is replayed


def test_failure_after_the_step_was_launched_drains_the_runner(llm, fresh_tokens, tmp_path):
    """record_batches pointing at a folder fails after execute_model, before sample_tokens."""
    llm.record_batches = tmp_path
    try:
        with pytest.raises(IsADirectoryError):
            llm.generate(PROMPTS, GREEDY)
    finally:
        llm.record_batches = None
    assert_healthy(llm, fresh_tokens)


def test_failed_scheduler_update_aborts_too(monkeypatch, llm, fresh_tokens):
    with monkeypatch.context() as m:
        _fail_on_call(m, llm.scheduler, "update_from_output", 2)
        with pytest.raises(RuntimeError, match="injected failure in update_from_output"):
            llm.generate(PROMPTS, GREEDY)
    assert_healthy(llm, fresh_tokens)


# ---- anything at any field: rejected up front, or served ---------------------------

FIELDS = ["max_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos", "stop_token_ids", "logprobs",
          "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias",
          "allowed_token_ids", "min_tokens", "prompt_logprobs"]

_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    st.integers(-(2**70), 2**70),
    st.sampled_from([SEED_MIN, SEED_MAX, SEED_MAX + 1, SEED_MIN - 1, 2**31, 2**64, 2047, 2048]),
    st.floats(-3, 3),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e39, 1e-45, 0.5, 2.5, -0.0]),
    st.text(max_size=4),
    st.sampled_from(["5", "abc", ""]),
    st.builds(np.int64, st.integers(-(2**63), 2**63 - 1)),
    st.builds(np.float32, st.floats(-3, 3, width=32)),
)
_WILD = st.one_of(
    _SCALARS,
    st.lists(_SCALARS, max_size=4),
    st.dictionaries(st.one_of(st.integers(-2, 2100), st.text(max_size=3), st.floats()), _SCALARS, max_size=3),
)
# Values near the valid ranges of some field.
_NEAR_VALID = st.one_of(
    st.integers(-2, 30),
    st.floats(-0.5, 2.5),
    st.lists(st.integers(-1, 2100), min_size=1, max_size=3),
    st.dictionaries(st.integers(-1, 2100), st.floats(-5, 5), max_size=2),
)
ANY_VALUE = st.one_of(_NEAR_VALID, _WILD)
# Valid values of each field (half the draws), so that the served branch runs too.
_TOKEN = st.integers(0, 2047)
VALID = {
    "max_tokens": st.one_of(st.integers(1, 12), st.builds(np.int64, st.integers(1, 12))),
    "temperature": st.floats(0, 2),
    "top_k": st.integers(-1, 3000),
    "top_p": st.floats(0.01, 1),
    "seed": st.integers(SEED_MIN, SEED_MAX),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(_TOKEN, max_size=3),
    "logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.1, 3),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.one_of(_TOKEN, _TOKEN.map(str)), st.floats(-50, 50), max_size=3),
    "allowed_token_ids": st.lists(_TOKEN, min_size=1, max_size=5),
    "min_tokens": st.integers(0, 4),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 20)),
}
assert set(VALID) == set(FIELDS)


@pytest.mark.parametrize("field", FIELDS)
@given(value=ANY_VALUE, valid=st.data())
def test_any_value_is_rejected_or_served(llm, fresh_tokens, field, value, valid):
    """A wild value is rejected at construction or served; a valid one (drawn too, so
    that every example serves something) is accepted and served alongside it."""
    params = [SamplingParams(**{"max_tokens": 4, field: valid.draw(VALID[field], label="valid")})]
    try:
        params.append(SamplingParams(**{"max_tokens": 4, field: value}))
    except ValueError:
        pass
    prompt = PROMPTS[0]
    try:
        outs = llm.generate([prompt] * len(params), params)
    except ValueError:
        # Only a vocabulary/limit check of the runner may still refuse, before anything ran.
        assert not llm.scheduler.has_unfinished_requests()
        outs = llm.generate([prompt], params[:1])
    for out, p in zip(outs, params, strict=False):
        assert all(0 <= t < llm.vocab_size for t in out.token_ids)
        assert 1 <= len(out.token_ids) <= min(p.max_tokens, llm.runner.max_model_len - len(prompt))
    assert not llm.scheduler.has_unfinished_requests()
    assert [o.token_ids for o in llm.generate([PROMPTS[0]], GREEDY)] == fresh_tokens[:1]
