"""DP coordination: the pure decision (hypothesis) and the one all-reduce (gloo worlds)."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture.descriptor import BatchExecutionDescriptor
from capture.dispatch import DispatchTable
from capture.modes import CUDAGraphMode
from graphrunner.distributed.dp_coordinator import (
    DPCoordinator,
    DPReport,
    coordinate,
    mode_from_ordinal,
    mode_ordinal,
)
from tests.dist_utils import run_world

M = CUDAGraphMode


def make_table(mode="full_and_piecewise", sizes=(1, 2, 4, 8, 16, 32), max_num_reqs=16, max_tokens=64, q=1):
    return DispatchTable(mode, sizes, max_num_reqs=max_num_reqs, max_num_batched_tokens=max_tokens,
                         uniform_decode_query_len=q)


def report(table, num_reqs, num_tokens, q=None, ubatch=False, eager=False):
    return DPReport.from_batch(table, num_reqs, num_tokens, q, wants_microbatch=ubatch, force_eager=eager)


# ---- strategies -------------------------------------------------------------------------------
@st.composite
def tables(draw):
    mode = draw(st.sampled_from(["none", "piecewise", "full", "full_decode_only", "full_and_piecewise"]))
    q = draw(st.integers(1, 3))
    max_num_reqs = draw(st.integers(1, 12))
    max_tokens = draw(st.integers(max_num_reqs * q, 96))
    sizes = draw(st.lists(st.integers(1, max_tokens), min_size=1, max_size=8))
    return DispatchTable(mode, sizes, max_num_reqs=max_num_reqs, max_num_batched_tokens=max_tokens,
                         uniform_decode_query_len=q)


@st.composite
def rank_batch(draw, table):
    """(num_reqs, num_tokens, q-or-None, wants_ubatch, force_eager) of one rank; (0, 0, ...) = idle."""
    kind = draw(st.sampled_from(["idle", "decode", "mixed"]))
    ubatch, eager = draw(st.booleans()), draw(st.integers(0, 9)) == 0
    q = table.uniform_decode_query_len
    if kind == "idle":
        return 0, 0, None, ubatch, eager
    if kind == "decode":
        n = draw(st.integers(1, table.max_num_reqs))
        return n, n * q, q, ubatch, eager
    tokens = draw(st.integers(1, table.max_num_batched_tokens))
    n = draw(st.integers(1, min(tokens, table.max_num_reqs)))
    return n, tokens, None, ubatch, eager


@st.composite
def worlds(draw):
    table = draw(tables())
    dp = draw(st.integers(1, 5))
    batches = draw(st.lists(rank_batch(table), min_size=dp, max_size=dp))
    reports = [report(table, n, t, q, u, e) for n, t, q, u, e in batches]
    return table, reports


# ---- the pure core ------------------------------------------------------------------------------
@settings(deadline=None)
@given(worlds(), st.randoms(use_true_random=False))
def test_decision_invariants(world, rnd):
    table, reports = world
    d = coordinate(reports, table)
    busy = [r for r in reports if not r.idle]

    # Every rank derives the same decision whatever the rank order: it depends on the multiset only.
    shuffled = list(reports)
    rnd.shuffle(shuffled)
    d2 = coordinate(shuffled, table)
    assert (d2.descriptor, d2.num_tokens, d2.num_reqs, d2.uniform_token_count, d2.microbatch) == (
        d.descriptor, d.num_tokens, d.num_reqs, d.uniform_token_count, d.microbatch)

    if not busy:
        assert d.skip and all(p.skip for p in map(d.for_rank, range(len(reports))))
        assert d.run_tokens == (0,) * len(reports) and d.waste == 1.0
        return
    desc = d.descriptor
    assert d.num_tokens == max(r.num_tokens for r in reports) and d.num_reqs == max(r.num_reqs for r in reports)
    # Never above what any busy rank can run.
    assert mode_ordinal(desc.cg_mode) <= min(mode_ordinal(r.mode) for r in busy)
    # Uniform only if every busy rank is uniform with that same q.
    qs = {r.uniform_token_count for r in busy}
    assert d.uniform_token_count == (next(iter(qs)) if len(qs) == 1 else None)
    if desc.uniform_token_count is not None:
        assert all(r.uniform_token_count == desc.uniform_token_count for r in busy)
    for rank, r in enumerate(reports):
        plan = d.for_rank(rank)
        assert plan.dummy == r.idle and d.run_tokens[rank] >= r.num_tokens
        if desc.is_eager:
            # Eager: busy ranks unpadded, idle ranks a dummy of the agreed (max) size.
            assert plan.descriptor.is_eager
            assert plan.descriptor.num_tokens == (r.num_tokens if not r.idle else d.num_tokens)
        else:
            # A graph: one captured descriptor for all, and every rank's batch fits it.
            assert plan.descriptor == desc and desc in table.descriptors
            assert r.idle or desc.fits(r.num_reqs, r.num_tokens, r.uniform_token_count), (desc, r)
            assert d.run_tokens[rank] == desc.num_tokens
    # Graph modes: this is what the local table would choose for the agreed batch (capped).
    local = table.dispatch(d.num_reqs, d.num_tokens, d.uniform_token_count)
    if mode_ordinal(local.cg_mode) <= mode_ordinal(desc.cg_mode):
        assert desc == local or desc.is_eager
    # Microbatching: all-or-nothing, and only when every rank's second half holds a real token.
    split = desc.num_tokens // 2
    want_all = all(r.wants_microbatch for r in reports)
    assert d.microbatch == (want_all and split >= 1 and min(r.num_tokens for r in reports) > split)
    assert d.ubatch_split == (split if d.microbatch else None)
    # Waste accounting: padded over real.
    assert d.waste == pytest.approx(sum(d.run_tokens) / sum(r.num_tokens for r in reports))
    assert all(p >= 0 for p in d.padding_tokens)


@settings(deadline=None)
@given(worlds())
def test_expert_parallel_agreement_runs_one_size_on_every_rank(world):
    """DP + EP (`pad_eager`): every MoE layer all-gathers over the DP group, so every rank, busy or
    idle, runs exactly the agreed token count in every mode, eager included; the rest of the
    decision (descriptor, microbatch vote and split) is the plain one."""
    table, reports = world
    plain, d = coordinate(reports, table), coordinate(reports, table, pad_eager=True)
    assert (d.descriptor, d.num_tokens, d.num_reqs, d.microbatch, d.ubatch_split) == (
        plain.descriptor, plain.num_tokens, plain.num_reqs, plain.microbatch, plain.ubatch_split)
    if d.skip:
        return
    sizes = {d.for_rank(rank).descriptor.num_tokens for rank in range(len(reports))}
    assert sizes == {d.descriptor.num_tokens} and set(d.run_tokens) == sizes
    for rank, r in enumerate(reports):  # a busy rank keeps its own request count (tokens padded only)
        plan = d.for_rank(rank)
        assert plan.descriptor.num_tokens >= r.num_tokens
        if d.descriptor.is_eager and not r.idle:
            assert plan.descriptor.num_reqs == r.num_reqs and not plan.dummy


@settings(deadline=None)
@given(tables(), st.data())
def test_single_rank_decision_is_the_local_dispatch(table, data):
    n, t, q, _, _ = data.draw(rank_batch(table).filter(lambda b: b[1] > 0))
    d = coordinate([report(table, n, t, q)], table)
    assert d.descriptor == (table.dispatch(n, t, q) if not table.dispatch(n, t, q).is_eager
                            else BatchExecutionDescriptor(M.NONE, t, n))
    assert not d.is_dummy(0)


def test_mode_order_and_report_wire_roundtrip():
    assert [mode_ordinal(m) for m in (M.NONE, M.PIECEWISE, M.FULL)] == [0, 1, 2]
    assert mode_from_ordinal(1) is M.PIECEWISE
    with pytest.raises(ValueError, match="not a runtime mode"):
        mode_ordinal(M.FULL_AND_PIECEWISE)
    for r in (DPReport(8, M.FULL, 1, 8, True), DPReport(5, M.PIECEWISE, None, 2), DPReport.idle_report()):
        assert DPReport.unpack(r.pack()) == r
    with pytest.raises(ValueError, match="both 0 \\(idle\\) or both > 0"):
        DPReport(3, M.NONE, None, 0)
    with pytest.raises(ValueError, match="num_tokens == num_reqs \\* q"):
        DPReport(5, M.FULL, 2, 2)


def test_decode_and_prefill_ranks_agree_on_piecewise():
    table = make_table()
    d = coordinate([report(table, 8, 8, 1), report(table, 3, 30, None)], table)
    assert d.descriptor == BatchExecutionDescriptor(M.PIECEWISE, 32)
    assert d.uniform_token_count is None and d.run_tokens == (32, 32) and d.real_tokens == (8, 30)
    assert d.waste == pytest.approx(64 / 38)


def test_uniform_decode_survives_idle_ranks_and_idle_ranks_run_dummies():
    table = make_table()
    reports = [report(table, 5, 5, 1), DPReport.idle_report(), report(table, 3, 3, 1)]
    d = coordinate(reports, table)
    assert d.descriptor == BatchExecutionDescriptor(M.FULL, 8, 8, 1)
    plans = [d.for_rank(r) for r in range(3)]
    assert [p.dummy for p in plans] == [False, True, False]
    assert all(p.descriptor == d.descriptor for p in plans)
    assert d.padding_tokens == (3, 8, 5)


def test_one_eager_rank_makes_every_rank_eager_unpadded():
    table = make_table()
    d = coordinate([report(table, 4, 4, 1), report(table, 2, 20, None, eager=True), DPReport.idle_report()], table)
    assert d.descriptor == BatchExecutionDescriptor(M.NONE, 20, 4)
    assert d.local_descriptor(0) == BatchExecutionDescriptor(M.NONE, 4, 4)
    assert d.local_descriptor(2) == d.descriptor and d.is_dummy(2)
    assert d.run_tokens == (4, 20, 20)


def test_too_large_for_any_graph_is_eager():
    table = make_table()
    d = coordinate([report(table, 1, 40, None), report(table, 1, 1, 1)], table)
    assert d.descriptor.is_eager and d.descriptor.num_tokens == 40


def test_all_idle_skips():
    d = coordinate([DPReport.idle_report()] * 3, make_table())
    assert d.skip and d.for_rank(1).skip and not d.is_dummy(1)


@pytest.mark.parametrize(
    "tokens, wants, expected",
    [
        ((20, 18), (True, True), True),  # padded 32, split 16: both second halves hold tokens
        ((20, 16), (True, True), False),  # rank 1's second microbatch [16, 16) would be empty
        ((20, 18), (True, False), False),  # all-or-nothing
        ((20, 0), (True, True), False),  # an idle rank: its second microbatch is always empty
        ((1, 1), (True, True), False),  # padded 1: split 0, nothing to split
    ],
)
def test_microbatch_rule(tokens, wants, expected):
    table = make_table()
    reports = [
        report(table, 1, t, None, ubatch=w) if t else DPReport.idle_report()
        for t, w in zip(tokens, wants, strict=True)
    ]
    d = coordinate(reports, table)
    assert d.microbatch is expected
    assert d.ubatch_split == (d.descriptor.num_tokens // 2 if expected else None)


def test_capped_to_the_agreed_mode_on_a_full_table():
    # FULL-only table: one rank asks eager -> NONE; both FULL -> the FULL graph.
    table = make_table("full")
    d = coordinate([report(table, 2, 6, None), report(table, 1, 3, None)], table)
    assert d.descriptor == BatchExecutionDescriptor(M.FULL, 8, 8)
    d = coordinate([report(table, 2, 6, None), report(table, 1, 3, None, eager=True)], table)
    assert d.descriptor.is_eager


def test_single_process_coordinator_needs_no_group():
    table = make_table()
    c = DPCoordinator(None, table)
    plan = c.plan(report(table, 3, 3, 1))
    assert c.dp_size == 1 and plan.descriptor == BatchExecutionDescriptor(M.FULL, 4, 4, 1) and not plan.dummy


# ---- gloo worlds ------------------------------------------------------------------------------
def _batches(seed: int, dp: int, steps: int, table: DispatchTable):
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        row = []
        for _ in range(dp):
            kind = rng.choice(["idle", "decode", "mixed"])
            if kind == "idle":
                row.append((0, 0, None, rng.random() < 0.5))
            elif kind == "decode":
                n = rng.randint(1, table.max_num_reqs)
                row.append((n, n, 1, rng.random() < 0.5))
            else:
                t = rng.randint(1, table.max_num_batched_tokens)
                row.append((rng.randint(1, min(t, table.max_num_reqs)), t, None, rng.random() < 0.5))
        out.append(row)
    return out


def _dp_world(rank: int, world_size: int, seed: int, steps: int):
    import torch.distributed as dist

    group = dist.new_group(list(range(world_size)), backend="gloo")
    table = make_table()
    coord = DPCoordinator(group, table, timeout_s=20)
    assert (coord.dp_rank, coord.dp_size) == (rank, world_size)
    decisions = []
    for row in _batches(seed, world_size, steps, table):
        n, t, q, u = row[rank]
        decisions.append(coord.coordinate(report(table, n, t, q, u)))
    return decisions


@pytest.mark.parametrize("world_size", [2, 4])
def test_gloo_ranks_derive_the_same_decision(world_size):
    seed, steps = 77 + world_size, 25
    results = run_world(world_size, _dp_world, seed, steps, timeout_s=60)
    table = make_table()
    for step, row in enumerate(_batches(seed, world_size, steps, table)):
        expected = coordinate([report(table, n, t, q, u) for n, t, q, u in row], table)
        for rank in range(world_size):
            assert results[rank][step] == expected, (step, rank)
            assert results[rank][step].is_dummy(rank) == (row[rank][1] == 0 and not expected.skip)


def _dp_stalled(rank: int, world_size: int):
    import torch.distributed as dist

    group = dist.new_group(list(range(world_size)), backend="gloo")
    table = make_table()
    coord = DPCoordinator(group, table, timeout_s=1.0)
    if rank == 1:
        time.sleep(60)  # stalled: never joins the step's all-reduce (killed by the parent)
        return None
    t0 = time.monotonic()
    try:
        coord.coordinate(report(table, 1, 1, 1))
    except RuntimeError as e:
        return str(e), time.monotonic() - t0
    return "no error", time.monotonic() - t0


def test_stalled_dp_rank_raises_clear_error():
    msg, waited = run_world(2, _dp_stalled, timeout_s=30, allow_hang=frozenset({1}))[0]
    assert "DP coordination all_reduce (step 0" in msg and "timeout_s=1.0" in msg, msg
    assert waited < 10
