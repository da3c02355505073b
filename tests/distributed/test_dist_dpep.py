"""Data-parallel attention with expert parallelism (DP + EP), dual-batch overlap and EPLB on CPU
(gloo): builtin:tiny-moe (8 experts, top-2, 4 layers) over DP2 equals one process, with a skewed
workload so that one replica idles and runs dummy steps; DBO on equals one process; EPLB on a
router biased to two experts lowers the per-rank load imbalance and changes no token. The pure
placement policy under hypothesis."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.distributed.eplb import MIN_BALANCE_GAIN, balanced_placement, load_balance, replacement
from tests.dist_utils import run_world

PROMPTS = [[1 + i, 5, 9, 13 + i, 100 + i] for i in range(4)] + [[7] * 20, [3, 4]]
MAX_TOKENS = [10, 4, 12, 3, 8, 5]  # skewed: one DP replica runs out of work first
LLM_ARGS = dict(device="cpu", dtype="float32", num_kv_blocks=48, max_num_seqs=8, max_num_batched_tokens=32,
                max_model_len=96, seed=3, collective_timeout_s=30.0, enable_prefix_caching=False)
GRAPH_ARGS = dict(enforce_eager=False, compile_backend="eager", cudagraph_capture_sizes=[1, 2, 4, 8])
HOT = (2, 3)  # experts the biased router prefers; both start on EP rank 0


def _params():
    from graphrunner.protocol import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    params[1] = SamplingParams(max_tokens=MAX_TOKENS[1], temperature=0.8, seed=11, ignore_eos=True)  # seeded
    return params


def _bias_router(llm) -> None:
    """Scale the hot experts' router rows: they win whenever their logit is positive."""
    import torch

    from graphrunner.layers.moe.layer import FusedMoE

    for m in llm.runner.model.modules():
        if isinstance(m, FusedMoE):
            scale = torch.ones(m.num_experts)
            scale[list(HOT)] = 20.0
            m.gate.weight.mul_(scale[:, None].to(m.gate.weight))


def _generate(rank: int, world: int, dp: int, extra: dict, biased: bool) -> dict:
    from graphrunner.engine.llm import LLM
    from graphrunner.layers.moe.layer import FusedMoE

    llm = LLM("builtin:tiny-moe", data_parallel_size=dp, **LLM_ARGS, **extra)
    if biased:
        _bias_router(llm)
    runner = llm.runner
    info: dict = {"tokens": [o.token_ids for o in llm.generate(PROMPTS, _params())]}
    moe = next(m for m in runner.model.modules() if isinstance(m, FusedMoE))
    info.update(local_experts=moe.num_local_experts, dp_ep=moe.dp is not None,
                dummy_steps=runner.dp.num_dummy_steps if runner.dp is not None else 0,
                microbatched=runner.dp.num_microbatched_steps if runner.dp is not None else 0,
                microbatched_graphs=runner.dp.num_microbatched_graph_steps if runner.dp is not None else 0)
    eplb = runner.eplb
    if eplb is not None:
        # The same workload twice (no prefix cache): the window's imbalance under the initial
        # placement, a rebalance, then the imbalance the new placement gives the same tokens.
        generation = runner.graphs.generation
        info["before"] = eplb.balance()
        eplb.rearrange()
        info["again"] = [o.token_ids for o in llm.generate(PROMPTS, _params())]
        info["after"] = eplb.balance()
        eplb.step_interval = 3  # and rebalances every few steps while requests run
        info["interval"] = [o.token_ids for o in llm.generate(PROMPTS, _params())]
        info["rearrangements"] = len(eplb.rearrangements)
        info["recaptured"] = runner.graphs.generation != generation
    llm.shutdown()
    return info


def _reference(biased: bool) -> list[list[int]]:
    (info,) = run_world(1, _generate, 1, {}, biased, timeout_s=60)
    return info["tokens"]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return _reference(False)


def test_dp2_expert_parallel_matches_one_process_with_idle_replica_and_graphs(reference) -> None:
    ref = reference
    infos = run_world(2, _generate, 2, {"enable_expert_parallel": True, **GRAPH_ARGS}, False, timeout_s=120)
    for rank, info in enumerate(infos):
        assert info["tokens"] == ref, f"rank {rank}"
        assert info["dp_ep"] and info["local_experts"] == 4  # 8 experts over DP2 x TP1
    assert sum(i["dummy_steps"] for i in infos) > 0  # a replica idled and still joined every layer's gather


def test_dp2_expert_parallel_dbo_matches_one_process(reference) -> None:
    ref = reference
    dbo = dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=4)
    infos = run_world(2, _generate, 2, {"enable_expert_parallel": True, **dbo, **GRAPH_ARGS}, False, timeout_s=120)
    for rank, info in enumerate(infos):
        assert info["tokens"] == ref, f"rank {rank}"
        assert info["microbatched"] > 0, f"rank {rank}: no step ran as two microbatches"
        # decode steps replayed the microbatched FULL graphs (the eager split: tests/step/test_microbatch.py)
        assert 0 < info["microbatched_graphs"] <= info["microbatched"], f"rank {rank}: {info}"


