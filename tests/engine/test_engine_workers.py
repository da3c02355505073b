"""In-process parallel workers: `LLM(tensor_parallel_size=2)` from a plain process starts its ranks itself.

The caller is this pytest process (no WORLD_SIZE in its environment, so `LLM` returns a
`WorkerLLM`); the ranks are spawned, run SPMD over gloo, and rank 0's outputs come back. They
must equal a single-process run; an error in a rank must surface here with the rank's
traceback; shutdown (and a failed start) must leave no process behind.
"""

from __future__ import annotations

import os
import re

import pytest

from graphrunner.engine.workers import WorkerError, WorkerLLM

ARGS = dict(device="cpu", num_kv_blocks=48, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=96, seed=3,
            collective_timeout_s=30.0)
PROMPTS = [[1 + i, 5, 9, 13 + i, 100 + i] for i in range(4)] + [[7] * 20]


@pytest.fixture(autouse=True)
def _plain_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


def _params():
    from graphrunner.protocol import SamplingParams

    return SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def test_llm_with_tp2_starts_its_workers_and_matches_one_process() -> None:
    from graphrunner.engine.llm import LLM

    with LLM("builtin:tiny-llama", **ARGS) as single:
        reference = [o.token_ids for o in single.generate(PROMPTS, _params())]
    llm = LLM("builtin:tiny-llama", tensor_parallel_size=2, **ARGS)
    assert isinstance(llm, WorkerLLM) and llm.world_size == 2
    procs = llm.processes
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, _params())] == reference
        assert [o.token_ids for o in llm.generate(PROMPTS[:2], _params())] == reference[:2]  # calls repeat
        with pytest.raises(ValueError, match="out of range") as info:  # a bad token id: raised as `LLM` raises it
            llm.generate([[1, 2, 10**9]], _params())
        assert isinstance(info.value.__cause__, WorkerError)  # with every rank's traceback
        assert re.search(r"rank 0 raised during generate\(\):(.|\n)*ValueError", str(info.value.__cause__))
        assert [o.token_ids for o in llm.generate(PROMPTS[:1], _params())] == reference[:1]  # still serving
    finally:
        llm.shutdown()
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(RuntimeError, match="after shutdown"):
        llm.generate(PROMPTS, _params())


def test_a_rank_that_fails_to_start_surfaces_its_traceback_and_leaves_nothing() -> None:
    from graphrunner.engine.llm import LLM

    with pytest.raises(ValueError, match="unknown builtin model") as info:
        WorkerLLM(2, LLM, ("builtin:no-such-model",), dict(tensor_parallel_size=2, **ARGS))
    assert re.search("rank 0 raised during start(.|\n)*unknown builtin model", str(info.value.__cause__))
    import multiprocessing

    assert not [p for p in multiprocessing.active_children() if p.name.startswith("SpawnProcess")]
    assert "WORLD_SIZE" not in os.environ


def _tp2(**overrides):
    from graphrunner.engine.llm import LLM

    return LLM("builtin:tiny-llama", tensor_parallel_size=2, **{**ARGS, **overrides})


def test_a_stalled_rank_ends_the_call_within_the_collective_timeout_and_later_calls_name_it() -> None:
    """Rank 1 stopped (SIGSTOP): rank 0's collective times out, and the parent stops waiting for
    rank 1 a margin later instead of hanging; every later call raises with that cause."""
    import signal
    import time

    llm = _tp2(collective_timeout_s=2.0)
    procs = llm.processes
    llm.reply_timeout_s = 4.0  # the margin past the collective timeout, shortened for the test
    try:
        os.kill(procs[1].pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"rank 1: no reply to generate\(\) within 4 s \(stalled\)"):
            llm.generate(PROMPTS[:1], _params())
        assert time.monotonic() - start < 2.0 + 4.0 + 5.0
        with pytest.raises(WorkerError, match=r"(?s)generate\(\): the worker ranks are gone; they ended on:.*rank 1"):
            llm.generate(PROMPTS[:1], _params())
    finally:
        llm.shutdown()
    assert not any(p.is_alive() for p in procs)


def test_a_rank_killed_between_calls_is_named_by_the_next_call() -> None:
    import signal

    llm = _tp2()
    procs = llm.processes
    try:
        assert len(llm.generate(PROMPTS[:1], _params())) == 1
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].join(10)
        for _ in range(2):  # the first call finds it gone; later ones repeat the cause (no BrokenPipeError)
            with pytest.raises(WorkerError, match=r"rank 1 exited \(code -9\)"):
                llm.generate(PROMPTS[:1], _params())
    finally:
        llm.shutdown()
    assert not any(p.is_alive() for p in procs)
