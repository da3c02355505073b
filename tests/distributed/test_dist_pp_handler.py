"""PPHandler: FIFO of sampled-token receives, generation counters, gloo worlds.

The schedules are random pipelines with request churn: between a step's broadcast and
its consumption, rows are freed and handed to new requests. The oracle tracks request
*identities* per row (not generation counters) and the true tokens from the schedule,
independently of the handler and its wire.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.distributed.pp_handler import PPHandler, ReceivedTokens, RowGenerations
from tests.dist_utils import WorldError, run_world

SENTINEL = -1  # what a row's token state is reset to when a request is admitted


# ---- schedules and the oracle ---------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    frees: tuple[int, ...]  # rows freed before the step (their requests finished)
    allocs: tuple[tuple[int, int], ...]  # (row, new request id) admitted before the step
    rows: tuple[int, ...]  # the batch, in order
    produces: tuple[bool, ...]
    num_reqs_padded: int
    tokens: tuple[int, ...]  # what the last stage samples, [num_reqs_padded]


def make_schedule(seed: int, num_steps: int, max_num_reqs: int) -> list[Step]:
    """A random pipeline schedule with churn; the same on every rank for the same seed."""
    rng = random.Random(seed)
    owner: list[int | None] = [None] * max_num_reqs
    next_req = 0
    steps = []
    for _ in range(num_steps):
        live = [r for r in range(max_num_reqs) if owner[r] is not None]
        frees = tuple(r for r in live if rng.random() < 0.25)
        for r in frees:
            owner[r] = None
        allocs = []
        for r in range(max_num_reqs):
            # A row freed this very step may be reused at once: the hardest case.
            if owner[r] is None and rng.random() < 0.5:
                owner[r] = next_req
                allocs.append((r, next_req))
                next_req += 1
        live = [r for r in range(max_num_reqs) if owner[r] is not None]
        batch = rng.sample(live, rng.randint(0, len(live)))
        produces = tuple(rng.random() < 0.8 for _ in batch)
        padded = rng.randint(len(batch), max_num_reqs) if batch else 0
        tokens = tuple(rng.randrange(1000, 100000) for _ in range(padded))
        steps.append(Step(frees, tuple(allocs), tuple(batch), produces, padded, tokens))
    return steps


def oracle_states(steps: list[Step], max_num_reqs: int, depth: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(last-stage truth, a non-last stage's expected view) of last_sampled after each step,
    and once more after the final drain (len = num_steps + 1 each)."""
    owner: list[int | None] = [None] * max_num_reqs
    truth = np.full(max_num_reqs, SENTINEL, dtype=np.int64)
    view = truth.copy()
    sends: list[tuple[int, list[tuple[int, int, int]]]] = []  # (step, [(row, request id, token)])
    truths, views = [], []

    def deliver(upto: int) -> None:
        while sends and sends[0][0] <= upto:
            _, entries = sends.pop(0)
            for row, req, tok in entries:
                if owner[row] == req:  # the request still owns the row: apply
                    view[row] = tok

    for t, s in enumerate(steps):
        for r in s.frees:
            owner[r] = None
        for r, req in s.allocs:
            owner[r] = req
            truth[r] = view[r] = SENTINEL
        deliver(t - depth)
        real_tokens = s.tokens[: len(s.rows)]  # tokens is padded to num_reqs_padded
        entries = [(r, owner[r], tok) for r, p, tok in zip(s.rows, s.produces, real_tokens, strict=True) if p]
        for r, _, tok in entries:
            truth[r] = tok
        if entries:
            sends.append((t, entries))
        truths.append(truth.copy())
        views.append(view.copy())
    deliver(len(steps) + depth)
    truths.append(truth.copy())
    views.append(view.copy())
    return truths, views


