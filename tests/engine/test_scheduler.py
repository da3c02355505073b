"""Scheduler: properties of continuous batching, chunked prefill and preemption by recompute.

A fake runner stands in for `ModelRunner`. It keeps per-request state from each
`SchedulerOutput` exactly as a real runner must (new and resumed requests, cached
requests, finished/preempted removal), checks the plan against that state, and samples
`next_token(full token history)`, so outputs depend only on history and never on how
the steps were batched. That makes a direct, scheduler-free generation loop the
reference for every run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.engine.scheduler import Scheduler
from graphrunner.protocol import ModelRunnerOutput, SamplingParams, SchedulerOutput

VOCAB = 50
EOS = 3


def history_token(tokens: list[int], vocab: int = VOCAB) -> int:
    """A deterministic function of the whole history (a polynomial rolling hash)."""
    h = 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
    return h % vocab


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------ fake runner


@dataclass
class _RunnerReq:
    tokens: list[int]
    num_computed: int
    block_ids: list[int]


@dataclass
class FakeRunner:
    """Implements execute_model / sample_tokens the way a real runner tracks requests."""

    block_size: int
    max_model_len: int
    next_token: object = history_token
    reqs: dict[str, _RunnerReq] = field(default_factory=dict)
    _pending: SchedulerOutput | None = None

    def execute_model(self, so: SchedulerOutput) -> None:
        assert self._pending is None, "execute_model twice without sample_tokens"
        # Removal first: a request finished or preempted this step must be one we hold.
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            assert req_id in self.reqs, f"runner asked to drop unknown request {req_id}"
            del self.reqs[req_id]
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs, f"request {new.req_id} is already live in the runner"
            self.reqs[new.req_id] = _RunnerReq(list(new.all_token_ids), new.num_computed_tokens, list(new.block_ids))
        cached = so.scheduled_cached_reqs
        assert len(cached.req_ids) == len(cached.new_block_ids) == len(cached.num_computed_tokens)
        rows = zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True)
        for req_id, new_blocks, num_computed in rows:
            state = self.reqs[req_id]
            assert num_computed == state.num_computed, f"{req_id}: scheduler and runner disagree on progress"
            state.block_ids += new_blocks or []
        scheduled = [n.req_id for n in so.scheduled_new_reqs] + cached.req_ids
        assert len(scheduled) == len(set(scheduled))
        assert set(scheduled) == set(so.num_scheduled_tokens)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        for req_id, n in so.num_scheduled_tokens.items():
            state = self.reqs[req_id]
            end = state.num_computed + n
            assert n >= 1
            assert end <= len(state.tokens), f"{req_id}: scheduled past its known tokens"
            assert end <= self.max_model_len, f"{req_id}: scheduled past max_model_len"
            assert len(state.block_ids) * self.block_size >= end, f"{req_id}: not enough blocks for its tokens"
            assert len(state.block_ids) <= cdiv(self.max_model_len, self.block_size)
        self._pending = so

    def sample_tokens(self) -> ModelRunnerOutput:
        so, self._pending = self._pending, None
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            state = self.reqs[req_id]
            state.num_computed += so.num_scheduled_tokens[req_id]
            if state.num_computed < len(state.tokens):
                sampled.append([])  # partial prefill: nothing to sample yet
                continue
            token = self.next_token(state.tokens)
            state.tokens.append(token)
            sampled.append([token])
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


# ------------------------------------------------------------------------------ drivers


def reference_generate(prompt, params: SamplingParams, max_model_len: int, eos=(EOS,), next_token=history_token):
    """Scheduler-free generation: the expected tokens and finish reason of one request."""
    tokens, out = list(prompt), []
    while True:
        tok = next_token(tokens)
        tokens.append(tok)
        out.append(tok)
        if (not params.ignore_eos and tok in eos) or tok in params.stop_token_ids:
            return out, "stop"
        if len(out) >= params.max_tokens or len(tokens) >= max_model_len:
            return out, "length"


def check_blocks(sched: Scheduler) -> None:
    """No block is held by two live requests; counts add up; only running requests hold blocks."""
    held = [b for r in sched.running for b in r.block_ids]
    assert len(held) == len(set(held)), "a block is held by two live requests"
    assert len(held) == sched.block_allocator.num_used
    assert all(sched.block_allocator.is_allocated(b) for b in held)
    assert all(not r.block_ids for r in sched.waiting)
    assert len(sched.running) <= sched.max_num_seqs


def run_engine(sched: Scheduler, runner: FakeRunner, requests, max_steps: int = 5000):
    """Drive `sched` + `runner` to completion, checking every step. Returns (outputs, steps)."""
    for req_id, prompt, params in requests:
        sched.add_request(req_id, prompt, params)
    outputs, steps = {}, []
    while sched.has_unfinished_requests():
        assert len(steps) < max_steps, "no progress"
        so = sched.schedule()
        check_blocks(sched)
        assert 0 < so.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= sched.max_num_seqs
        assert not so.preempted_req_ids & set(so.num_scheduled_tokens), "preempted and scheduled in one step"
        if not sched.enable_chunked_prefill:
            for new in so.scheduled_new_reqs:
                assert so.num_scheduled_tokens[new.req_id] == len(new.all_token_ids), "prefill was chunked"
        runner.execute_model(so)
        for out in sched.update_from_output(so, runner.sample_tokens()):
            assert out.req_id not in outputs
            outputs[out.req_id] = out
        check_blocks(sched)
        steps.append(so)
    assert sched.block_allocator.num_free == sched.num_blocks, "blocks leaked"
    # The last finishes reach the runner with the next step; then it must hold nothing.
    last = sched.schedule()
    assert last.total_num_scheduled_tokens == 0
    runner.execute_model(last)
    runner.sample_tokens()
    assert runner.reqs == {}, f"runner still holds {sorted(runner.reqs)}"
    return outputs, steps


def make_scheduler(**kw) -> Scheduler:
    kw.setdefault("vocab_size", VOCAB)
    kw.setdefault("eos_token_ids", (EOS,))
    return Scheduler(**kw)


# ------------------------------------------------------------------------------ strategies


@st.composite
def workloads(draw, *, tight: bool = True, chunked: bool | None = None):
    block_size = draw(st.sampled_from([2, 4, 8]))
    max_model_len = draw(st.integers(8, 48))
    chunked = draw(st.booleans()) if chunked is None else chunked
    lo_budget = 1 if chunked else max_model_len
    budget = draw(st.integers(lo_budget, max(lo_budget, 64)))
    max_num_seqs = draw(st.integers(1, 6))
    n = draw(st.integers(1, 8))
    requests = []
    for i in range(n):
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=max_model_len))
        params = SamplingParams(
            max_tokens=draw(st.integers(1, 24)),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)),
        )
        requests.append((f"r{i}", prompt, params))
    # The fewest blocks that let every request run alone; tight caches force preemption.
    need = max(
        cdiv(min(len(p) + sp.max_tokens - 1, max(len(p), max_model_len - 1)), block_size) for _, p, sp in requests
    )
    extra = draw(st.integers(0, 4)) if tight else 10_000
    return dict(
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        num_blocks=need + extra,
        enable_chunked_prefill=chunked,
    ), requests


# ------------------------------------------------------------------------------ properties


@settings(deadline=None)
@given(workloads())
def test_outputs_match_reference_under_any_batching(workload):
    """Every request ends with exactly the tokens and reason of a scheduler-free loop, and the
    run matches one with a cache big enough that nothing is ever preempted."""
    cfg, requests = workload
    outputs, _ = run_engine(make_scheduler(**cfg), FakeRunner(cfg["block_size"], cfg["max_model_len"]), requests)
    for req_id, prompt, params in requests:
        want = reference_generate(prompt, params, cfg["max_model_len"])
        got = outputs[req_id]
        assert (got.token_ids, got.finish_reason) == want, req_id
        assert got.prompt_token_ids == prompt

    roomy_cfg = dict(cfg, num_blocks=10_000, max_num_seqs=len(requests))
    roomy = make_scheduler(**roomy_cfg)
    roomy_outputs, _ = run_engine(roomy, FakeRunner(cfg["block_size"], cfg["max_model_len"]), requests)
    assert roomy.num_preemptions == 0
    assert {k: (v.token_ids, v.finish_reason) for k, v in roomy_outputs.items()} == {
        k: (v.token_ids, v.finish_reason) for k, v in outputs.items()
    }


def test_preemption_resumes_with_the_same_outputs():
    """Tight caches must actually preempt (in a good share of examples), and preempted
    requests must resume and finish exactly as without preemption."""
    preemptions: list[int] = []

    @settings(deadline=None)
    @given(workloads(chunked=True), st.integers(0, 2))
    def run(workload, extra_blocks):
        cfg, requests = workload
        # Long decodes under a generous budget and seat count make the cache the bottleneck.
        cfg.update(max_num_seqs=8, max_num_batched_tokens=64)
        requests = [(r, p, SamplingParams(max_tokens=24, ignore_eos=True)) for r, p, _ in requests]
        need = max(
            cdiv(min(len(p) + 23, max(len(p), cfg["max_model_len"] - 1)), cfg["block_size"]) for _, p, _ in requests
        )
        cfg["num_blocks"] = need + extra_blocks
        sched = make_scheduler(**cfg)
        outputs, steps = run_engine(sched, FakeRunner(cfg["block_size"], cfg["max_model_len"]), requests)
        assert sched.num_preemptions == sum(len(s.preempted_req_ids) for s in steps)
        preemptions.append(sched.num_preemptions)
        for req_id, prompt, params in requests:
            assert (outputs[req_id].token_ids, outputs[req_id].finish_reason) == reference_generate(
                prompt, params, cfg["max_model_len"]
            )

    run()
    print("preemptions per example:", preemptions)
    assert sum(1 for n in preemptions if n) >= len(preemptions) // 3, f"preemption too rare: {preemptions}"


@settings(deadline=None)
@given(workloads(tight=False), st.data())
def test_ignore_eos_runs_exactly_max_tokens(workload, data):
    cfg, requests = workload
    requests = [(r, p, SamplingParams(max_tokens=sp.max_tokens, ignore_eos=True)) for r, p, sp in requests]
    outputs, _ = run_engine(make_scheduler(**cfg), FakeRunner(cfg["block_size"], cfg["max_model_len"]), requests)
    L = cfg["max_model_len"]
    for req_id, prompt, params in requests:
        # Capped by max_model_len; a prompt that fills it still yields one token.
        want = min(params.max_tokens, max(L - len(prompt), 1))
        assert len(outputs[req_id].token_ids) == want
        assert outputs[req_id].finish_reason == "length"


def test_step_limits_and_chunked_prefill_schedule():
    """Budget and seat limits hold every step; running decodes go first, a long prompt
    fills the rest of the budget in chunks and only samples at its end."""
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=8, max_model_len=64, block_size=4, num_blocks=64)
    runner = FakeRunner(4, 64)
    sched.add_request("a", [1, 2], SamplingParams(max_tokens=20, ignore_eos=True))
    sched.add_request("b", [4, 5], SamplingParams(max_tokens=20, ignore_eos=True))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 2, "b": 2}
    runner.execute_model(so)
    sched.update_from_output(so, runner.sample_tokens())
    sched.add_request("long", list(range(20)), SamplingParams(max_tokens=2, ignore_eos=True))
    chunks = []
    for _ in range(4):
        so = sched.schedule()
        assert so.num_scheduled_tokens["a"] == so.num_scheduled_tokens["b"] == 1  # decodes first
        chunks.append(so.num_scheduled_tokens["long"])
        assert so.total_num_scheduled_tokens <= 8
        runner.execute_model(so)
        ro = runner.sample_tokens()
        long_sampled = ro.sampled_token_ids[ro.req_id_to_index["long"]]
        assert (long_sampled != []) == (sum(chunks) == 20)
        sched.update_from_output(so, ro)
    assert chunks == [6, 6, 6, 2]


def test_seat_limit_admits_in_arrival_order():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=100, max_model_len=32, block_size=4, num_blocks=64)
    for i in range(4):
        sched.add_request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    so = sched.schedule()
    assert [n.req_id for n in so.scheduled_new_reqs] == ["r0", "r1"]


def test_preempts_most_recent_and_requeues_it_first():
    # 3 blocks of 2 tokens: a holds 1, b holds 2; after step 1, a (2 tokens + 1 sampled)
    # needs a second block, and preempting b frees more than a needs.
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=16, block_size=2, num_blocks=3)
    runner = FakeRunner(2, 16)
    sched.add_request("a", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add_request("b", [3, 4, 5], SamplingParams(max_tokens=2, ignore_eos=True))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 2, "b": 3}
    runner.execute_model(so)
    sched.update_from_output(so, runner.sample_tokens())
    b_first = sched.requests["b"].output_token_ids[0]
    sched.add_request("d", [4], SamplingParams(max_tokens=1))

    so = sched.schedule()
    assert so.preempted_req_ids == {"b"} and so.num_scheduled_tokens == {"a": 1}
    assert sched.block_allocator.num_free == 1
    assert not so.scheduled_new_reqs  # the cache is full: no admissions in a step that had to preempt
    assert [r.req_id for r in sched.waiting] == ["b", "d"]  # back to the front
    b = sched.requests["b"]
    assert (b.num_computed_tokens, b.block_ids, b.num_preemptions) == (0, [], 1)
    runner.execute_model(so)
    sched.update_from_output(so, runner.sample_tokens())

    while "b" not in so.num_scheduled_tokens:
        so = sched.schedule()
        runner.execute_model(so)
        sched.update_from_output(so, runner.sample_tokens())
    (resumed,) = [n for n in so.scheduled_new_reqs if n.req_id == "b"]
    assert resumed.output_token_ids == [b_first] and resumed.num_computed_tokens == 0
    assert so.num_scheduled_tokens["b"] == 4  # prompt + the token generated before preemption


def test_request_preempts_itself_when_it_is_the_most_recent():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=16, block_size=2, num_blocks=3)
    runner = FakeRunner(2, 16)
    sched.add_request("a", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add_request("b", [3, 4], SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add_request("c", [5], SamplingParams(max_tokens=1, ignore_eos=True))
    so = sched.schedule()
    runner.execute_model(so)
    sched.update_from_output(so, runner.sample_tokens())  # c finishes: one block free
    so = sched.schedule()  # a takes the free block; b, the newest, can only preempt itself
    assert so.num_scheduled_tokens == {"a": 1} and so.preempted_req_ids == {"b"}
    assert so.finished_req_ids == {"c"}


# ------------------------------------------------------------------------------ stops


def _run_one(prompt, params, next_token, max_model_len=32, eos=(EOS,)):
    sched = make_scheduler(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=max_model_len, block_size=4, num_blocks=32,
        eos_token_ids=eos,
    )
    outputs, _ = run_engine(sched, FakeRunner(4, max_model_len, next_token=next_token), [("x", prompt, params)])
    return outputs["x"]


def _eos_after(k, prompt_len):
    return lambda toks: EOS if len(toks) == prompt_len + k - 1 else 7


def test_stops_on_eos():
    out = _run_one([1, 2, 3], SamplingParams(max_tokens=10), _eos_after(4, 3))
    assert out.token_ids == [7, 7, 7, EOS] and out.finish_reason == "stop"


def test_ignore_eos_generates_through_eos():
    out = _run_one([1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True), _eos_after(4, 3))
    assert len(out.token_ids) == 10 and out.token_ids[3] == EOS and out.finish_reason == "length"


def test_stop_token_ids_stop_even_with_ignore_eos():
    out = _run_one([1], SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[9]),
                   lambda toks: 9 if len(toks) == 3 else 7)
    assert out.token_ids == [7, 7, 9] and out.finish_reason == "stop"


def test_eos_on_last_allowed_token_reads_as_stop():
    out = _run_one([1, 2], SamplingParams(max_tokens=2), _eos_after(2, 2))
    assert out.token_ids == [7, EOS] and out.finish_reason == "stop"


def test_max_model_len_caps_generation():
    out = _run_one(list(range(10)), SamplingParams(max_tokens=100, ignore_eos=True), lambda t: 7, max_model_len=16)
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_prompt_filling_max_model_len_yields_one_token():
    out = _run_one(list(range(16)), SamplingParams(max_tokens=5), lambda t: 7, max_model_len=16)
    assert out.token_ids == [7] and out.finish_reason == "length"


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], SamplingParams(), "prompt is empty"),
        (list(range(17)), SamplingParams(), "prompt length 17 exceeds max_model_len=16"),
        ([1, VOCAB], SamplingParams(), f"token id {VOCAB} is out of range for vocab_size={VOCAB}"),
        ([-1], SamplingParams(), "token id -1 is out of range"),
        ([1] * 10, SamplingParams(max_tokens=7), "needs up to 4 KV blocks .* num_blocks=3"),
    ],
)
def test_bad_requests_are_rejected_without_disturbing_others(prompt, params, match):
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16, block_size=4, num_blocks=3)
    sched = make_scheduler(**cfg)
    runner = FakeRunner(4, 16)
    sched.add_request("good", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    so = sched.schedule()
    runner.execute_model(so)
    sched.update_from_output(so, runner.sample_tokens())
    with pytest.raises(ValueError, match=match):
        sched.add_request("bad", prompt, params)
    assert "bad" not in sched.requests and len(sched.waiting) == 0
    outputs, _ = run_engine(sched, runner, [("good2", [5], SamplingParams(max_tokens=2, ignore_eos=True))])
    assert len(outputs["good"].token_ids) == 3 and len(outputs["good2"].token_ids) == 2


def test_duplicate_req_id_is_rejected():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16, block_size=4, num_blocks=8)
    sched.add_request("x", [1], SamplingParams())
    with pytest.raises(ValueError, match="duplicate req_id 'x'"):
        sched.add_request("x", [2], SamplingParams())
    assert sched.requests["x"].prompt_token_ids == [1]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(max_num_seqs=0), "max_num_seqs=0"),
        (dict(block_size=0), "block_size=0"),
        (dict(num_blocks=0), "num_blocks=0"),
        (dict(max_num_batched_tokens=8, enable_chunked_prefill=False), "max_num_batched_tokens=8 < max_model_len=16"),
    ],
)
def test_bad_scheduler_config(kw, match):
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16, block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match=match):
        Scheduler(**{**cfg, **kw})


def test_runner_output_mismatch_is_an_error():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=4, max_model_len=16, block_size=4, num_blocks=8)
    sched.add_request("x", list(range(10)), SamplingParams())
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"x": 4}
    with pytest.raises(RuntimeError, match="prefill is partial"):
        sched.update_from_output(so, ModelRunnerOutput(["x"], {"x": 0}, [[5]]))


def test_abort_frees_blocks_and_tells_the_runner():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16, block_size=4, num_blocks=8)
    runner = FakeRunner(4, 16)
    sched.add_request("x", [1, 2, 3], SamplingParams(max_tokens=8))
    sched.add_request("y", [1, 2, 3], SamplingParams(max_tokens=8))
    so = sched.schedule()
    runner.execute_model(so)
    sched.update_from_output(so, runner.sample_tokens())
    out = sched.abort_request("x")
    assert out.finish_reason == "abort" and sched.block_allocator.num_used == 1
    so = sched.schedule()
    assert so.finished_req_ids == {"x"} and set(so.num_scheduled_tokens) == {"y"}
    runner.execute_model(so)
    assert "x" not in runner.reqs


def test_a_request_that_can_never_fit_fails_instead_of_spinning(monkeypatch):
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=16, block_size=2, num_blocks=1)
    monkeypatch.setattr(sched, "max_computed_tokens", lambda prompt_len, max_tokens: 1)  # break the add-time bound
    runner = FakeRunner(2, 16)
    with pytest.raises(RuntimeError, match="'x' needs 1 more KV blocks with the whole cache"):
        run_engine(sched, runner, [("x", [1], SamplingParams(max_tokens=10, ignore_eos=True))])
