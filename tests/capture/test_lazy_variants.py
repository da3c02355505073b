"""The all-features sampler variant captured on first use gives the tokens of one captured up front.

Start-up captures the greedy and sampled variants of every FULL descriptor; a batch needing the
all-features variant captures it in the middle of its step (after its upload, KV blocks of the
scratch row saved and restored) and replays it. On a CPU FULL graphs are emulated, so this checks
the buffer discipline of that mid-run capture: a live request's KV, rows and inputs survive it.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner import LLM, SamplingParams
from graphrunner.step.graphs import ALL_FEATURES, GREEDY, SAMPLED


def _llm(lazy: bool) -> LLM:
    # Two KV blocks of 4 tokens per request at most: live requests hold block 0, which the dummy
    # capture step writes.
    return LLM("builtin:tiny-llama", device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
               max_model_len=48, block_size=4, num_kv_blocks=48, seed=0, enforce_eager=False,
               cudagraph_mode="FULL", cudagraph_capture_sizes=(1, 2, 4, 8, 16, 32), compile_backend="eager",
               lazy_sampler_variants=lazy, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def pair():
    return _llm(lazy=True), _llm(lazy=False)


def _variants(llm: LLM) -> set:
    return {v for (_, v) in llm.runner.graphs.full_graphs}


def test_start_up_captures_only_the_common_variants(pair):
    lazy, eager = pair
    assert _variants(eager) == {GREEDY, SAMPLED, ALL_FEATURES}
    lazy_descs = {d for (d, _) in lazy.runner.graphs.full_graphs}
    assert lazy_descs == {d for (d, _) in eager.runner.graphs.full_graphs}
    assert ALL_FEATURES not in _variants(lazy)  # the first test of the module: nothing ran yet


workloads = st.lists(
    st.tuples(
        st.lists(st.integers(0, 2047), min_size=1, max_size=20),  # prompt
        st.integers(1, 10),  # max_tokens
        st.sampled_from(["greedy", "sampled", "penalty", "logprobs"]),
    ),
    min_size=1,
    max_size=4,
)


def _params(kind: str, n: int, i: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
    if kind == "sampled":
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.8, top_k=20, seed=i)
    if kind == "penalty":
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, repetition_penalty=1.3,
                              presence_penalty=0.5)
    return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.7, seed=i, logprobs=2)


@settings(max_examples=6, deadline=None)
@given(workloads)
def test_lazily_captured_variant_gives_the_eager_capture_tokens(pair, workload):
    lazy, eager = pair
    prompts = [w[0] for w in workload]
    params = [_params(kind, n, i) for i, (_, n, kind) in enumerate(workload)]
    got = lazy.generate(prompts, params, use_tqdm=False)
    want = eager.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.outputs[0].logprobs for o in got] == [o.outputs[0].logprobs for o in want]


def _staggered(llm: LLM, tag: str = "") -> dict[str, list[int]]:
    """A greedy request decodes a few steps (its prompt's KV in the first blocks the allocator
    hands out, block 0 on a fresh engine), then a penalty request joins: its first step needs
    the all-features variant while the greedy one's KV is live."""
    greedy = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)
    penalty = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0, repetition_penalty=1.5)
    llm.add_request(tag + "a", [5, 6, 7, 8, 9, 10], greedy, stream=False)
    tokens: dict[str, list[int]] = {}
    for _ in range(3):
        tokens.update({o.request_id.removeprefix(tag): o.outputs[0].token_ids for o in llm.step_outputs()[0]})
    llm.add_request(tag + "b", [11, 12, 13], penalty, stream=False)
    while llm.has_unfinished_requests():
        tokens.update({o.request_id.removeprefix(tag): o.outputs[0].token_ids for o in llm.step_outputs()[0]})
    return tokens


def test_first_use_mid_run_keeps_live_requests_intact(pair):
    """On a fresh engine the live greedy request holds KV block 0, which the capture's dummy step
    writes: the capture restores it, and the variant is captured once."""
    _, eager = pair
    fresh = _llm(lazy=True)
    graphs = fresh.runner.graphs
    assert ALL_FEATURES not in _variants(fresh)
    got, want = _staggered(fresh), _staggered(eager)
    assert got == want and set(got) == {"a", "b"}
    assert ALL_FEATURES in _variants(fresh)
    keys, generation = set(graphs.full_graphs), graphs.generation
    assert _staggered(fresh, "again-") == want
    assert set(graphs.full_graphs) == keys and graphs.generation == generation  # nothing captured anew
