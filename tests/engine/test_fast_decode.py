"""The scheduler's steady-decode fast path against its general path.

Two schedulers run the same workload (arrivals, aborts, stop and EOS tokens, max_tokens,
max_model_len, a KV cache small enough to preempt, prefix caching, speculative decoding,
sync and async), one with the fast path forced off; every step's plan and every finished
output must be the same. The fake runner's tokens depend on the request and the step only,
so that both see the same ones.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, fields

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.engine.request import SequenceOutput
from graphrunner.engine.scheduler import FAST_DECODE_MIN_REQUESTS, Scheduler
from graphrunner.protocol import ModelRunnerOutput, SamplingParams, SchedulerOutput

VOCAB = 40
EOS = 3
STOP = 5


def _token(req_id: str, step: int, j: int = 0) -> int:
    return zlib.crc32(f"{req_id}/{step}/{j}".encode()) % VOCAB


def _run_step(sched: Scheduler, so: SchedulerOutput, step: int, k: int) -> ModelRunnerOutput:
    """What a runner returns for `so`: a token for each chunk that reaches the end of the known
    tokens (a decode with drafts: 1..1 + k of them)."""
    req_ids = list(so.num_scheduled_tokens)
    if sched.async_scheduling:
        produces = [r in sched._in_flight[-1].produces for r in req_ids]
        decodes = [r in sched._in_flight[-1].decodes for r in req_ids]
    else:
        produces = [sched.requests[r].num_computed_tokens + n >= sched.requests[r].num_tokens
                    for r, n in so.num_scheduled_tokens.items()]
        decodes = [sched.requests[r].is_decoding for r in req_ids]
    index = {r: i for i, r in enumerate(req_ids)}
    if not k:
        tokens = np.array([_token(r, step) for r in req_ids], np.int32)
        return ModelRunnerOutput.from_token_array(req_ids, tokens, None if all(produces) else np.array(produces),
                                                  index)
    rows = np.array([[_token(r, step, j) for j in range(1 + k)] for r in req_ids], np.int64).reshape(-1, 1 + k)
    counts = [0 if not p else 1 + zlib.crc32(f"{r}/{step}".encode()) % n if d else 1
              for r, p, d, n in zip(req_ids, produces, decodes, so.num_scheduled_tokens.values(), strict=True)]
    return ModelRunnerOutput.from_token_rows(req_ids, rows, np.array(counts, np.int64), index)


def _comparable(out: SequenceOutput) -> dict:
    skip = {"arrival_time", "first_token_time"}
    return {f.name: getattr(out, f.name) for f in fields(out) if f.name not in skip}


def _drive(config: dict, events: list[tuple[int, int, int]], fast: bool) -> tuple[list, list, int]:
    """Run the workload; (every plan as a dict, the finished outputs per step, fast plans made)."""
    k = config["k"]
    sched = Scheduler(max_num_seqs=config["max_num_seqs"], max_num_batched_tokens=config["budget"],
                      max_model_len=40, block_size=4, num_blocks=config["num_blocks"], eos_token_ids=[EOS],
                      async_scheduling=config["async"], enable_prefix_caching=config["prefix"],
                      num_speculative_tokens=k)
    sched._fast_decode_min = 1 if fast else None
    plans, finished, in_flight, num_fast = [], [], [], 0
    next_id = 0
    for step, (arrivals, abort, prompt_len) in enumerate(events):
        for _ in range(arrivals):
            params = SamplingParams(max_tokens=1 + next_id * 7 % 24, ignore_eos=next_id % 4 == 0,
                                    stop_token_ids=(STOP,) if next_id % 3 == 0 else ())
            prompt = [(7 * next_id + i) % VOCAB for i in range(prompt_len)] if next_id % 2 else \
                [i % VOCAB for i in range(prompt_len)]  # every other one shares a prefix
            try:
                sched.add_request(f"r{next_id}", prompt, params)
            except ValueError:
                pass  # longer than the cache or max_model_len: both refuse it
            next_id += 1
        if abort and sched.requests:
            live = sorted(sched.requests)
            out = sched.abort_request(live[abort % len(live)])
            finished.append(("abort", _comparable(out) if out else None))
        if not sched.has_unfinished_requests() and not in_flight:
            continue
        so = sched.schedule()
        num_fast += sched._batch is not None and bool(so.num_scheduled_tokens)
        plans.append(asdict(so))
        if sched.async_scheduling:
            if so.num_scheduled_tokens:
                in_flight.append((so, _run_step(sched, so, step, k)))
            keep = 1 if so.num_scheduled_tokens else 0
            while len(in_flight) > keep:
                done = sched.update_from_output(*in_flight.pop(0))
                finished.append([_comparable(o) for o in done])
        elif so.num_scheduled_tokens:
            done = sched.update_from_output(so, _run_step(sched, so, step, k))
            finished.append([_comparable(o) for o in done])
    while in_flight:
        finished.append([_comparable(o) for o in sched.update_from_output(*in_flight.pop(0))])
    return plans, finished, num_fast


_configs = st.fixed_dictionaries({
    "async": st.booleans(),
    "k": st.sampled_from([0, 0, 2]),
    "prefix": st.booleans(),
    "num_blocks": st.sampled_from([12, 24, 200]),
    "max_num_seqs": st.sampled_from([4, 16]),
    "budget": st.sampled_from([16, 64]),
})
_events = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 12).map(lambda a: a if a > 9 else 0),
                             st.integers(1, 14)), min_size=1, max_size=40).map(lambda ev: ev + [(0, 0, 1)] * 60)


@settings(max_examples=200)
@given(_configs, _events)
def test_fast_path_plans_and_outputs_equal_the_general_path(config: dict, events: list) -> None:
    fast_plans, fast_finished, _ = _drive(config, events, fast=True)
    plans, finished, _ = _drive(config, events, fast=False)
    assert len(fast_plans) == len(plans)
    for i, (got, want) in enumerate(zip(fast_plans, plans, strict=True)):
        assert got == want, f"plan {i} differs"
    assert fast_finished == finished


def test_steady_decode_takes_the_fast_path() -> None:
    for is_async in (False, True):
        config = {"async": is_async, "k": 0, "prefix": True, "num_blocks": 400, "max_num_seqs": 16, "budget": 256}
        events = [(12, 0, 9)] + [(0, 0, 1)] * 30
        fast_plans, fast_finished, num_fast = _drive(config, events, fast=True)
        plans, finished, _ = _drive(config, events, fast=False)
        assert num_fast >= 3
        assert (fast_plans, fast_finished) == (plans, finished)


def test_the_fast_path_starts_at_its_batch_size():
    """Below FAST_DECODE_MIN_REQUESTS decoding requests the general path plans (its per-request
    Python is cheaper than the arrays' fixed cost there); from it on, the fast path."""
    for n, fast in ((FAST_DECODE_MIN_REQUESTS - 1, False), (FAST_DECODE_MIN_REQUESTS, True)):
        sched = Scheduler(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=40, block_size=4,
                          num_blocks=256, eos_token_ids=[EOS])
        for i in range(n):
            sched.add_request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
        so = sched.schedule()  # the prefills
        sched.update_from_output(so, _run_step(sched, so, 0, 0))
        so = sched.schedule()
        assert len(so.num_scheduled_tokens) == n and not so.scheduled_new_reqs
        assert (sched._batch is not None) == fast, n