class StageState:
    """The per-row state a stage keeps (a stand-in for RequestState), driven by the handler."""

    def __init__(self, max_num_reqs: int, num_steps: int, handler: PPHandler) -> None:
        self.handler = handler
        self.last_sampled = torch.full((max_num_reqs + 1,), SENTINEL, dtype=torch.int32)
        self.history = torch.full((max_num_reqs + 1, num_steps), SENTINEL, dtype=torch.int32)

    def churn(self, step: Step) -> None:
        for r in step.frees:
            self.handler.generations.on_free(r)
        for r, _ in step.allocs:
            self.handler.generations.on_alloc(r)
            self.last_sampled[r] = SENTINEL
            self.history[r] = SENTINEL

    def apply(self, received: list[ReceivedTokens]) -> None:
        for got in received:
            got.write_into(self.last_sampled, self.history)

    def run_step(self, t: int, step: Step) -> None:
        h = self.handler
        self.churn(step)
        if not h.is_last_rank:
            self.apply(h.consume())
        rows = np.asarray(step.rows, dtype=np.int64)
        produces = np.asarray(step.produces, dtype=bool)
        positions = np.full(len(rows), t, dtype=np.int64)
        sampled = None
        if h.is_last_rank:
            sampled = torch.zeros(h.max_num_reqs, dtype=torch.int32)
            sampled[: step.num_reqs_padded] = torch.tensor(step.tokens, dtype=torch.int32)
            keep = torch.from_numpy(rows[produces])
            self.last_sampled[keep] = sampled[: len(rows)][torch.from_numpy(produces)]
            self.history[keep, t] = sampled[: len(rows)][torch.from_numpy(produces)]
        h.post_sample(rows, step.num_reqs_padded, sampled=sampled, produces=produces, positions=positions)

    def finish(self) -> None:
        self.apply(self.handler.drain())


def live_rows(steps: list[Step], max_num_reqs: int) -> list[int]:
    owner = [False] * max_num_reqs
    for s in steps:
        for r in s.frees:
            owner[r] = False
        for r, _ in s.allocs:
            owner[r] = True
    return [r for r in range(max_num_reqs) if owner[r]]


# ---- RowGenerations ---------------------------------------------------------------------------
def test_row_generations_bump_snapshot_unchanged():
    g = RowGenerations(5)
    snap = g.snapshot(np.array([0, 3, 3]))
    assert g.unchanged(np.array([0, 3, 3]), snap).all()
    g.bump(3)
    assert g.unchanged(np.array([0, 3, 3]), snap).tolist() == [True, False, False]
    g.bump([1, 1])
    assert g.values.tolist() == [0, 2, 0, 1, 0]
    with pytest.raises(ValueError, match="row 5 is outside"):
        g.bump(5)
    with pytest.raises(ValueError):
        g.values[0] = 1  # read-only view


# ---- in-process pipelines ---------------------------------------------------------------------
def test_pp_size_one_is_a_noop():
    (h,) = PPHandler.loopback(1, 4)
    assert not h.enabled and h.is_last_rank
    assert h.post_sample(np.array([0, 1]), 2, sampled=torch.zeros(4, dtype=torch.int32)) is False
    assert h.consume() == [] and h.drain() == [] and h.num_pending == 0
    solo = PPHandler(None, 4, "cpu")
    assert not solo.enabled and solo.post_sample(np.array([0]), 1) is False
    solo.close()


def test_fifo_consumes_after_depth_steps_and_skips_empty_steps():
    first, last = PPHandler.loopback(2, 4)
    assert first.depth == 2
    sampled = torch.tensor([7, 8, 9, 0], dtype=torch.int32)
    for h in (first, last):  # step 0: two rows sample
        assert h.post_sample(np.array([2, 0]), 3, sampled=sampled if h is last else None)
    assert first.consume() == []  # step 1 begins: too young
    for h in (first, last):  # step 1: empty step, nobody talks
        assert not h.post_sample(np.array([], dtype=np.int64), 0, sampled=sampled if h is last else None)
    got = first.consume()  # step 2 begins: step 0's tokens
    assert len(got) == 1 and got[0].step == 0
    assert got[0].rows.tolist() == [2, 0] and got[0].tokens.tolist() == [7, 8] and got[0].num_dropped == 0
    for h in (first, last):  # step 2: only a non-final prefill chunk: no broadcast
        assert not h.post_sample(np.array([1]), 1, sampled=sampled if h is last else None, produces=np.array([False]))
    assert first.num_pending == 0 and first.drain() == []


