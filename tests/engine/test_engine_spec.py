"""Speculative decoding on the engine side: the reference `Scheduler` and `LLM`.

Three layers:

1. The scheduler alone, fed hand-made `ModelRunnerOutput`s: decodes are planned as
   1 + k tokens (capped by max_model_len and the budget), num_computed_tokens follows the
   emitted tokens (sync at once, async one step late), a stop token or max_tokens inside an
   accepted run truncates it, preemption with a verifying step in flight stays consistent.
2. The scheduler against a fake speculative runner (hypothesis): the runner keeps the
   device's token history and its own host count of computed tokens the way `ModelRunner`
   does (advance by q at launch, take the rejected back when the output is taken), checks
   every plan, verifies drafts of a deterministic drafter against a greedy "model", and the
   outputs must equal scheduler-free greedy generation.
3. `LLM` over the real runner on CPU: greedy with n-gram speculation gives exactly the
   tokens of greedy without it; skipped while the runner does not support speculation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.engine.scheduler import Scheduler
from graphrunner.protocol import Logprob, ModelRunnerOutput, SamplingParams, SchedulerOutput

VOCAB = 50
EOS = 3


def history_token(tokens: list[int]) -> int:
    """The greedy "model": a deterministic function of the whole history."""
    h = 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
    return h % VOCAB


def make_scheduler(k: int, **kw) -> Scheduler:
    kw = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 64, "block_size": 4,
          "num_blocks": 64, "vocab_size": VOCAB, "eos_token_ids": (EOS,), "num_speculative_tokens": k, **kw}
    return Scheduler(**kw)


def output(so: SchedulerOutput, logprobs: bool = False, **emitted: list[int]) -> ModelRunnerOutput:
    """The runner's answer to `so`: `emitted[req_id]` tokens per request ([] when not given)."""
    req_ids = list(so.num_scheduled_tokens)
    sampled = [emitted.get(rid, []) for rid in req_ids]
    lps = [[{t: Logprob(-0.5, 1)} for t in toks] for toks in sampled] if logprobs else None
    return ModelRunnerOutput(req_ids, {rid: i for i, rid in enumerate(req_ids)}, sampled, lps)


def cached_computed(so: SchedulerOutput) -> dict[str, int]:
    cached = so.scheduled_cached_reqs
    return dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))


GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


# ------------------------------------------------------------------------------ 1. hand-made outputs


def test_decodes_are_planned_as_one_plus_k_tokens():
    sched = make_scheduler(3)
    sched.add_request("a", [1] * 5, GREEDY)
    sched.add_request("b", [2] * 6, GREEDY)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 5, "b": 6}  # prefill: no drafts
    sched.update_from_output(so, output(so, a=[7], b=[8]))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 4, "b": 4} and so.total_num_scheduled_tokens == 8
    assert cached_computed(so) == {"a": 5, "b": 6}
    assert so.scheduled_spec_decode_tokens == {}  # the runner places its own drafts
    assert len(sched.requests["a"].block_ids) == 3  # room for 5 + 4 slots, drafts included


def test_a_decode_is_capped_by_max_model_len_and_the_budget():
    sched = make_scheduler(4, max_model_len=12, max_num_batched_tokens=13)
    sched.add_request("a", [1] * 9, GREEDY)
    sched.add_request("b", [2] * 3, GREEDY)
    so = sched.schedule()
    sched.update_from_output(so, output(so, a=[5], b=[6]))
    so = sched.schedule()
    # a: 9 computed, 3 slots left under max_model_len; b: 13 - 3 = 10 >= 5 left of the budget.
    assert so.num_scheduled_tokens == {"a": 3, "b": 5}
    sched.update_from_output(so, output(so, a=[5, 5, 5], b=[6]))
    assert sched.requests.get("a") is None  # 9 + 3 = 12 tokens: max_model_len, the run's last token dropped

    tight = make_scheduler(4, max_num_batched_tokens=7)
    tight.add_request("a", [1] * 3, GREEDY)
    tight.add_request("b", [2] * 3, GREEDY)
    so = tight.schedule()
    tight.update_from_output(so, output(so, a=[5], b=[6]))
    assert tight.schedule().num_scheduled_tokens == {"a": 5, "b": 2}


