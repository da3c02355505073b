"""A seeded request's tokens do not depend on its batch, the graph mode, or preemption.

Every sampling feature is on (penalties, min-p, top-k/top-p, logit bias, min_tokens,
logprobs), so the all-features graph variant is the one replayed; the same request runs
alone, inside a batch of differently-configured requests, and in a cache so small that
the scheduler preempts and recomputes; across NONE, PIECEWISE and (CPU-emulated) FULL.
"""

import pytest

from graphrunner import SamplingParams
from tests.capture.test_graph_modes import _llm

MODES = ["NONE", "PIECEWISE", "FULL_AND_PIECEWISE"]

SEEDED = SamplingParams(
    max_tokens=14, temperature=0.8, top_k=40, top_p=0.95, min_p=0.02, seed=1234, ignore_eos=True,
    repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2, logit_bias={7: 2.0, 11: -3.0},
    min_tokens=3, stop_token_ids=(5,), logprobs=2,
)
PROMPT = [17, 3, 99, 250, 4, 4, 8, 1023, 7, 7, 7]
OTHERS = [
    ([5, 6, 7, 8], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)),
    ([900, 901] * 9, SamplingParams(max_tokens=12, temperature=1.1, seed=5, ignore_eos=True)),
    ([42] * 23, SamplingParams(max_tokens=10, temperature=0.7, top_p=0.5, presence_penalty=1.0, seed=9,
                               ignore_eos=True)),
]


def _seeded_tokens(llm, with_others: bool) -> tuple[list[int], list[dict]]:
    prompts = [PROMPT] + ([p for p, _ in OTHERS] if with_others else [])
    params = [SEEDED] + ([q for _, q in OTHERS] if with_others else [])
    out = llm.generate(prompts, params)[0]
    return out.token_ids, out.logprobs


@pytest.fixture(scope="module")
def alone_in_eager():
    return _seeded_tokens(_llm("NONE"), with_others=False)


@pytest.mark.parametrize("mode", MODES)
def test_seeded_request_same_alone_batched_and_preempted(mode, alone_in_eager):
    tokens, logprobs = alone_in_eager
    assert len(tokens) >= SEEDED.min_tokens
    llm = _llm(mode)
    assert _seeded_tokens(llm, with_others=False)[0] == tokens
    batched_tokens, batched_lp = _seeded_tokens(llm, with_others=True)
    assert batched_tokens == tokens
    # Logprobs of the raw distribution: the same tokens with the same values and ranks.
    assert [sorted(d) for d in batched_lp] == [sorted(d) for d in logprobs]
    for got, want in zip(batched_lp, logprobs, strict=True):
        for tok, lp in want.items():
            assert got[tok].rank == lp.rank and got[tok].logprob == pytest.approx(lp.logprob, abs=1e-4)

    small = _llm(mode, num_kv_blocks=14, max_num_batched_tokens=16)
    preempted_tokens, _ = _seeded_tokens(small, with_others=True)
    assert small.scheduler.num_preemptions > 0
    assert preempted_tokens == tokens
