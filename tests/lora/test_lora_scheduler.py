"""The scheduler's `max_loras` rule and the prefix cache's adapter salt (no model).

Under any workload of requests with adapters (and without), with KV pressure that forces
preemption: no step schedules more than `max_loras` distinct adapters, the scheduler's count of
running adapters always equals what its running list holds, every request finishes with the
tokens it gets alone, and a request whose adapter would exceed the limit waits in its place.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.engine.prefix_cache import PrefixCachingAllocator
from graphrunner.engine.scheduler import Scheduler
from graphrunner.protocol import LoRARequest, SamplingParams
from tests.engine.test_scheduler import FakeRunner, reference_generate

MAX_MODEL_LEN = 64


def _lora(i: int | None) -> LoRARequest | None:
    return None if i is None else LoRARequest(f"a{i}", i, f"/adapters/a{i}")


workloads = st.fixed_dictionaries({
    "max_loras": st.integers(1, 3),
    "num_blocks": st.integers(8, 24),
    "reqs": st.lists(st.tuples(st.lists(st.integers(4, 49), min_size=1, max_size=12), st.integers(1, 8),
                               st.one_of(st.none(), st.integers(1, 5))), min_size=1, max_size=10),
})


@given(workloads)
def test_max_loras_holds_in_every_step(w):
    sched = Scheduler(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=MAX_MODEL_LEN, block_size=4,
                      num_blocks=w["num_blocks"], max_loras=w["max_loras"])
    runner = FakeRunner(block_size=4, max_model_len=MAX_MODEL_LEN)
    adapter_of = {}
    for i, (prompt, n, adapter) in enumerate(w["reqs"]):
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        sched.add_request(str(i), prompt, params, lora_request=_lora(adapter))
        adapter_of[str(i)] = adapter
    done = {}
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        for new in so.scheduled_new_reqs:
            assert new.lora_request == _lora(adapter_of[new.req_id])  # the protocol carries the adapter
        step_adapters = {adapter_of[r] for r in so.num_scheduled_tokens} - {None}
        assert len(step_adapters) <= w["max_loras"]
        running = {}
        for req in sched.running:
            if req.lora_request is not None:
                running[req.lora_request.lora_int_id] = running.get(req.lora_request.lora_int_id, 0) + 1
        assert sched.running_loras == running
        runner.execute_model(so)
        for out in sched.update_from_output(so, runner.sample_tokens()):
            done[out.req_id] = out.token_ids
    assert not sched.has_unfinished_requests()
    for i, (prompt, n, _) in enumerate(w["reqs"]):
        assert done[str(i)] == reference_generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True),
                                                  MAX_MODEL_LEN)[0]


def test_a_third_adapter_waits_in_its_place():
    sched = Scheduler(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32, block_size=4, num_blocks=64,
                      max_loras=2)
    for i, adapter in enumerate([1, 2, 3, None, 1]):
        sched.add_request(str(i), [5, 6, 7], SamplingParams(max_tokens=4), lora_request=_lora(adapter))
    so = sched.schedule()
    assert [r.req_id for r in so.scheduled_new_reqs] == ["0", "1", "3", "4"]
    assert [r.req_id for r in sched.waiting] == ["2"]
    sched.abort_request("1")
    sched.schedule()
    assert not sched.waiting and sched.running_loras == {1: 2, 3: 1}


def test_lora_request_needs_max_loras():
    sched = Scheduler(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16, block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match="needs enable_lora=True"):
        sched.add_request("r", [1, 2], SamplingParams(max_tokens=2), lora_request=_lora(1))


def test_prefix_cache_keeps_adapters_apart():
    alloc = PrefixCachingAllocator(8, 2)
    tokens = [1, 2, 3, 4, 5]
    blocks = alloc.allocate(2)
    alloc.register(tokens, blocks, 2, salt=1)
    assert alloc.lookup(tokens, 2, salt=1) == blocks
    assert alloc.lookup(tokens, 2) == [] and alloc.lookup(tokens, 2, salt=2) == []