@pytest.mark.parametrize("emitted", [1, 2, 3, 4])
def test_sync_num_computed_follows_the_emitted_tokens(emitted):
    sched = make_scheduler(3)
    sched.add_request("a", [1] * 5, GREEDY)
    so = sched.schedule()
    sched.update_from_output(so, output(so, a=[7]))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 4}
    sched.update_from_output(so, output(so, a=[9] * emitted))
    req = sched.requests["a"]
    assert req.num_computed_tokens == 5 + emitted and req.num_output_tokens == 1 + emitted
    so = sched.schedule()
    assert cached_computed(so) == {"a": 5 + emitted} and so.num_scheduled_tokens == {"a": 4}
    assert len(req.block_ids) * 4 >= 5 + emitted + 4


@pytest.mark.parametrize("emitted", [1, 2, 3])
def test_async_num_computed_takes_the_rejected_back_one_step_late(emitted):
    sched = make_scheduler(2, async_scheduling=True)
    sched.add_request("a", [1] * 5, GREEDY)
    so1 = sched.schedule()
    so2 = sched.schedule()  # step 1 still in flight: decode with placeholders
    assert so2.num_scheduled_tokens == {"a": 3} and cached_computed(so2) == {"a": 5}
    sched.update_from_output(so1, output(so1, a=[7]))
    so3 = sched.schedule()
    assert so3.num_scheduled_tokens == {"a": 3} and cached_computed(so3) == {"a": 8}  # counts all of step 2
    sched.update_from_output(so2, output(so2, a=[9] * emitted))
    req = sched.requests["a"]
    assert req.num_output_tokens == 1 + emitted and req.num_output_placeholders == 1
    so4 = sched.schedule()
    # True KV: 5 + emitted tokens; step 3 (in flight) counted in full, as the runner counts it.
    assert cached_computed(so4) == {"a": 5 + emitted + 3}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_stop_token_inside_an_accepted_run_ends_the_request(async_scheduling):
    sched = make_scheduler(3, async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=0)
    sched.add_request("a", [1] * 5, params)
    so = sched.schedule()
    if async_scheduling:
        so2 = sched.schedule()
        sched.update_from_output(so, output(so, logprobs=True, a=[7]))
        so3 = sched.schedule()  # launched before step 2's stop is known
        finished = sched.update_from_output(so2, output(so2, logprobs=True, a=[10, EOS, 12, 13]))
        assert sched.update_from_output(so3, output(so3, a=[20])) == []  # its tokens are discarded
    else:
        sched.update_from_output(so, output(so, logprobs=True, a=[7]))
        so = sched.schedule()
        finished = sched.update_from_output(so, output(so, logprobs=True, a=[10, EOS, 12, 13]))
    [out] = finished
    assert out.token_ids == [7, 10, EOS] and out.finish_reason == "stop" and len(out.logprobs) == 3
    assert sched.block_allocator.num_free == sched.num_blocks
    assert sched.schedule().finished_req_ids == {"a"}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_max_tokens_inside_an_accepted_run_truncates_it(async_scheduling):
    sched = make_scheduler(4, async_scheduling=async_scheduling)
    sched.add_request("a", [1] * 5, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    so = sched.schedule()
    if async_scheduling:
        so2 = sched.schedule()
        sched.update_from_output(so, output(so, a=[7]))
        so = so2
    else:
        sched.update_from_output(so, output(so, a=[7]))
        so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 5}  # not capped by max_tokens: uniform batches
    [out] = sched.update_from_output(so, output(so, a=[8, 9, 10, 11, 12]))
    assert out.token_ids == [7, 8, 9] and out.finish_reason == "length"