def test_eplb_rebalances_a_biased_router_without_changing_tokens() -> None:
    ref = _reference(True)
    eplb = dict(enable_eplb=True, num_redundant_experts=2, eplb_step_interval=10_000)
    infos = run_world(2, _generate, 2, {"enable_expert_parallel": True, **eplb, **GRAPH_ARGS}, True, timeout_s=120)
    for rank, info in enumerate(infos):
        assert info["tokens"] == info["again"] == info["interval"] == ref, f"rank {rank}"
        assert info["local_experts"] == 5  # (8 + 2) slots over 2 ranks
        assert info["after"] < info["before"], info  # measured on the same tokens, before and after
        assert info["rearrangements"] > 1 and not info["recaptured"]
    assert infos[0]["before"] == infos[1]["before"] and infos[0]["after"] == infos[1]["after"]


# ---- the placement policy -----------------------------------------------------------------------
@settings(deadline=None)
@given(st.integers(1, 12), st.integers(0, 6), st.integers(1, 4), st.data())
def test_balanced_placement_covers_replicates_and_is_stable(num_experts, redundant, ranks, data):
    physical = num_experts + redundant
    physical += (-physical) % ranks  # a multiple of the rank count
    load = data.draw(st.lists(st.integers(0, 1000), min_size=num_experts, max_size=num_experts))
    current = list(range(num_experts)) + [p % num_experts for p in range(num_experts, physical)]
    new = balanced_placement(load, physical, ranks, current)
    replicas = Counter(new)
    assert len(new) == physical and set(new) == set(range(num_experts))  # every expert has a slot
    assert max(replicas.values()) <= physical - num_experts + 1
    # The hottest expert per replica is never left with fewer replicas than a colder one could spare.
    hottest = max(range(num_experts), key=lambda e: (load[e], -e))
    assert replicas[hottest] == max(replicas.values()) or load[hottest] == 0
    # Placing again for the same load moves nothing, and never does worse than a fresh placement.
    assert balanced_placement(load, physical, ranks, new) == new
    # Each rank's load is at most the mean plus one replica's share (greedy packing, heaviest first).
    spread = [load[e] / replicas[e] for e in new]
    per_rank = physical // ranks
    rank_load = [sum(spread[r * per_rank : (r + 1) * per_rank]) for r in range(ranks)]
    assert max(rank_load) <= sum(spread) / ranks + max(spread) + 1e-6


# Two prefills of near-equal size whose request boundaries differ (lengths 6, 10, 8 on replica 0 and
# 12, 4, 9 on replica 1, dealt round-robin): both split eagerly, at different cuts (14 and 13 tokens).
SPLIT_PROMPTS = [[(11 * i + 3 * j) % 400 + 4 for j in range(n)] for i, n in enumerate([6, 12, 10, 4, 8, 9])]


def _split_prefill(rank: int, world: int, extra: dict) -> dict:
    from graphrunner.engine.llm import LLM
    from graphrunner.protocol import SamplingParams

    llm = LLM("builtin:tiny-moe", data_parallel_size=world, **LLM_ARGS, **extra)
    agreed: list = []
    ub = llm.runner.dp._ubatch if llm.runner.dp is not None else None
    if ub is not None:
        sizes = ub.agree_sizes

        def record(first: int, second: int) -> tuple[int, int]:
            agreed.append(((first, second), sizes(first, second)))
            return agreed[-1][1]

        ub.agree_sizes = record
    params = [SamplingParams(max_tokens=4 + i, temperature=0.0, ignore_eos=True) for i in range(len(SPLIT_PROMPTS))]
    info = {"tokens": [o.token_ids for o in llm.generate(SPLIT_PROMPTS, params)], "agreed": agreed,
            "eager_microbatched": ub.num_steps - ub.num_graph_steps if ub is not None else 0}
    llm.shutdown()
    return info


def test_eager_microbatches_pad_to_the_largest_half_over_the_replicas() -> None:
    (one,) = run_world(1, _split_prefill, {}, timeout_s=60)
    dbo = dict(enable_expert_parallel=True, enable_dbo=True, dbo_decode_token_threshold=2,
               dbo_prefill_token_threshold=4, **GRAPH_ARGS)
    infos = run_world(2, _split_prefill, dbo, timeout_s=120)
    for rank, info in enumerate(infos):
        assert info["tokens"] == one["tokens"], f"rank {rank}"
        assert info["eager_microbatched"] > 0, info
    # Each replica's cut is its own; both pad each microbatch to the larger of the two replicas' sizes
    # (the prefill of 24 and 25 tokens: 26 rows over both microbatches), not each to the step's 25.
    first = [infos[0]["agreed"][0], infos[1]["agreed"][0]]
    assert first[0][1] == first[1][1] == tuple(max(s) for s in zip(first[0][0], first[1][0], strict=True))
    assert sum(first[0][1]) < 2 * max(sum(f[0]) for f in first), first


def test_a_layer_moves_experts_only_for_a_real_gain():
    """A balanced window keeps the placement (a fresh one would reshuffle the ranks for nothing);
    a skewed one takes the balanced placement and reports its gain."""
    current = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]  # 8 experts + 2 redundant slots over 2 ranks of 5
    even = [10.0] * 10
    assert balanced_placement([20, 20, 10, 10, 10, 10, 10, 10], 10, 2) != current  # what packing afresh would do
    assert replacement(even, current, 8, 2) == (current, 1.0, 1.0)
    skewed = [90.0, 90.0, 90.0, 90.0, 10.0, 10.0, 10.0, 10.0, 90.0, 90.0]  # rank 0 holds every hot expert
    new, before, after = replacement(skewed, current, 8, 2)
    assert before == load_balance(skewed, 2) and before - after > MIN_BALANCE_GAIN and new != current
