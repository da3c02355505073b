"""The async-scheduling `Scheduler` against its sync self, with a fake runner (many examples, fast).

The fake runner behaves like the real one under async scheduling: it keeps each
request's tokens itself (the device's `last_sampled`), samples `next_token(history)` when
a chunk reaches the end of the known tokens, and asserts that no plan computes a token
it does not know yet or disagrees with its counters. Outputs come back one step late.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.engine.scheduler import Scheduler
from graphrunner.protocol import ModelRunnerOutput, SamplingParams, SchedulerOutput

VOCAB = 50
EOS = 3


def next_token(tokens: list[int]) -> int:
    h = 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
    return h % VOCAB


@dataclass
class _Row:
    tokens: list[int]
    computed: int


@dataclass
class _Ready:
    output: ModelRunnerOutput

    def get(self) -> ModelRunnerOutput:
        return self.output


@dataclass
class FakeAsyncRunner:
    max_model_len: int
    rows: dict[str, _Row] = field(default_factory=dict)

    def step(self, so: SchedulerOutput) -> _Ready:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.rows.pop(rid, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.rows
            self.rows[new.req_id] = _Row(list(new.all_token_ids), new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for rid, nc in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            assert self.rows[rid].computed == nc, (rid, self.rows[rid].computed, nc)
        out = ModelRunnerOutput()
        for i, (rid, n) in enumerate(so.num_scheduled_tokens.items()):
            row = self.rows[rid]
            assert n >= 1 and row.computed + n <= len(row.tokens) <= self.max_model_len, (rid, row.computed, n)
            row.computed += n
            sampled = []
            if row.computed == len(row.tokens):
                sampled = [next_token(row.tokens)]
                row.tokens.append(sampled[0])  # stays "on the device" for the next step
            out.req_ids.append(rid)
            out.req_id_to_index[rid] = i
            out.sampled_token_ids.append(sampled)
        return _Ready(out)


def _run(requests, *, async_scheduling: bool, num_blocks: int, budget: int) -> dict:
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=32, block_size=4,
                      num_blocks=num_blocks, eos_token_ids=[EOS], async_scheduling=async_scheduling)
    runner = FakeAsyncRunner(max_model_len=32)
    for i, (prompt, params) in enumerate(requests):
        sched.add_request(str(i), prompt, params)
    results, in_flight = {}, None
    for _ in range(2000):
        if not (sched.has_unfinished_requests() or in_flight):
            break
        launched = None
        if sched.has_unfinished_requests():
            so = sched.schedule()
            assert so.total_num_scheduled_tokens or in_flight is not None, "stuck"
            pending = runner.step(so)
            if so.total_num_scheduled_tokens:
                launched = (so, pending)
                if not async_scheduling:
                    results.update((o.req_id, o) for o in sched.update_from_output(so, pending.get()))
                    launched = None
        if in_flight is not None:
            results.update((o.req_id, o) for o in sched.update_from_output(in_flight[0], in_flight[1].get()))
        in_flight = launched
    assert not sched.has_unfinished_requests()
    assert sched.block_allocator.num_free == num_blocks
    return {rid: (o.token_ids, o.finish_reason) for rid, o in results.items()}, sched.num_preemptions


requests = st.lists(
    st.tuples(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
        st.builds(SamplingParams, max_tokens=st.integers(1, 14), ignore_eos=st.booleans(),
                  stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=2)),
    ),
    min_size=1,
    max_size=7,
)


@settings(deadline=None)
@given(requests, st.integers(8, 24), st.integers(1, 16))
def test_async_scheduler_matches_sync(reqs, num_blocks, budget):
    expected, _ = _run(reqs, async_scheduling=False, num_blocks=num_blocks, budget=budget)
    got, _ = _run(reqs, async_scheduling=True, num_blocks=num_blocks, budget=budget)
    assert got == expected


def test_async_scheduler_preempts_with_tokens_in_flight():
    reqs = [([i + 1] * 12, SamplingParams(max_tokens=14, ignore_eos=True)) for i in range(4)]
    expected, sync_preemptions = _run(reqs, async_scheduling=False, num_blocks=12, budget=16)
    got, async_preemptions = _run(reqs, async_scheduling=True, num_blocks=12, budget=16)
    assert got == expected and sync_preemptions > 0 and async_preemptions > 0