def test_async_preemption_with_a_verify_step_in_flight():
    """b is preempted while its verifying step runs: its tokens still land, nothing goes negative,
    and it is resumed with every token and nothing computed."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    sched = make_scheduler(2, async_scheduling=True, num_blocks=5)  # 4 + 8 - 1 + 2 * 2 = 15 slots: 4 blocks each
    sched.add_request("a", [1] * 4, params)
    sched.add_request("b", [2] * 4, params)
    so1 = sched.schedule()
    so2 = sched.schedule()  # both verify 2 drafts: 2 blocks each, 4 of 5 used
    assert so2.num_scheduled_tokens == {"a": 3, "b": 3}
    sched.update_from_output(so1, output(so1, a=[5], b=[6]))
    so3 = sched.schedule()  # a grows to 3 blocks; b (the tail) must make room: preempted, step 2 in flight
    assert so3.preempted_req_ids == {"b"} and so3.num_scheduled_tokens == {"a": 3}
    b = sched.requests["b"]
    assert b.num_computed_tokens == 0 and b.num_output_placeholders == 1
    sched.update_from_output(so2, output(so2, a=[7, 7], b=[8, 8, 8]))
    assert b.num_computed_tokens == 0 and b.num_output_placeholders == 0 and b.output_token_ids == [6, 8, 8, 8]
    assert sched.requests["a"].num_computed_tokens == 4 + 2 + 3  # true 6, plus step 3 in flight
    so4 = sched.schedule()
    assert cached_computed(so4) == {"a": 9}
    [resumed] = so4.scheduled_new_reqs
    assert resumed.req_id == "b" and resumed.all_token_ids == [2] * 4 + [6, 8, 8, 8]
    assert resumed.num_computed_tokens == 0 and so4.num_scheduled_tokens["b"] == 8  # prefill again: no drafts


def test_more_tokens_than_draft_slots_is_an_error():
    sched = make_scheduler(2)
    sched.add_request("a", [1] * 5, GREEDY)
    so = sched.schedule()
    with pytest.raises(RuntimeError, match="at most 1"):
        sched.update_from_output(so, output(so, a=[7, 8]))  # a prefill chunk emits one token
    sched = make_scheduler(2)
    sched.add_request("a", [1] * 5, GREEDY)
    so = sched.schedule()
    sched.update_from_output(so, output(so, a=[7]))
    so = sched.schedule()
    with pytest.raises(RuntimeError, match="at most 3"):
        sched.update_from_output(so, output(so, a=[7, 8, 9, 10]))


def test_speculative_settings_are_checked():
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            make_scheduler(bad)
    # A request must fit the cache alone, its draft slots included (16 slots: 8 + 8 - 1 fits, + 2 not).
    make_scheduler(0, num_blocks=4).add_request("a", [1] * 8, SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match=r"\+ 2 draft slots"):
        make_scheduler(2, num_blocks=4).add_request("a", [1] * 8, SamplingParams(max_tokens=8))


# ------------------------------------------------------------------------------ 2. fake speculative runner


def draft(tokens: list[int], n: int, noise: int) -> list[int]:
    """n drafts: the model's own greedy continuation, wrong where the history hashes below `noise` (of 4)."""
    history, out = list(tokens), []
    for _ in range(n):
        t = history_token(history)
        if (history_token(history + [VOCAB]) % 4) < noise:
            t = (t + 1) % VOCAB
        out.append(t)
        history.append(t)
    return out


@dataclass
class _Row:
    tokens: list[int]  # the device's history, unresolved tokens included
    prefill_len: int
    computed: int  # tokens whose KV is valid
    mirror: int  # the runner's host count: what the scheduler must send
    blocks: int
    generation: int  # which admission of the request this row is


@dataclass
class _Pending:
    output: ModelRunnerOutput
    rejected: dict[str, tuple[int, int]]  # req_id -> (row generation, slots rejected)