def test_freed_and_reused_row_is_dropped():
    first, last = PPHandler.loopback(2, 4, depth=1)
    sampled = torch.tensor([5, 6, 0, 0], dtype=torch.int32)
    for h in (first, last):
        h.post_sample(np.array([0, 1]), 2, sampled=sampled if h is last else None)
    first.generations.on_free(1)  # request on row 1 finished...
    first.generations.on_alloc(1)  # ...and a new one took the row
    (got,) = first.consume()
    assert got.rows.tolist() == [0] and got.tokens.tolist() == [5] and got.num_dropped == 1
    ls = torch.full((5,), -1, dtype=torch.int32)
    got.write_into(ls)
    assert ls.tolist() == [5, -1, -1, -1, -1]


def test_all_rows_dropped_returns_nothing_and_mismatch_is_reported():
    first, last = PPHandler.loopback(2, 4, depth=0)
    sampled = torch.tensor([5, 6, 0, 0], dtype=torch.int32)
    for h in (first, last):
        h.post_sample(np.array([3]), 1, sampled=sampled if h is last else None)
    first.generations.bump(3)
    assert first.consume() == []
    # Stages that disagree on the batch are named, not silently mis-applied.
    last.post_sample(np.array([0, 1]), 2, sampled=sampled)
    first.post_sample(np.array([0]), 2)
    with pytest.raises(RuntimeError, match="disagree on step 1: the last stage sent 2 real rows"):
        first.consume()


def test_bad_arguments_name_the_value():
    first, last = PPHandler.loopback(2, 4)
    with pytest.raises(ValueError, match="num_reqs_padded=5 <= max_num_reqs=4"):
        first.post_sample(np.array([0]), 5)
    with pytest.raises(ValueError, match="must pass sampled="):
        last.post_sample(np.array([0]), 1)
    with pytest.raises(ValueError, match="int32"):
        last.post_sample(np.array([0]), 1, sampled=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="depth=-1"):
        PPHandler(None, 4, "cpu", depth=-1)


def test_consume_must_keep_up():
    first, last = PPHandler.loopback(2, 4, depth=1)
    sampled = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="call consume\\(\\) every step"):
        for _ in range(10):
            for h in (first, last):
                h.post_sample(np.array([0]), 1, sampled=sampled if h is last else None)


def drive_loopback(steps: list[Step], pp_size: int, max_num_reqs: int, depth: int | None):
    handlers = PPHandler.loopback(pp_size, max_num_reqs, depth=depth)
    stages = [StageState(max_num_reqs, len(steps), h) for h in handlers]
    d = handlers[0].depth
    truths, views = oracle_states(steps, max_num_reqs, d)
    for t, step in enumerate(steps):
        for st_ in stages:
            st_.run_step(t, step)
        # After each step: the last stage holds the truth, every other stage the oracle's view.
        assert stages[-1].last_sampled[:max_num_reqs].tolist() == truths[t].tolist(), f"step {t}"
        for st_ in stages[:-1]:
            assert st_.last_sampled[:max_num_reqs].tolist() == views[t].tolist(), f"step {t}"
    for st_ in stages:
        st_.finish()
    assert all(h.num_pending == 0 for h in handlers)
    for st_ in stages[:-1]:
        assert st_.last_sampled[:max_num_reqs].tolist() == views[-1].tolist()
    live = live_rows(steps, max_num_reqs)
    for st_ in stages[:-1]:  # after the drain: every live row equals the last stage, history included
        assert torch.equal(st_.last_sampled[live], stages[-1].last_sampled[live])
        assert torch.equal(st_.history[live], stages[-1].history[live])
    assert (stages[-1].last_sampled[max_num_reqs:] == SENTINEL).all()  # scratch row never touched


