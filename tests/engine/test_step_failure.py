"""Whatever step raises, and with whatever exception, the engine stays consistent.

A call's first step carries the ids of the requests the previous call finished (the runner
frees their rows and KV blocks with it). When that step raises (a bad value the runner
refuses, an interrupt), the next plan carries them again: every row the runner holds
belongs to a request the scheduler runs or is about to announce as finished, and the
engine then serves exactly what a fresh one serves, without a KV block leaked.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from graphrunner.engine import LLM
from graphrunner.protocol import SamplingParams

MODEL = "builtin:tiny-llama"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 300, 2, 901], [1000, 3, 44]]
ERRORS = (RuntimeError, ValueError, KeyboardInterrupt)


def make_llm(**kw) -> LLM:
    kw = {"device": "cpu", "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 64,
          "num_kv_blocks": 64, "block_size": 4, **kw}
    return LLM(MODEL, **kw)


@pytest.fixture(scope="module")
def fresh_tokens() -> list[list[int]]:
    return [o.token_ids for o in make_llm().generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def engines() -> dict[str, LLM]:
    return {"sync": make_llm(), "async": make_llm(async_scheduling=True)}


@contextmanager
def raising(obj, name: str, n: int, error: type[BaseException]):
    """`obj.name` raises `error` on its n-th call (1-based) inside the block; n = 0: never."""
    orig, calls = getattr(obj, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise error(f"injected failure in {name}")
        return orig(*args, **kwargs)

    setattr(obj, name, wrapper)
    try:
        yield
    finally:
        delattr(obj, name)  # the class's method again


def assert_rows_accounted_for(llm: LLM) -> None:
    """Every request row the runner holds is running in the scheduler or announced by its next plan."""
    scheduler = llm.scheduler
    known = {r.req_id for r in scheduler.running} | scheduler._finished_req_ids
    held = set(llm.runner.state.requests.req_id_to_index)
    assert held <= known, f"rows the scheduler forgot: {sorted(held - known)}"


def assert_serves_like_fresh(llm: LLM, fresh_tokens: list[list[int]]) -> None:
    assert not llm.scheduler.has_unfinished_requests() and not llm._in_flight
    assert llm.scheduler.block_allocator.num_free == llm.scheduler.num_blocks
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == fresh_tokens
    assert_rows_accounted_for(llm)


CALLS = st.lists(
    st.tuples(st.integers(0, 4), st.sampled_from(["execute_model", "sample_tokens"]), st.sampled_from(ERRORS)),
    min_size=1, max_size=5,
)


@pytest.mark.parametrize("engine", ["sync", "async"])
@given(calls=CALLS)
# A call whose first step raises, right after a call that finished its requests.
@example(calls=[(0, "execute_model", RuntimeError)] + [(1, "execute_model", KeyboardInterrupt)] * 5)
def test_a_step_that_raises_leaves_the_engine_consistent(engines, fresh_tokens, engine, calls):
    """Calls of `generate`, each with its n-th execute_model or sample_tokens raising (n = 0:
    none): every runner row stays accounted for, and the engine then serves like a fresh one."""
    llm = engines[engine]
    for n, where, error in calls:
        with raising(llm.runner, where, n, error):
            try:
                outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            except error as e:
                assert str(e) == f"injected failure in {where}"
            else:
                assert [o.token_ids for o in outs] == fresh_tokens
        assert not llm.scheduler.has_unfinished_requests() and not llm._in_flight
        assert_rows_accounted_for(llm)
    assert_serves_like_fresh(llm, fresh_tokens)


# ---- chaos: any interleaving of calls, with any step raising ---------------------------------

HOOKS = [("runner", "execute_model"), ("runner", "sample_tokens"), ("scheduler", "schedule"),
         ("scheduler", "update_from_output")]
FAULT = st.one_of(st.none(), st.tuples(st.sampled_from(HOOKS), st.integers(1, 3), st.sampled_from(ERRORS)))
REQUEST = st.tuples(
    st.lists(st.integers(0, 2047), min_size=1, max_size=12),
    st.builds(SamplingParams, max_tokens=st.integers(1, 8), temperature=st.sampled_from([0.0, 0.8]),
              seed=st.integers(0, 9), ignore_eos=st.just(True)),
)
OPS = st.lists(st.one_of(
    st.tuples(st.just("generate"), st.lists(REQUEST, min_size=1, max_size=3), FAULT),
    st.tuples(st.just("open stream"), st.lists(REQUEST, min_size=1, max_size=2), st.none()),
    st.tuples(st.just("read stream"), st.integers(0, 3), FAULT),
    st.tuples(st.just("close stream"), st.integers(0, 3), st.none()),
    st.tuples(st.just("abort"), st.integers(0, 12), st.none()),
    st.tuples(st.just("step"), st.none(), FAULT),
), max_size=10)


@contextmanager
def fault(llm: LLM, spec):
    if spec is None:
        yield
        return
    (owner, name), n, error = spec
    with raising(getattr(llm, owner), name, n, error):
        yield


@pytest.mark.parametrize("engine", ["sync", "async"])
@given(ops=OPS)
def test_chaos_leaves_an_engine_that_serves_like_a_fresh_one(engines, fresh_tokens, engine, ops):
    """Random interleavings of generate, streams (opened, read, left), abort and step, with an
    exception injected at a step's hook points; afterwards nothing is live, no KV block is
    held, every runner row is accounted for, and the engine serves like a fresh one."""
    run_chaos(engines[engine], ops, fresh_tokens)


def run_chaos(llm: LLM, ops, fresh_tokens: list[list[int]]) -> None:
    """One interleaving `ops` (OPS) on `llm`, then the fresh-engine checks (also run on each rank of a
    TP2 world: tests/distributed/test_dist_step_failure.py)."""
    streams: list = []
    for kind, arg, spec in ops:
        try:
            with fault(llm, spec):
                if kind == "generate":
                    prompts, params = zip(*arg, strict=True)
                    outs = llm.generate(list(prompts), list(params), use_tqdm=False)
                    assert all(o.finished and o.outputs[0].finish_reason in ("length", "abort") for o in outs)
                elif kind == "open stream":
                    prompts, params = zip(*arg, strict=True)
                    streams.append(llm.generate_stream(list(prompts), list(params)))
                elif kind == "read stream" and streams:
                    next(streams[arg % len(streams)], None)
                elif kind == "close stream" and streams:
                    streams.pop(arg % len(streams)).close()
                elif kind == "abort":
                    llm.abort_request(str(arg))
                elif kind == "step":
                    llm.step()
        except ERRORS as e:
            # The injected failure, or a stream whose requests a failed step of another call aborted.
            assert "injected failure in" in str(e) or "of this stream ended without" in str(e), e
        assert_rows_accounted_for(llm)
    for stream in streams:
        stream.close()
    while llm.has_unfinished_requests():
        llm.step()
    assert_serves_like_fresh(llm, fresh_tokens)
