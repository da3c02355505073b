"""Context-parallel groups: the DP x PP x PCP x TP layout with DCP inside TP groups,
the configuration rules, and the groups of a real gloo world."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.config import ParallelConfig
from graphrunner.distributed.groups import coordinates, group_ranks, init_distributed, pcp_coordinate
from tests.dist_utils import run_world


@st.composite
def layouts(draw):
    tp = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    dcp = draw(st.sampled_from([d for d in range(1, tp + 1) if tp % d == 0]))
    return tp, draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 4)), dcp


@given(layouts())
def test_every_kind_of_group_partitions_the_world(layout):
    tp, pp, dp, pcp, dcp = layout
    world = tp * pp * dp * pcp
    groups = group_ranks(tp, pp, dp, pcp, dcp)
    for kind, size in (("tp", tp), ("pcp", pcp), ("pp", pp), ("dp", dp), ("dcp", dcp)):
        assert sorted(r for g in groups[kind] for r in g) == list(range(world)), kind
        assert all(len(g) == size for g in groups[kind]), kind
    for g in groups["tp"]:  # TP innermost: contiguous
        assert g == list(range(g[0], g[0] + tp))
    for g in groups["pcp"]:  # PCP next: stride tp
        assert g == list(range(g[0], g[0] + pcp * tp, tp))
    tp_of = {r: tuple(g) for g in groups["tp"] for r in g}
    for g in groups["dcp"]:  # DCP: consecutive ranks of one TP group, adding no ranks
        assert g == list(range(g[0], g[0] + dcp)) and len({tp_of[r] for r in g}) == 1
    for rank in range(world):
        d, p, t = coordinates(rank, tp, pp, pcp)
        c = pcp_coordinate(rank, tp, pcp)
        assert rank == ((d * pp + p) * pcp + c) * tp + t
        assert groups["pcp"][(d * pp + p) * tp + t][c] == rank
        assert groups["pp"][(d * pcp + c) * tp + t][p] == rank


@given(tp=st.integers(1, 4), pp=st.integers(1, 3), dp=st.integers(1, 3))
def test_without_context_parallelism_the_layout_is_unchanged(tp, pp, dp):
    """pcp = dcp = 1 gives the DP x PP x TP ranks and group order of before (rank = (dp*pp + p)*tp + t)."""
    groups = group_ranks(tp, pp, dp)
    rank = lambda d, p, t: (d * pp + p) * tp + t  # noqa: E731
    assert groups["tp"] == [[rank(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)]
    assert groups["pp"] == [[rank(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)]
    assert groups["dp"] == [[rank(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)]
    assert all(len(g) == 1 for kind in ("pcp", "dcp") for g in groups[kind])


def test_configuration_rules_name_the_value():
    assert ParallelConfig(tensor_parallel_size=2, prefill_context_parallel_size=3).world_size == 6
    assert ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=2).world_size == 4  # no new ranks
    with pytest.raises(ValueError, match="decode_context_parallel_size=3 must divide tensor_parallel_size=4"):
        ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=3)
    with pytest.raises(ValueError, match="prefill_context_parallel_size=0 must be an int >= 1"):
        ParallelConfig(prefill_context_parallel_size=0)
    with pytest.raises(ValueError, match="cp_kv_cache_interleave_size=1.5 must be an int >= 1"):
        ParallelConfig(cp_kv_cache_interleave_size=1.5)  # type: ignore[arg-type]
    ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=2).check_decode_context_parallel(2)
    ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2).check_decode_context_parallel(8, 16)
    with pytest.raises(ValueError, match="over 2 DCP group\\(s\\), which must divide num_key_value_heads=3"):
        ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=2).check_decode_context_parallel(3)
    from graphrunner.config import RunnerConfig
    from graphrunner.models.registry import get_builtin

    def heads(tp: int, dcp: int) -> int:
        model = dataclasses.replace(get_builtin("builtin:tiny-llama"), num_attention_heads=32,
                                    num_key_value_heads=8)
        parallel = ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp)
        return RunnerConfig(model=model, parallel=parallel).kv_heads_per_rank()

    assert heads(2, 1) == 4 and heads(2, 2) == 8 and heads(16, 2) == 1  # DCP lets TP pass the KV heads
    with pytest.raises(ValueError, match="num_key_value_heads=8 is not divisible by tensor_parallel_size=16"):
        heads(16, 1)
    with pytest.raises(ValueError, match="cp_kv_cache_interleave_size=32 must divide block_size=16"):
        ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2,
                       cp_kv_cache_interleave_size=32).check_decode_context_parallel(8, 16)


def _groups_of(rank: int, world: int) -> dict:
    config = ParallelConfig(tensor_parallel_size=2, prefill_context_parallel_size=2, decode_context_parallel_size=2,
                            collective_timeout_s=20.0)
    groups = init_distributed(config, "cpu")
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=groups.pcp.device_group)  # over this rank's PCP group
    info = {"pcp": groups.pcp.ranks, "dcp": groups.dcp.ranks, "tp": groups.tp.ranks, "sum": total.item(),
            "pcp_rank": groups.pcp_rank, "dcp_rank": groups.dcp_rank}
    groups.destroy()
    return info


def test_a_gloo_world_builds_the_context_parallel_groups():
    infos = run_world(4, _groups_of, timeout_s=60, init_pg=False)
    layout = group_ranks(2, 1, 1, 2, 2)
    for rank, info in enumerate(infos):
        pcp = next(g for g in layout["pcp"] if rank in g)
        assert info["pcp"] == pcp and info["sum"] == float(sum(pcp)) and info["pcp_rank"] == pcp.index(rank)
        assert info["dcp"] == next(g for g in layout["dcp"] if rank in g) == info["tp"]
