"""The pipeline rule of pipelined PP (engine/pipeline_rule.py) with a fake runner, and the
handler's early take (`PPHandler.take_for`) that lets stage 0 apply a due token on the device.

The scheduler runs as the engine drives it under PP with placeholders: P + 1 plans launched
before the oldest is resolved. Against the sync scheduler's outputs (same requests, one step
at a time), and for every plan: a request with a token in flight runs only if its previous
plan is at least P plans old, and at most ceil(running / P) running requests are taken.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.distributed.pp_handler import PPHandler
from graphrunner.engine.pipeline_rule import PipelineRule
from graphrunner.engine.scheduler import Scheduler
from tests.engine.test_async_scheduler import EOS, FakeAsyncRunner, _run, requests


def _run_pipelined(reqs, depth: int, num_blocks: int, budget: int) -> tuple[dict, int]:
    """(outputs, plans that ran a request with a token in flight) of a P + 1-deep pipeline."""
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=32, block_size=4,
                      num_blocks=num_blocks, eos_token_ids=[EOS], pipeline_depth=depth)
    runner = FakeAsyncRunner(max_model_len=32)
    for i, (prompt, params) in enumerate(reqs):
        sched.add_request(str(i), prompt, params)
    results, in_flight, last_plan, plan, ran_ahead = {}, deque(), {}, 0, 0
    for _ in range(4000):
        if not (sched.has_unfinished_requests() or in_flight):
            break
        launched = False
        if sched.has_unfinished_requests():
            pending = {r.req_id for r in sched.running if r.num_output_placeholders}
            running = len(sched.running)
            so = sched.schedule()
            assert so.total_num_scheduled_tokens or in_flight, "stuck"
            taken = [r for r in so.num_scheduled_tokens if r in {x.req_id for x in sched.running}]
            new = {n.req_id for n in so.scheduled_new_reqs}
            assert len([r for r in taken if r not in new]) <= -(-running // depth), (running, taken)
            for rid in pending & set(so.num_scheduled_tokens):
                assert plan - last_plan[rid] >= depth, (rid, plan, last_plan[rid])
                ran_ahead += 1
            out = runner.step(so)
            if so.total_num_scheduled_tokens:
                in_flight.append((so, out))
                last_plan.update((rid, plan) for rid in so.num_scheduled_tokens)
                plan, launched = plan + 1, True
        keep = depth if launched else len(in_flight) - 1  # the engine's depth: P + 1 plans, then resolve
        while len(in_flight) > max(keep, 0):
            so, out = in_flight.popleft()
            results.update((o.req_id, o) for o in sched.update_from_output(so, out.get()))
    assert not sched.has_unfinished_requests() and sched.block_allocator.num_free == num_blocks
    return {rid: (o.token_ids, o.finish_reason) for rid, o in results.items()}, ran_ahead


@given(requests, st.integers(2, 4), st.integers(8, 24), st.integers(1, 16))
def test_pipelined_scheduler_keeps_the_rule_and_matches_sync(reqs, depth, num_blocks, budget):
    expected, _ = _run(reqs, async_scheduling=False, num_blocks=num_blocks, budget=budget)
    got, _ = _run_pipelined(reqs, depth, num_blocks, budget)
    assert got == expected


def test_pipelined_scheduler_runs_requests_ahead_of_their_tokens():
    """Four long decodes over two stages: after the prefills, requests run with tokens in flight."""
    from graphrunner.protocol import SamplingParams

    reqs = [([i + 1] * 4, SamplingParams(max_tokens=12, ignore_eos=True)) for i in range(4)]
    expected, _ = _run(reqs, async_scheduling=False, num_blocks=24, budget=16)
    got, ran_ahead = _run_pipelined(reqs, 2, num_blocks=24, budget=16)
    assert got == expected and ran_ahead > 0


def test_pipeline_rule_counts_and_refuses_bad_depths():
    rule = PipelineRule(3)
    assert [rule.cap(n) for n in (0, 1, 3, 4, 7)] == [0, 1, 1, 2, 3]
    assert PipelineRule(3, disjoint=True).cap(7) == 7
    for bad in (0, 1, True, 2.0):
        with pytest.raises(ValueError, match="pipeline depth"):
            PipelineRule(bad)


def test_take_for_applies_up_to_the_newest_receive_holding_the_rows():
    """Three queued receives (rows {0, 1}, {2}, {3}): a step of row 2 takes the first two, in
    order, each with every row's tokens; the third stays queued for its own turn."""
    first, last = PPHandler.loopback(2, 4)
    for step, rows in enumerate(([0, 1], [2], [3])):
        sampled = torch.tensor([10 * step + 1, 10 * step + 2, 0, 0], dtype=torch.int32)
        for h in (first, last):
            h.post_sample(np.array(rows), len(rows), sampled=sampled if h is last else None)
    assert first.take_for(np.array([5])) == []  # no queued receive holds row 5
    taken = first.take_for(np.array([2, 5]))
    assert [got.rows.tolist() for got, _ in taken] == [[0, 1], [2]]
    assert [every.get().tolist() for _, every in taken] == [[1, 2], [11]]
    assert first.num_pending == 1
    got, every = first.take_oldest()
    assert got.rows.tolist() == [3] and every.get().tolist() == [21]