@dataclass
class FakeSpecRunner:
    """Executes plans as `ModelRunner` does under speculation; fails on any plan it must reject."""

    sched: Scheduler
    noise: int
    rows: dict[str, _Row] = field(default_factory=dict)
    generations: int = 0
    stats: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("verifies", "accepted",
                                                                           "preempted_in_flight"), 0))

    def execute(self, so: SchedulerOutput, in_flight: set[str]) -> _Pending:
        s, k = self.sched, self.sched.num_speculative_tokens
        for rid in so.preempted_req_ids:
            self.stats["preempted_in_flight"] += rid in in_flight
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.rows.pop(rid, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.rows and new.num_computed_tokens == 0
            self.generations += 1
            tokens = list(new.all_token_ids)
            self.rows[new.req_id] = _Row(tokens, len(tokens), 0, 0, len(new.block_ids), self.generations)
        for rid, nc, blocks in zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens,
                                   so.scheduled_cached_reqs.new_block_ids, strict=True):
            assert self.rows[rid].mirror == nc, (rid, self.rows[rid].mirror, nc)
            self.rows[rid].blocks += len(blocks or [])
        assert so.scheduled_spec_decode_tokens == {}
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values()) <= s.max_num_batched_tokens
        req_ids, sampled, rejected = list(so.num_scheduled_tokens), [], {}
        for rid in req_ids:
            row, q = self.rows[rid], so.num_scheduled_tokens[rid]
            assert q >= 1 and row.mirror + q <= min(s.max_model_len, row.blocks * s.block_size), (rid, row, q)
            if row.mirror < row.prefill_len:  # a prefill chunk, within the known tokens
                assert row.mirror + q <= row.prefill_len
                row.computed += q
                row.mirror += q
                emitted = [history_token(row.tokens)] if row.computed == row.prefill_len else []
            else:
                emitted = self._verify(row, q, k)
                rejected[rid] = (row.generation, q - len(emitted))
            row.tokens += emitted
            sampled.append(emitted)
        out = ModelRunnerOutput(req_ids, {rid: i for i, rid in enumerate(req_ids)}, sampled)
        return _Pending(out, rejected)

    def _verify(self, row: _Row, q: int, k: int) -> list[int]:
        assert q <= 1 + k and row.computed == len(row.tokens) - 1  # only the last sampled token lacks KV
        accepted: list[int] = []
        for d in draft(row.tokens, q - 1, self.noise):
            if d != history_token(row.tokens + accepted):
                break
            accepted.append(d)
        self.stats["verifies"] += 1
        self.stats["accepted"] += len(accepted)
        emitted = accepted + [history_token(row.tokens + accepted)]
        row.computed += len(emitted)
        row.mirror += q
        return emitted

    def take(self, pending: _Pending) -> ModelRunnerOutput:
        """The step's output reaches the host: rows still held stop counting rejected slots."""
        for rid, (generation, n) in pending.rejected.items():
            row = self.rows.get(rid)
            if row is not None and row.generation == generation:
                row.mirror -= n
            assert row is None or row.computed <= row.mirror  # later steps in flight count in full
        return pending.output


def reference(prompt: list[int], params: SamplingParams, max_model_len: int) -> tuple[list[int], str]:
    tokens, out = list(prompt), []
    while True:
        out.append(history_token(tokens))
        tokens.append(out[-1])
        if (not params.ignore_eos and out[-1] == EOS) or out[-1] in params.stop_token_ids:
            return out, "stop"
        if len(out) >= params.max_tokens or len(tokens) >= max_model_len:
            return out, "length"


def check_scheduler(sched: Scheduler) -> None:
    held = [b for r in sched.running for b in r.block_ids]
    assert len(held) == len(set(held)) == sched.block_allocator.num_used
    for req in sched.requests.values():
        assert req.num_computed_tokens >= 0 and req.num_output_placeholders >= 0
        assert len(req.block_ids) * sched.block_size >= req.num_computed_tokens


