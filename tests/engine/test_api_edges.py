"""The edges of `LLM`'s API: interleaved calls, the containers it takes, a closed LLM.

- Streams interleaved with each other and with `generate` on the same LLM each get every
  token and the finish_reason of their own requests (what a lone call gets), sync and async.
- One rule for containers: `prompts` is a prompt or an ordered iterable of prompts (a
  generator too); a prompt's token ids an ordered sequence (list, tuple, range, numpy array).
  None, sets, bytes and bytearrays are TypeErrors naming the type, and nothing is queued.
  `abort_request` takes a str or an iterable of str (TypeError otherwise).
- After `shutdown()`, every call that would run a step raises RuntimeError saying so.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from graphrunner.engine import LLM
from graphrunner.protocol import SamplingParams

MODEL = "builtin:tiny-llama"
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 300, 2, 901], [1000, 3, 44], [7, 7, 8]]


def make_llm(**kw) -> LLM:
    kw = {"device": "cpu", "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 64,
          "num_kv_blocks": 64, "block_size": 4, **kw}
    return LLM(MODEL, **kw)


@pytest.fixture(scope="module")
def engines() -> dict[str, LLM]:
    return {"sync": make_llm(), "async": make_llm(async_scheduling=True)}


@pytest.fixture(scope="module")
def fresh() -> list[list[int]]:
    return [o.outputs[0].token_ids for o in make_llm().generate(PROMPTS, GREEDY, use_tqdm=False)]


# ---- interleaved streams and generates -------------------------------------------------------

# Each action: ("next", stream) reads one delta of a stream (started on its first read), or
# ("generate", prompt) runs a whole generate in between.
ACTIONS = st.lists(st.one_of(st.tuples(st.just("next"), st.integers(0, 2)),
                             st.tuples(st.just("generate"), st.integers(0, 2))), max_size=12)


@pytest.mark.parametrize("engine", ["sync", "async"])
@given(actions=ACTIONS)
@example(actions=[("next", 0), ("generate", 1), ("next", 0)])
@example(actions=[("next", 0), ("next", 1), ("next", 0), ("next", 1)])
def test_interleaved_streams_and_generates_each_get_all_their_tokens(engines, fresh, engine, actions):
    llm = engines[engine]
    streams = [llm.generate_stream([PROMPTS[i]], GREEDY) for i in range(3)]
    tokens: list[list[int]] = [[], [], []]
    reasons: list[str | None] = [None, None, None]

    def read(i: int) -> bool:
        out = next(streams[i], None)
        if out is None:
            return False
        tokens[i] += out.outputs[0].token_ids
        reasons[i] = out.outputs[0].finish_reason
        return True

    for kind, i in actions:
        if kind == "next":
            read(i)
        else:
            assert llm.generate([PROMPTS[i]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == fresh[i]
    for i in range(3):
        while read(i):
            pass
    assert tokens == fresh and reasons == ["length"] * 3
    assert not llm.has_unfinished_requests() and not llm._stream_boxes
    assert llm.scheduler.block_allocator.num_free == llm.scheduler.num_blocks


def test_a_stream_whose_requests_another_call_aborted_raises():
    """A failed generate aborts every live request: an open stream says so instead of ending quietly."""
    llm = make_llm()
    stream = llm.generate_stream([PROMPTS[0]], GREEDY)
    next(stream)
    orig, calls = llm.runner.sample_tokens, []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return orig(*args, **kwargs)

    llm.runner.sample_tokens = fail_once
    try:
        with pytest.raises(RuntimeError, match="injected"):
            llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)
    finally:
        del llm.runner.sample_tokens
    with pytest.raises(RuntimeError, match=r"requests \['\d+'\] of this stream ended without their last output"):
        list(stream)
    assert llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"


# ---- one rule for containers -------------------------------------------------------------------

OUTER = {  # how a call's prompts come
    "list": list, "tuple": tuple, "generator": lambda ps: (p for p in ps),
    "set": lambda ps: set(map(tuple, ps)), "None": lambda ps: None, "bytes": lambda ps: b"\x05\x06",
    "bytearray": lambda ps: bytearray(b"\x05\x06"), "int": lambda ps: 5,
}
INNER = {  # how a prompt's token ids come
    "list": list, "tuple": tuple, "range": lambda p: p, "numpy": np.array,
    "set": set, "frozenset": frozenset, "bytes": bytes, "bytearray": bytearray,
}
PROMPT_RANGES = [range(5, 9), range(100, 103)]  # distinct ids in order: every container keeps them


@given(outer=st.sampled_from(sorted(OUTER)), inner=st.sampled_from(sorted(INNER)))
def test_prompt_containers_follow_one_rule(engines, outer, inner):
    llm = engines["sync"]
    prompts = OUTER[outer]([INNER[inner](r) for r in PROMPT_RANGES])
    if outer in ("None", "set", "bytes", "bytearray", "int"):
        with pytest.raises(TypeError, match="prompts must be"):
            llm.generate(prompts, GREEDY, use_tqdm=False)
    elif inner in ("set", "frozenset", "bytes", "bytearray"):
        with pytest.raises(TypeError, match=f"prompt 0: token ids must be a list .* got {inner}"):
            llm.generate(prompts, GREEDY, use_tqdm=False)
    else:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.prompt_token_ids for o in outs] == [list(r) for r in PROMPT_RANGES]
    assert not llm.has_unfinished_requests()


@pytest.mark.parametrize("bad", [5, None, b"0", [5], ["0", 1]])
def test_abort_request_takes_ids_that_are_strings(engines, bad):
    with pytest.raises(TypeError, match="request_id must be a request id"):
        engines["sync"].abort_request(bad)


def test_abort_request_takes_one_id_or_an_iterable_of_them(engines):
    llm = engines["sync"]
    llm.abort_request("no such request")
    llm.abort_request(["a", "b"])
    llm.abort_request(r for r in ("c",))
    assert not llm.has_unfinished_requests()


def test_calls_after_shutdown_raise_a_clear_error():
    llm = make_llm()
    llm.shutdown()
    llm.shutdown()  # idempotent
    for call in (lambda: llm.generate(PROMPTS, GREEDY), lambda: llm.generate_stream(PROMPTS, GREEDY),
                 lambda: llm.add_request("x", PROMPTS[0], GREEDY), lambda: llm.step(), lambda: llm.step_outputs()):
        with pytest.raises(RuntimeError, match="this LLM was shut down"):
            call()
