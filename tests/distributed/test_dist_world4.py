"""Four-rank layouts on CPU (gloo), the four-GPU matrix as far as CPUs go: greedy tokens equal one process.

The same layouts run on four GPUs in tests/distributed/test_dist_gpu.py; here each
is a gloo world of 4 forked processes with builtin:tiny-llama dummy weights (the sharded loader gives
each rank its share of the single-process weights), compared with a one-process run of the same
prompts. TP2 x PP2 (synchronous) is in tests/distributed/test_dist_engine.py.
"""

from __future__ import annotations

import pytest

from tests.dist_utils import EIGHT_HEADS, register_eight_heads, run_world
from tests.distributed.test_dist_engine import LLM_ARGS, MAX_TOKENS, PROMPTS


def _dummy_steps(llm) -> int:
    """Idle-replica dummy steps the runner ran (lockstep DP; 0 without it)."""
    return llm.runner.dp.num_dummy_steps if llm.runner.dp is not None else 0


def _generate(rank: int, world: int, model: str, layout: dict) -> dict:
    from graphrunner.engine.llm import LLM
    from graphrunner.protocol import SamplingParams

    if model == EIGHT_HEADS:
        register_eight_heads()
    llm = LLM(model, **LLM_ARGS, **layout)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params)
    info = {"tokens": [o.token_ids for o in outs], "dummy_steps": _dummy_steps(llm)}
    llm.shutdown()
    return info


@pytest.fixture(scope="module")
def references() -> dict[str, list[list[int]]]:
    return {model: run_world(1, _generate, model, {}, timeout_s=60)[0]["tokens"]
            for model in ("builtin:tiny-llama", EIGHT_HEADS)}


LAYOUTS = {
    "tp2pp2-async": ("builtin:tiny-llama", dict(tensor_parallel_size=2, pipeline_parallel_size=2,
                                                async_scheduling=True)),
    "dp2tp2": ("builtin:tiny-llama", dict(tensor_parallel_size=2, data_parallel_size=2)),
    "dp2tp2-lockstep": ("builtin:tiny-llama", dict(tensor_parallel_size=2, data_parallel_size=2,
                                                   data_parallel_lockstep=True)),
    "pcp2tp2": ("builtin:tiny-llama", dict(tensor_parallel_size=2, prefill_context_parallel_size=2)),
    "tp4dcp2": ("builtin:tiny-llama", dict(tensor_parallel_size=4, decode_context_parallel_size=2)),
    "tp4": (EIGHT_HEADS, dict(tensor_parallel_size=4)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_four_ranks_match_one_process(references, name: str) -> None:
    model, layout = LAYOUTS[name]
    infos = run_world(4, _generate, model, layout, timeout_s=150)
    for rank, info in enumerate(infos):
        assert info["tokens"] == references[model], f"rank {rank} ({name})"
    # Lockstep DP: the replica whose requests end first keeps stepping with dummies; independent: never.
    assert (sum(i["dummy_steps"] for i in infos) > 0) == layout.get("data_parallel_lockstep", False)