@settings(deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    num_steps=st.integers(1, 25),
    pp_size=st.integers(2, 4),
    max_num_reqs=st.integers(1, 8),
    depth=st.one_of(st.none(), st.integers(0, 5)),
)
def test_fifo_with_churn_matches_oracle(seed, num_steps, pp_size, max_num_reqs, depth):
    drive_loopback(make_schedule(seed, num_steps, max_num_reqs), pp_size, max_num_reqs, depth)


# ---- gloo worlds ------------------------------------------------------------------------------
def _pp_world(rank: int, world_size: int, seed: int, num_steps: int, max_num_reqs: int):
    import torch.distributed as dist

    group = dist.new_group(list(range(world_size)), backend="gloo")  # the "sibling" broadcast group
    handler = PPHandler(group, max_num_reqs, "cpu", timeout_s=20)
    assert handler.pp_rank == rank and handler.depth == world_size
    steps = make_schedule(seed, num_steps, max_num_reqs)
    state = StageState(max_num_reqs, num_steps, handler)
    for t, step in enumerate(steps):
        state.run_step(t, step)
    state.finish()
    handler.close()
    return state.last_sampled.numpy().copy(), state.history.numpy().copy()


@pytest.mark.parametrize("world_size", [2, 3])
def test_gloo_pipeline_with_churn(world_size):
    seed, num_steps, max_num_reqs = 1234 + world_size, 30, 6
    results = run_world(world_size, _pp_world, seed, num_steps, max_num_reqs, timeout_s=60)
    steps = make_schedule(seed, num_steps, max_num_reqs)
    truths, views = oracle_states(steps, max_num_reqs, world_size)
    live = live_rows(steps, max_num_reqs)
    last_ls, last_hist = results[-1]
    assert last_ls[:max_num_reqs].tolist() == truths[-1].tolist()
    for rank, (ls, hist) in enumerate(results[:-1]):
        assert ls[:max_num_reqs].tolist() == views[-1].tolist(), f"rank {rank}"
        assert ls[live].tolist() == last_ls[live].tolist(), f"rank {rank}"
        assert hist[live].tolist() == last_hist[live].tolist(), f"rank {rank}"


def _pp_stalled(rank: int, world_size: int):
    import torch.distributed as dist

    group = dist.new_group(list(range(world_size)), backend="gloo")
    handler = PPHandler(group, 4, "cpu", depth=0, timeout_s=1.0)
    if handler.is_last_rank:
        time.sleep(60)  # stalled: never broadcasts (killed by the parent)
        return None
    handler.post_sample(np.array([0]), 1)
    t0 = time.monotonic()
    try:
        handler.consume()
    except RuntimeError as e:
        return str(e), time.monotonic() - t0
    return "no error", time.monotonic() - t0


def test_stalled_last_stage_raises_clear_error():
    msg, waited = run_world(2, _pp_stalled, timeout_s=30, allow_hang=frozenset({1}))[0]
    assert "PP sampled-token broadcast of step 0" in msg and "timeout_s=1.0" in msg, msg
    assert waited < 10


def _boom(rank: int, world_size: int):
    import torch.distributed as dist

    dist.barrier()  # every rank has joined: rank 1's exit must not reset rank 2's connection setup
    if rank == 1:
        raise ValueError("rank one exploded")
    if rank == 2:
        time.sleep(60)  # hangs: killed by the parent at the deadline
    return rank


def test_world_error_names_failing_and_hung_ranks():
    with pytest.raises(WorldError, match=r"rank\(s\) failed: \[1, 2\]") as info:
        run_world(3, _boom, timeout_s=3)
    assert "rank one exploded" in info.value.failures[1]
    assert "hung" in info.value.failures[2]
