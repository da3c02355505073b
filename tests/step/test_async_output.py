"""Async output, double-buffered uploads and the vectorized validator, on CPU.

- `sample_tokens(async_output=True)` gives exactly the tokens of the synchronous path,
  also when the engine holds several unresolved outputs and resolves them out of order;
  the ring refuses to overwrite a slot an unresolved output still owns.
- `OutputRing` carries an arbitrary dict of tensors (the future logprob tensors).
- The per-step upload alternates pinned slots; the steady-decode plan skips it.
- `validate_scheduler_output` (numpy, per batch) accepts exactly what the per-request
  reference accepts, and rejected steps leave the runner unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.protocol import ModelRunnerOutput, NewRequestData, SamplingParams, SchedulerOutput
from graphrunner.state.staging import to_device_async
from graphrunner.state.validation import _Invalid, _validate_vectorized, validate_reference
from graphrunner.step.inputs import NUM_UPLOAD_SLOTS, InputBuffers
from graphrunner.step.output import AsyncOutput, OutputRing
from tests.runner_driver import make_runner

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=1.0, top_k=30, seed=99)


@pytest.fixture(scope="module")
def runner():
    return make_runner(max_num_seqs=4, num_blocks=96)


class _Loop:
    """Hand-made plans: whole prefills, then decodes. Tokens come back as outputs."""

    def __init__(self, runner, prompts: dict[str, list[int]], params=GREEDY):
        self.runner = runner
        self.prompts = prompts
        self.params = params
        self.computed: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
        bpr = runner.limits.max_num_blocks_per_req
        self.blocks = {rid: list(range(i * bpr, (i + 1) * bpr)) for i, rid in enumerate(prompts)}

    def plan(self) -> SchedulerOutput:
        so = SchedulerOutput()
        for rid, prompt in self.prompts.items():
            if rid not in self.computed:
                so.scheduled_new_reqs.append(NewRequestData(rid, prompt, self.params, self.blocks[rid]))
                so.num_scheduled_tokens[rid] = len(prompt)
                self.computed[rid] = len(prompt)
            else:
                so.scheduled_cached_reqs.req_ids.append(rid)
                so.scheduled_cached_reqs.new_block_ids.append(None)
                so.scheduled_cached_reqs.num_computed_tokens.append(self.computed[rid])
                so.num_scheduled_tokens[rid] = 1
                self.computed[rid] += 1
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        return so

    def apply(self, out: ModelRunnerOutput) -> None:
        for rid, toks in zip(out.req_ids, out.sampled_token_ids, strict=True):
            assert out.req_ids[out.req_id_to_index[rid]] == rid
            self.tokens[rid] += toks

    def finish(self) -> None:
        self.runner.execute_model(SchedulerOutput(finished_req_ids=set(self.prompts)))
        assert self.runner.sample_tokens(async_output=True).get().req_ids == []


PROMPTS = {"a": [5, 9, 11, 3, 7], "b": [42] * 9, "c": list(range(1, 20))}


def _run_sync(runner, steps: int, params=GREEDY) -> dict[str, list[int]]:
    loop = _Loop(runner, PROMPTS, params)
    for _ in range(steps):
        runner.execute_model(loop.plan())
        loop.apply(runner.sample_tokens())
    loop.finish()
    return loop.tokens


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_async_output_matches_sync_one_step_late(runner, params):
    """Engine pattern: launch step N + 1, then resolve step N. Same tokens as sync."""
    expected = _run_sync(runner, 6, params)
    loop = _Loop(runner, PROMPTS, params)
    in_flight = None
    for _ in range(6):
        runner.execute_model(loop.plan())
        out = runner.sample_tokens(async_output=True)
        assert isinstance(out, AsyncOutput)
        if in_flight is not None:
            loop.apply(in_flight.get())
        in_flight = out
    loop.apply(in_flight.get())
    assert in_flight.get() is in_flight.get()  # resolved once, then cached
    loop.finish()
    assert loop.tokens == expected
    assert runner.output_ring.num_unresolved == 0


def test_ring_holds_unresolved_outputs_and_resolves_out_of_order(runner):
    expected = _run_sync(runner, 3)
    loop = _Loop(runner, PROMPTS)
    outs = []
    for _ in range(3):  # three unresolved outputs: one per slot
        runner.execute_model(loop.plan())
        outs.append(runner.sample_tokens(async_output=True))
    assert runner.output_ring.num_unresolved == 3
    runner.execute_model(loop.plan())
    with pytest.raises(RuntimeError, match="all 3 async output slots hold unresolved outputs"):
        runner.sample_tokens(async_output=True)
    results = {i: outs[i].get() for i in (2, 0, 1)}  # out of order
    for i in range(3):
        loop.apply(results[i])
    assert loop.tokens == expected
    loop.finish()
    assert runner.output_ring.num_unresolved == 0


def test_sampling_nothing_gives_an_empty_resolved_output(runner):
    out = runner.sample_tokens(async_output=True)
    assert out.resolved and out.is_ready() and out.get().req_ids == []
    assert runner.sample_tokens() == ModelRunnerOutput.empty()


def test_output_ring_copies_any_dict_of_tensors():
    ring = OutputRing(torch.device("cpu"), num_slots=2)
    logits = torch.arange(12, dtype=torch.float32).view(3, 4)
    ids = torch.tensor([7, 8, 9], dtype=torch.int32)
    out = ring.launch({"ids": ids, "top": logits}, lambda h: {k: v.clone() for k, v in h.items()},
                      capacity={"ids": 8, "top": 8})
    ids.fill_(0)  # the copy was taken at launch: later writes to the source do not leak in
    got = out.get()
    assert got["ids"].tolist() == [7, 8, 9] and torch.equal(got["top"], torch.arange(12.0).view(3, 4))
    # A smaller batch reuses the slot's buffers (prefix views), a larger one grows them.
    small = ring.launch({"ids": ids[:1] + 5}, lambda h: h["ids"].tolist())
    big = ring.launch({"ids": torch.arange(20, dtype=torch.int32)}, lambda h: h["ids"].tolist())
    assert big.get() == list(range(20)) and small.get() == [5]
    with pytest.raises(ValueError, match="num_slots=1"):
        OutputRing(torch.device("cpu"), num_slots=1)


def test_upload_alternates_pinned_slots_and_bumps_version():
    buffers = InputBuffers(4, 16, 2, torch.device("cpu"))
    assert NUM_UPLOAD_SLOTS >= 2
    seen = []
    for step in range(3):
        before = buffers.version
        buffers.upload(np.array([2, 0], dtype=np.int32), np.array([1, 3 + step], dtype=np.int32), 3, pad_row=4)
        assert buffers.version == before + 1
        seen.append(buffers.host_packed.data_ptr())
        assert buffers.packed.tolist() == [2, 0, 4, 4, 0, 1, 4 + step, 4 + step, 4 + step]
    assert seen[0] != seen[1] and seen[0] == seen[2]


def test_to_device_async_roundtrip():
    a = np.array([3, 1, 2], dtype=np.int64)
    assert to_device_async(a, torch.device("cpu"), torch.int32).tolist() == [3, 1, 2]
    assert to_device_async(a, "cpu").dtype == torch.int64


def test_steady_decode_plan_skips_the_upload_and_still_validates(runner):
    loop = _Loop(runner, PROMPTS)
    runner.execute_model(loop.plan())  # prefill: no plan
    runner.sample_tokens()
    runner.execute_model(loop.plan())  # first decode: builds the plan
    runner.sample_tokens()
    version = runner.input_buffers.version
    runner.execute_model(loop.plan())  # same batch again: reused, no upload
    runner.sample_tokens()
    assert runner.input_buffers.version == version
    bad = loop.plan()
    bad.scheduled_cached_reqs.num_computed_tokens[1] += 1
    with pytest.raises(ValueError, match="scheduler says num_computed_tokens"):
        runner.execute_model(bad)
    loop.computed = {rid: n - 1 for rid, n in loop.computed.items()}
    runner.execute_model(loop.plan())  # the rejected step changed nothing
    runner.sample_tokens()
    loop.finish()


@pytest.fixture(scope="module")
def small_runner():
    return make_runner(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=24, block_size=4, num_blocks=20)


@settings(deadline=None)
@given(data=st.data())
def test_steady_decode_validation_agrees_with_the_reference(small_runner, data):
    """Repeated decode batches near their block and length limits, sometimes given new
    blocks, sometimes corrupted: the steady-decode shortcut (its room bookkeeping
    included) accepts exactly the steps the reference accepts."""
    from graphrunner.state.validation import _validate_steady_decode

    runner = small_runner
    prompts = {"a": [3, 1, 4], "b": [1, 5, 9, 2, 6]}
    blocks = {"a": [0], "b": [1, 2]}
    free = list(range(3, 20))
    computed = {rid: len(p) for rid, p in prompts.items()}
    so = SchedulerOutput(total_num_scheduled_tokens=8)
    for rid, prompt in prompts.items():
        so.scheduled_new_reqs.append(NewRequestData(rid, prompt, GREEDY, list(blocks[rid])))
        so.num_scheduled_tokens[rid] = len(prompt)
    runner.execute_model(so)
    runner.sample_tokens()
    checked = 0
    try:
        for _ in range(data.draw(st.integers(1, 24), label="steps")):
            so = SchedulerOutput(total_num_scheduled_tokens=2)
            for rid in prompts:
                new = None
                unused = [b for b in free if [b] not in so.scheduled_cached_reqs.new_block_ids]
                if unused and data.draw(st.integers(0, 3), label=f"grow {rid}") == 0:
                    new = [unused[0] if data.draw(st.integers(0, 9), label="bad id") else 20]
                so.scheduled_cached_reqs.req_ids.append(rid)
                so.scheduled_cached_reqs.new_block_ids.append(new)
                so.scheduled_cached_reqs.num_computed_tokens.append(
                    computed[rid] + (data.draw(st.integers(0, 19), label="skew") == 0))
                so.num_scheduled_tokens[rid] = 1
            if data.draw(st.integers(0, 19), label="a new_block_ids entry too many") == 0:
                so.scheduled_cached_reqs.new_block_ids.append([free[-1]])
            try:
                validate_reference(runner.state, runner.limits, so)
                reference_ok = True
            except ValueError:
                reference_ok = False
            plan = runner.planner.reusable_plan(so, False)
            if plan is not None and plan.hint.all_decode:
                try:
                    _validate_steady_decode(runner.state, runner.limits, so, plan.hint)
                    fast_ok = True
                except _Invalid:
                    fast_ok = False
                assert fast_ok == reference_ok
                checked += 1
            if not reference_ok:
                with pytest.raises(ValueError):
                    runner.execute_model(so)
                continue
            runner.execute_model(so)
            runner.sample_tokens()
            for rid, new in zip(prompts, so.scheduled_cached_reqs.new_block_ids, strict=True):
                computed[rid] += 1
                if new:
                    free.remove(new[0])
        accepted = computed["a"] - len(prompts["a"])
        assert checked or accepted < 2  # a plan forms in the first decode, and serves the next ones
    finally:
        runner.execute_model(SchedulerOutput(finished_req_ids=set(prompts)))
        runner.sample_tokens()


# ---- the vectorized validator agrees with the reference -------------------------------

_LIVE = {"p": ([1, 2, 3, 4, 5, 6], 4, 1), "d": ([9] * 9, 9, 3)}  # id -> (tokens, computed, blocks)


@pytest.fixture(scope="module")
def live_runner():
    r = make_runner(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=32, block_size=4, num_blocks=24)
    so = SchedulerOutput()
    next_block = 0
    for rid, (tokens, computed, blocks) in _LIVE.items():
        so.scheduled_new_reqs.append(NewRequestData(rid, tokens, GREEDY, list(range(next_block, next_block + blocks))))
        so.num_scheduled_tokens[rid] = computed
        next_block += blocks
    so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
    r.execute_model(so)
    r.sample_tokens()
    return r


def _mostly(valid, invalid):
    """Valid values nine times in ten: plans sit near the boundaries of the rules."""
    return st.integers(0, 9).flatmap(lambda i: invalid if i == 9 else valid)


@st.composite
def plans(draw):
    so = SchedulerOutput()
    so.finished_req_ids = set(draw(_mostly(st.just(()), st.lists(st.sampled_from(["p", "d", "z"]), max_size=2))))
    for rid, (_tokens, computed, _) in _LIVE.items():
        if draw(st.booleans()):
            so.scheduled_cached_reqs.req_ids.append(rid)
            blocks = draw(_mostly(st.one_of(st.none(), st.lists(st.integers(8, 23), max_size=2)),
                                  st.lists(st.integers(-1, 30), max_size=8)))
            so.scheduled_cached_reqs.new_block_ids.append(blocks)
            offset = draw(_mostly(st.just(0), st.integers(-2, 2)))
            so.scheduled_cached_reqs.num_computed_tokens.append(computed + offset)
            so.num_scheduled_tokens[rid] = draw(_mostly(st.integers(1, 3), st.integers(0, 20)))
    for rid in draw(st.lists(st.sampled_from(["x", "y", "p", "d"]), max_size=2, unique=True)):
        tokens = draw(_mostly(st.lists(st.integers(0, 2047), min_size=1, max_size=8),
                              st.lists(st.integers(-1, 2048), max_size=34)))
        blocks = draw(_mostly(st.lists(st.integers(8, 23), min_size=1, max_size=8),
                              st.lists(st.integers(-1, 25), max_size=10)))
        computed = draw(_mostly(st.integers(0, max(0, len(tokens) - 1)), st.integers(-1, 40)))
        so.scheduled_new_reqs.append(NewRequestData(rid, tokens, GREEDY, blocks, computed))
        if draw(_mostly(st.just(True), st.just(False))):
            so.num_scheduled_tokens[rid] = draw(_mostly(st.integers(1, max(1, len(tokens) - computed)),
                                                        st.integers(0, 20)))
    if draw(_mostly(st.just(False), st.just(True))):
        so.num_scheduled_tokens[draw(st.sampled_from(["q", "p", "x"]))] = 1
    so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values()) + draw(_mostly(st.just(0), st.just(1)))
    return so


@settings(deadline=None)
@given(plans())
def test_vectorized_validation_accepts_exactly_what_the_reference_accepts(live_runner, so):
    try:
        validate_reference(live_runner.state, live_runner.limits, so)
        reference_ok = True
    except ValueError:
        reference_ok = False
    try:
        _validate_vectorized(live_runner.state, live_runner.limits, so)
        fast_ok = True
    except _Invalid:
        fast_ok = False
    assert fast_ok == reference_ok


@pytest.mark.gpu
def test_gpu_output_ring_copies_before_the_next_step_overwrites():
    """On CUDA: the copy sees the step's values although the next step (guarded) overwrites them at once."""
    ring = OutputRing(torch.device("cuda"))
    src = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")
    outs = []
    for step in range(5):
        torch.cuda._sleep(1_000_000)  # keep the device busy so that the host runs ahead
        src.fill_(step)
        outs.append(ring.launch({"x": src}, lambda h: (int(h["x"].min()), int(h["x"].max()))))
        ring.guard_next_step()
        if len(outs) == 3:
            assert outs.pop(0).get() == (step - 2, step - 2)
    assert [o.get() for o in outs] == [(3, 3), (4, 4)]
