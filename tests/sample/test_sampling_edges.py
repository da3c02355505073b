"""Edges of the sampling settings, end to end on the engine.

- A temperature below GREEDY_TEMPERATURE (1e-5, vLLM's rule), denormals included, is
  greedy: the tokens are the argmax's, whatever the seed; 1e-5 itself samples.
- A sampled token is always one of `allowed_token_ids`: a combination that would mask every
  allowed id (min_tokens masking allowed stop ids) is refused before the request is queued,
  and no allowed logit_bias can push every allowed token to -inf.
- logit_bias values are limited to [-1e30, 1e30]: within it a bias outweighs every logit at
  every temperature (the tokens biased the most are the ones sampled); beyond it, a
  ValueError names the value and the limit.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from graphrunner.engine import LLM
from graphrunner.protocol import GREEDY_TEMPERATURE, LOGIT_BIAS_MAX, SamplingParams

MODEL = "builtin:tiny-llama"
PROMPT = [5, 17, 300, 2, 901]
TOKEN = st.integers(0, 2047)
TEMPERATURES = st.sampled_from([1e-5, 1e-3, 0.1, 0.5, 1.0, 2.0])


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, device="cpu", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, num_kv_blocks=64,
               block_size=4)


@pytest.fixture(scope="module")
def greedy_tokens(llm) -> list[int]:
    return llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0].token_ids


def _tokens(llm: LLM, params: SamplingParams) -> list[int]:
    return llm.generate([PROMPT], params, use_tqdm=False)[0].token_ids


# ---- greedy below 1e-5 ---------------------------------------------------------------------

BELOW = np.nextafter(GREEDY_TEMPERATURE, 0.0)


@given(temperature=st.one_of(st.floats(0.0, GREEDY_TEMPERATURE, exclude_max=True),
                             st.sampled_from([5e-324, 1e-45, 1e-40, 1e-38, float(BELOW)])),
       seed=st.integers(0, 2**32))
@example(temperature=1e-45, seed=1)  # a float32 denormal: logits / T overflowed to inf
def test_temperatures_below_the_threshold_are_greedy(llm, greedy_tokens, temperature, seed):
    params = SamplingParams(max_tokens=6, temperature=temperature, seed=seed, ignore_eos=True)
    assert params.is_greedy
    assert _tokens(llm, params) == greedy_tokens


def test_the_threshold_itself_samples():
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).is_greedy
    assert SamplingParams(temperature=float(BELOW)).is_greedy


# ---- never a token outside allowed_token_ids ---------------------------------------------

EXTREME_BIAS = st.sampled_from([-3.4e38, -LOGIT_BIAS_MAX, -1e20, -100.0, 0.0, 5.0, LOGIT_BIAS_MAX, 3.4e38])


POOL = st.sampled_from([3, 7, 9, 11, 500])  # few ids: stop ids often cover the allowed ones


@given(allowed=st.lists(POOL, min_size=1, max_size=3, unique=True), stop=st.lists(POOL, max_size=3, unique=True),
       min_tokens=st.integers(0, 3), bias=st.dictionaries(POOL, EXTREME_BIAS, max_size=3), temperature=TEMPERATURES)
@example(allowed=[7], stop=[7], min_tokens=2, bias={}, temperature=1.0)  # the only allowed token is masked
@example(allowed=[7, 9], stop=[], min_tokens=0, bias={7: -LOGIT_BIAS_MAX, 9: -LOGIT_BIAS_MAX}, temperature=1e-5)
@example(allowed=[7], stop=[], min_tokens=0, bias={7: -3.4e38}, temperature=0.5)  # -inf once divided by T
def test_no_token_outside_the_allowed_set(llm, allowed, stop, min_tokens, bias, temperature):
    kwargs = dict(max_tokens=4, temperature=temperature, seed=3, allowed_token_ids=allowed, stop_token_ids=stop,
                  min_tokens=min_tokens, logit_bias=bias, ignore_eos=True)
    if any(abs(v) > LOGIT_BIAS_MAX for v in bias.values()):
        with pytest.raises(ValueError, match="must be a finite float in"):
            SamplingParams(**kwargs)
        return
    params = SamplingParams(**kwargs)
    next_id = llm._next_req_id
    if min_tokens and set(stop) >= set(allowed):
        with pytest.raises(ValueError, match="no allowed token could be sampled"):
            llm.generate([PROMPT], params, use_tqdm=False)
        assert llm._next_req_id == next_id and not llm.scheduler.has_unfinished_requests()  # refused up front
        return
    tokens = _tokens(llm, params)
    assert tokens and set(tokens) <= set(allowed), (tokens, allowed)


# ---- logit_bias within [-1e30, 1e30] --------------------------------------------------------

BIAS_VALUES = st.one_of(
    st.floats(-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX),
    st.sampled_from([LOGIT_BIAS_MAX, -LOGIT_BIAS_MAX, 1e29, 3.4e38, -3.4e38, 1e31, math.nextafter(1e30, 2e30)]),
)


@given(bias=st.dictionaries(TOKEN, BIAS_VALUES, min_size=1, max_size=3), temperature=TEMPERATURES)
@example(bias={11: 3.4e38, 12: 3.4e38}, temperature=0.5)  # inf - inf in the softmax once divided by T
@example(bias={11: LOGIT_BIAS_MAX, 12: LOGIT_BIAS_MAX}, temperature=1e-5)
def test_logit_bias_is_limited_and_outweighs_every_logit(llm, bias, temperature):
    kwargs = dict(max_tokens=3, temperature=temperature, seed=5, logit_bias=bias, ignore_eos=True)
    if any(abs(v) > LOGIT_BIAS_MAX for v in bias.values()):
        with pytest.raises(ValueError, match=r"logit_bias\[\d+\]=\S+ must be a finite float in \[-1e\+30, 1e\+30\]"):
            SamplingParams(**kwargs)
        return
    tokens = _tokens(llm, SamplingParams(**kwargs))
    assert tokens and all(0 <= t < llm.vocab_size for t in tokens)
    top = max(bias.values())
    if top >= 1e20:  # beyond any logit: only the tokens biased (nearly) the most can be drawn
        favoured = {t for t, v in bias.items() if np.float32(v) >= np.float32(top) * (1 - 1e-6)}
        assert set(tokens) <= favoured, (tokens, bias)