def run(requests, *, k: int, async_scheduling: bool, noise: int = 1, **kw) -> tuple[dict, FakeSpecRunner]:
    """Drive a scheduler and the fake runner to the end, as `LLM` does (async: one step late)."""
    sched = make_scheduler(k, async_scheduling=async_scheduling, **kw)
    runner = FakeSpecRunner(sched, noise)
    for i, (prompt, params) in enumerate(requests):
        sched.add_request(str(i), prompt, params)
    results, in_flight = {}, None
    for _ in range(3000):
        if not (sched.has_unfinished_requests() or in_flight):
            break
        launched = None
        if sched.has_unfinished_requests():
            so = sched.schedule()
            check_scheduler(sched)
            assert so.total_num_scheduled_tokens or in_flight is not None, "stuck"
            pending = runner.execute(so, set(in_flight[0].num_scheduled_tokens) if in_flight else set())
            if so.total_num_scheduled_tokens:
                launched = (so, pending)
            if not async_scheduling and launched:
                results.update((o.req_id, o) for o in sched.update_from_output(so, runner.take(pending)))
                launched = None
        if in_flight is not None:
            results.update((o.req_id, o) for o in sched.update_from_output(in_flight[0], runner.take(in_flight[1])))
        check_scheduler(sched)
        in_flight = launched
    assert not sched.has_unfinished_requests() and sched.block_allocator.num_free == sched.num_blocks
    runner.execute(sched.schedule(), set())
    assert runner.rows == {}
    return {rid: (o.token_ids, o.finish_reason) for rid, o in results.items()}, runner


requests = st.lists(
    st.tuples(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
        st.builds(SamplingParams, max_tokens=st.integers(1, 16), temperature=st.just(0.0),
                  ignore_eos=st.booleans(), stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=2)),
    ),
    min_size=1,
    max_size=7,
)


@given(requests, st.integers(0, 4), st.booleans(), st.integers(0, 4), st.integers(11, 20), st.integers(1, 24),
       st.sampled_from([24, 32, 64]))
def test_speculative_scheduling_gives_the_greedy_tokens(reqs, k, async_scheduling, noise, num_blocks, budget,
                                                        max_model_len):
    """Any k, drafter quality, cache size (preemption), budget (chunked prefill), sync or async."""
    reqs = [(p[:max_model_len], params) for p, params in reqs]
    got, _ = run(reqs, k=k, async_scheduling=async_scheduling, noise=noise, num_blocks=num_blocks,
                 max_num_batched_tokens=budget, max_model_len=max_model_len)
    assert got == {str(i): reference(p, params, max_model_len) for i, (p, params) in enumerate(reqs)}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_speculation_accepts_drafts_and_survives_preemption(async_scheduling):
    """A workload that verifies, accepts, finishes inside runs and preempts (async: verifies in flight)."""
    reqs = [([i + 1] * (8 + i), SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)) for i in range(4)]
    reqs.append(([5, 6, 7], SamplingParams(max_tokens=14, temperature=0.0,
                                           stop_token_ids=[reference([5, 6, 7], GREEDY, 64)[0][4]])))
    got, runner = run(reqs, k=3, async_scheduling=async_scheduling, noise=1, num_blocks=16, max_num_batched_tokens=20)
    assert got == {str(i): reference(p, params, 64) for i, (p, params) in enumerate(reqs)}
    assert runner.stats["accepted"] > 0 and runner.sched.num_preemptions > 0
    if async_scheduling:
        assert runner.stats["preempted_in_flight"] > 0
    spec_steps = runner.stats["verifies"]
    _, plain = run(reqs, k=0, async_scheduling=async_scheduling, num_blocks=16, max_num_batched_tokens=20)
    assert spec_steps < plain.stats["verifies"]  # accepted drafts save decode steps


# ------------------------------------------------------------------------------ 3. LLM over the real runner

MODEL = "builtin:tiny-llama"
# 14 blocks of 4 tokens: a request needs up to 13 (20-token prompt + 24 outputs + 2 x 4 draft slots): preemption.
SMALL = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
             block_size=4, num_kv_blocks=14, seed=0)


def ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


