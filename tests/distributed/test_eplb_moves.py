"""EPLB placement from the current placement (pure, no world): every expert keeps a replica and
the replica counts follow the rule, the balance stays within `PLACEMENT_TOLERANCE` of packing every
replica afresh, a skew onto one rank moves only the new hot replicas, and a balanced placement
stays put."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.distributed.eplb import PLACEMENT_TOLERANCE, balanced_placement, load_balance

# The placement compares exact (fsum) rank loads with a 1e-9 relative margin, while `load_balance`
# adds the slots' loads one by one in slot order: the two differ by rounding only, far below this.
ROUNDING = 1e-6


def initial_placement(num_experts: int, redundant: int) -> list[int]:
    """FusedMoE's physical_to_logical before any rebalance: slot p holds expert p, the redundant
    slots replicate experts 0, 1, ..."""
    return [p % num_experts for p in range(num_experts + redundant)]


def replica_rule(load: list[float], num_physical: int) -> list[int]:
    """Each redundant slot to the expert with the highest load per replica, ties the lower id."""
    replicas = [1] * len(load)
    for _ in range(num_physical - len(load)):
        e = max(range(len(load)), key=lambda e: (load[e] / replicas[e], -e))
        replicas[e] += 1
    return replicas


def balance(load: list[float], placement: list[int], ranks: int) -> float:
    """max / mean rank load with each expert's load split evenly over its replicas."""
    replicas = Counter(placement)
    return load_balance([load[e] / replicas[e] for e in placement], ranks)


def moved(old: list[int], new: list[int]) -> int:
    """Slots whose expert changes: the weights that move."""
    return sum(a != b for a, b in zip(old, new, strict=True))


@st.composite
def layers(draw: st.DrawFn) -> tuple[list[float], int, int, list[int]]:
    """(per-expert load, physical slots, ranks, a valid current placement)."""
    ranks = draw(st.integers(1, 8))
    num_experts = draw(st.integers(4, 64))
    redundant = draw(st.sampled_from([r for r in range(num_experts + 1) if (num_experts + r) % ranks == 0]))
    physical = num_experts + redundant
    value = st.one_of(st.integers(0, 1000), st.floats(0, 1000, allow_nan=False), st.sampled_from([0, 1, 20]))
    load = draw(st.lists(value, min_size=num_experts, max_size=num_experts))
    extra = draw(st.lists(st.integers(0, num_experts - 1), min_size=redundant, max_size=redundant))
    current = draw(st.permutations(list(range(num_experts)) + extra))  # every expert has a slot
    return load, physical, ranks, current


@given(layers())
def test_every_expert_keeps_a_replica_and_the_counts_follow_the_rule(layer):
    load, physical, ranks, current = layer
    new = balanced_placement(load, physical, ranks, current)
    assert len(new) == physical and all(0 <= e < len(load) for e in new)
    replicas = Counter(new)
    assert [replicas[e] for e in range(len(load))] == replica_rule(load, physical)  # >= 1 each
    per_rank = physical // ranks
    assert [len(new[r * per_rank : (r + 1) * per_rank]) for r in range(ranks)] == [per_rank] * ranks
    # Pure and deterministic: the same answer again, from a tuple too, with the inputs untouched.
    before = (list(load), list(current))
    assert balanced_placement(tuple(load), physical, ranks, tuple(current)) == new
    assert (list(load), list(current)) == before


@given(layers())
def test_the_balance_stays_within_the_tolerance_of_packing_afresh(layer):
    load, physical, ranks, current = layer
    new = balanced_placement(load, physical, ranks, current)
    packed = balanced_placement(load, physical, ranks)
    assert balance(load, new, ranks) <= balance(load, packed, ranks) + PLACEMENT_TOLERANCE + ROUNDING
    # Placing again for the same load moves nothing, and neither does a packed placement.
    assert balanced_placement(load, physical, ranks, new) == new
    assert balanced_placement(load, physical, ranks, packed) == packed


@pytest.mark.parametrize(("num_experts", "redundant", "hot", "repacked_moves"), [
    # 16 experts + 4 redundant slots, 10 per rank, hot experts 4..7 (each now 2 replicas of 10,
    # the 12 cold ones 1 replica of 1: 46 per rank). Re-packing deals one replica of each hot
    # expert to each rank and the cold ones alternately in id order: rank 0 keeps 0, 2, 4..8 of
    # its 0..9 and rank 1 keeps 11, 13, 15, 1, 3 of its 10..15, 0..3: 3 + 5 = 8 slots move.
    (16, 4, 4, 8),
    # qwen3-30b-a3b's layer: 128 experts + 8 redundant slots, 68 per rank, hot experts 8..15. Re-packing
    # moves 30 of rank 0's slots (it keeps the hot ones and 30 even-placed cold ones) and 34 of
    # rank 1's (it keeps 30 of 68..127 and 1, 3, 5, 7): 64 per layer, 3,072 over 48 layers.
    (128, 8, 8, 64),
])
def test_a_skew_onto_one_rank_moves_only_the_new_hot_replicas(num_experts, redundant, hot, repacked_moves):
    """The hot experts start at expert R, all on rank 0 (the initial layout replicates experts
    0..R-1 on the last rank, so a skew on those would need no move). Each hot expert needs a second
    replica: the cold experts 0..R-1 give up theirs on rank 1, the hot ones take those slots, and
    both ranks carry the same load. Nothing else moves: R slots, the fewest possible."""
    assert hot == redundant  # every redundant slot goes to a hot expert
    physical, ranks = num_experts + redundant, 2
    load = [20.0 if redundant <= e < redundant + hot else 1.0 for e in range(num_experts)]
    current = initial_placement(num_experts, redundant)
    assert balance(load, current, ranks) > 1.5  # before: the hot experts' tokens all land on rank 0
    new = balanced_placement(load, physical, ranks, current)
    assert moved(current, new) == hot <= repacked_moves // 2
    assert new[num_experts:] == list(range(redundant, redundant + hot))  # the freed redundant slots
    assert balance(load, new, ranks) <= 1.05
    assert balance(load, new, ranks) == pytest.approx(1.0)


@pytest.mark.parametrize(("num_experts", "redundant", "ranks"), [(16, 4, 1), (16, 4, 2), (16, 0, 4), (128, 8, 2),
                                                             (128, 0, 8)])
def test_a_balanced_placement_stays_put(num_experts, redundant, ranks):
    """Even load: the replica rule copies experts 0..R-1, as the initial layout does, and every rank
    carries the same load."""
    current = initial_placement(num_experts, redundant)
    load = [100.0] * num_experts
    assert balance(load, current, ranks) == 1.0
    assert balanced_placement(load, num_experts + redundant, ranks, current) == current


def test_the_next_window_of_a_rebalanced_skew_moves_nothing():
    """After the skew is balanced, a window with a few percent of noise per expert keeps the
    placement: its balance is as close to packing afresh as the tolerance asks."""
    num_experts, redundant, ranks = 128, 8, 2
    load = [20.0 if redundant <= e < 2 * redundant else 1.0 for e in range(num_experts)]
    placed = balanced_placement(load, num_experts + redundant, ranks, initial_placement(num_experts, redundant))
    noisy = [x * (1 + 0.02 * ((7 * e) % 5 - 2)) for e, x in enumerate(load)]  # -4% .. +4%
    again = balanced_placement(noisy, num_experts + redundant, ranks, placed)
    assert again == placed
    assert balance(noisy, again, ranks) <= balance(noisy, balanced_placement(noisy, len(placed), ranks), ranks) + \
        PLACEMENT_TOLERANCE
