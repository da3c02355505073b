"""A raising step in a TP2 world (gloo) leaves the engine consistent on every rank: the same
failures as tests/engine/test_step_failure.py, injected alike on both ranks (an SPMD engine
fails on every rank, or its peers would wait in a collective), sync and async; afterwards both
ranks serve the tokens of a fresh single-process engine, with no KV block leaked."""

from __future__ import annotations

import pytest

from tests.dist_utils import run_world

# (n, hook, error): generate with the hook's n-th call raising; 0: none.
CASES = [(0, "execute_model", "RuntimeError"), (1, "execute_model", "KeyboardInterrupt"),
         (2, "sample_tokens", "ValueError"), (1, "execute_model", "RuntimeError"), (3, "execute_model", "ValueError")]


def _fail_and_recover(rank: int, world: int, tp: int, async_scheduling: bool) -> dict:
    import builtins

    from tests.engine.test_step_failure import GREEDY, PROMPTS, assert_rows_accounted_for, make_llm, raising

    llm = make_llm(tensor_parallel_size=tp, async_scheduling=async_scheduling, collective_timeout_s=30.0)
    raised = []
    for n, hook, name in CASES:
        error = getattr(builtins, name)
        with raising(llm.runner, hook, n, error):
            try:
                llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            except error as e:
                raised.append(str(e))
        assert not llm.scheduler.has_unfinished_requests() and not llm._in_flight
        assert_rows_accounted_for(llm)
    assert llm.scheduler.block_allocator.num_free == llm.scheduler.num_blocks
    tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm.shutdown()
    return {"raised": raised, "tokens": tokens}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tp2_engine_recovers_from_a_raising_step_on_every_rank(async_scheduling: bool) -> None:
    (fresh,) = run_world(1, _fail_and_recover, 1, False, timeout_s=90)
    infos = run_world(2, _fail_and_recover, 2, async_scheduling, timeout_s=120)
    for rank, info in enumerate(infos):
        assert len(info["raised"]) == 4, (rank, info["raised"])  # every injected failure reached the caller
        assert info["tokens"] == fresh["tokens"], f"rank {rank}"


def _chaos(rank: int, world: int, fresh_tokens: list[list[int]]) -> dict:
    """The chaos property of tests/engine/test_step_failure.py on each rank of a TP2 world, async
    scheduling on. Both ranks draw the same interleavings (derandomized, no shrinking, which could
    diverge) and inject the same faults, as an SPMD engine must see them; the example count is the
    active profile's."""
    from hypothesis import Phase, given, settings

    from tests.engine.test_step_failure import OPS, make_llm, run_chaos

    llm = make_llm(tensor_parallel_size=2, async_scheduling=True, collective_timeout_s=30.0)
    examples = [0]

    @settings(derandomize=True, database=None, phases=(Phase.explicit, Phase.generate))
    @given(ops=OPS)
    def chaos(ops) -> None:
        examples[0] += 1
        run_chaos(llm, ops, fresh_tokens)

    chaos()
    llm.shutdown()
    return {"examples": examples[0]}


def test_tp2_chaos_leaves_engines_that_serve_like_a_fresh_one() -> None:
    from tests.engine.test_step_failure import GREEDY, PROMPTS, make_llm

    fresh = [o.token_ids for o in make_llm().generate(PROMPTS, GREEDY, use_tqdm=False)]
    infos = run_world(2, _chaos, fresh, timeout_s=300)
    assert infos[0]["examples"] == infos[1]["examples"] > 0