def _workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(seed)
    prompts = [[1, 2, 3] * 5, [7] * 9, [5, 6, 7, 8] * 5, rng.integers(0, 2048, 20).tolist(),
               rng.integers(0, 2048, 6).tolist()]
    params = [SamplingParams(max_tokens=int(n), temperature=0.0, ignore_eos=True) for n in (24, 17, 9, 24, 12)]
    return prompts, params


@pytest.fixture(scope="module")
def plain():
    """Plain greedy generation (no speculation), memoised per workload: (outputs, steps)."""
    from graphrunner.engine import LLM

    llm, memo = LLM(MODEL, **SMALL), {}

    def generate(key, prompts, params):
        if key not in memo:
            memo[key] = _generate(llm, prompts, params)
        return memo[key]

    return generate


def _generate(llm, prompts, params) -> tuple[list[tuple[list[int], str | None]], int]:
    steps = []
    execute = llm.runner.execute_model

    def counting(so):
        steps.append(so.total_num_scheduled_tokens)
        return execute(so)

    llm.runner.execute_model = counting
    try:
        outs = llm.generate(prompts, params)
    finally:
        del llm.runner.execute_model
    return [(o.token_ids, o.finish_reason) for o in outs], sum(1 for n in steps if n)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_ngram_speculation_gives_the_tokens_of_plain_greedy(plain, k, async_scheduling):
    """Repetitive prompts (drafts accepted) and random ones, chunked prefill, preemption; stop
    tokens taken from the free run end requests inside accepted runs."""
    from graphrunner.engine import LLM

    llm = LLM(MODEL, speculative_config=ngram(k), async_scheduling=async_scheduling, **SMALL)
    assert llm.runner.uniform_decode_query_len == 1 + k and llm.scheduler.num_speculative_tokens == k
    prompts, params = _workload(k)
    expected, plain_steps = plain(("free", k), prompts, params)
    got, spec_steps = _generate(llm, prompts, params)
    assert got == expected
    assert llm.scheduler.num_preemptions > 0 and spec_steps < plain_steps
    stops = [SamplingParams(max_tokens=p.max_tokens, temperature=0.0, stop_token_ids=[toks[len(toks) // 2]])
             for p, (toks, _) in zip(params, expected, strict=True)]
    assert _generate(llm, prompts, stops)[0] == plain(("stop", k), prompts, stops)[0]
    assert llm.scheduler.block_allocator.num_free == llm.scheduler.num_blocks
    assert not llm.scheduler.has_unfinished_requests() and not llm._in_flight


def test_speculative_config_reaches_the_runner_as_dict_or_json():
    from graphrunner.engine import LLM

    llm = LLM(MODEL, speculative_config='{"method": "ngram", "num_speculative_tokens": 3}', **SMALL)
    assert llm.config.speculative.method == "ngram" and llm.config.speculative.num_speculative_tokens == 3
    assert llm.scheduler.num_speculative_tokens == 3
    assert LLM(MODEL, **SMALL).scheduler.num_speculative_tokens == 0


@pytest.mark.parametrize("config, match", [
    ({"method": "bogus", "num_speculative_tokens": 2}, "bogus"),
    ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens=-1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a dict"),
])
def test_bad_speculative_config_names_the_value(config, match):
    from graphrunner.engine import LLM

    with pytest.raises(ValueError, match=match):
        LLM(MODEL, speculative_config=config, **SMALL)


def test_cli_speculative_config(capsys):
    from graphrunner.cli import main

    assert main(["generate", "--device", "cpu", "--num-prompts", "3", "--prompt-len", "5", "--max-tokens", "6",
                 "--ignore-eos", "--num-kv-blocks", "64", "--max-model-len", "64", "--temperature", "0",
                 "--no-warmup", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']) == 0
    out = capsys.readouterr().out
    assert "generated tokens: 18" in out and "speculative:      ngram, k=2" in out


def test_cli_bad_speculative_config_exits_before_loading():
    from graphrunner.cli import main

    with pytest.raises(SystemExit, match="--speculative-config: .*'bogus'"):
        main(["generate", "--device", "cpu",
              "--speculative-config", '{"method": "bogus", "num_speculative_tokens": 2}'])
