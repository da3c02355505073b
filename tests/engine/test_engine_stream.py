"""Abort and streaming: `LLM.generate_stream`, `LLM.abort_request`, `Scheduler.finish_request`.

Greedy requests on builtin:tiny-llama (CPU), sync and with async scheduling: a streamed
request's deltas add up to what `generate` returns, and an abort (mid-prefill, mid-decode,
while waiting or preempted, with its tokens still in flight) ends that request only.
"""

from __future__ import annotations

import pytest

pytest.importorskip("graphrunner.runner")

from graphrunner.engine import LLM  # noqa: E402
from graphrunner.engine.request import RequestStatus  # noqa: E402
from graphrunner.engine.scheduler import Scheduler  # noqa: E402
from graphrunner.protocol import ModelRunnerOutput, SamplingParams  # noqa: E402

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], list(range(10, 40)), [9]]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
ENGINES = ["sync", "async"]


def make_llm(async_scheduling: bool, **kw) -> LLM:
    kw = {"device": "cpu", "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 64,
          "num_kv_blocks": 64, "block_size": 4, **kw}
    return LLM("builtin:tiny-llama", async_scheduling=async_scheduling, **kw)


@pytest.fixture(scope="module", params=ENGINES)
def llm(request) -> LLM:
    return make_llm(request.param == "async")


@pytest.fixture(scope="module")
def reference(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def collect(stream, on_delta=None) -> dict[str, list]:
    """{req_id: [deltas]} of a stream; `on_delta(delta, seen)` runs after each (seen: tokens so far)."""
    got: dict[str, list] = {}
    seen: dict[str, list[int]] = {}
    for d in stream:
        assert not (got.get(d.req_id) and got[d.req_id][-1].finished), "a delta after the last one"
        got.setdefault(d.req_id, []).append(d)
        seen.setdefault(d.req_id, []).extend(d.token_ids)
        if on_delta is not None:
            on_delta(d, seen[d.req_id])
    return got


def tokens_of(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def assert_clean(llm: LLM) -> None:
    assert not llm.scheduler.has_unfinished_requests() and not llm._in_flight
    llm.step()  # hands the last finished ids to the runner
    assert llm.scheduler.block_allocator.num_free == llm.scheduler.num_blocks


def test_stream_yields_tokens_in_order_and_adds_up_to_generate(llm, reference):
    got = collect(llm.generate_stream(PROMPTS, GREEDY))
    ids = sorted(got, key=int)
    assert [tokens_of(got[r]) for r in ids] == reference
    for r in ids:
        assert [d.finish_reason for d in got[r]] == [None] * (len(got[r]) - 1) + ["length"]
        assert all(d.token_ids for d in got[r])  # each delta has news
        assert all(d.text == "" for d in got[r])  # no tokenizer: no text
    assert_clean(llm)


def test_stream_per_prompt_params_and_logprobs(llm):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1) for n in (3, 6, 1, 4)]
    full = llm.generate(PROMPTS, params)
    got = collect(llm.generate_stream(PROMPTS, params))
    for o, r in zip(full, sorted(got, key=int), strict=True):
        assert tokens_of(got[r]) == o.token_ids
        assert [lp for d in got[r] for lp in d.logprobs] == o.logprobs


@pytest.mark.parametrize("victim, after", [(1, 3), (0, 1), (2, 9)])
def test_abort_mid_stream_ends_that_request_only(llm, reference, victim, after):
    victim_id = str(llm._next_req_id + victim)
    aborted = []

    def on_delta(d, seen):
        if d.req_id == victim_id and len(seen) >= after and not aborted:
            aborted.append(len(seen))
            llm.abort_request(victim_id)

    got = collect(llm.generate_stream(PROMPTS, GREEDY), on_delta)
    ids = sorted(got, key=int)
    for i, r in enumerate(ids):
        toks = tokens_of(got[r])
        if i == victim:
            assert got[r][-1].finish_reason == "abort"
            assert toks == reference[i][:aborted[0]]  # the tokens seen when it was aborted, no more
        else:
            assert toks == reference[i] and got[r][-1].finish_reason == "length"
    assert_clean(llm)


def test_abort_with_its_next_token_in_flight_drops_that_output():
    """Async: when a request's first token is resolved, its next step is already launched; an
    abort then leaves that step's token for it to be dropped when the step resolves."""
    llm = make_llm(True)
    reference = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    in_flight = []

    def on_delta(d, seen):
        if d.req_id == "4" and not in_flight:
            in_flight.append(any("4" in so.num_scheduled_tokens for so, _ in llm._in_flight))
            llm.abort_request("4")

    got = collect(llm.generate_stream(PROMPTS, GREEDY), on_delta)
    assert in_flight == [True]
    assert tokens_of(got["4"]) == reference[0][:1] and got["4"][-1].finish_reason == "abort"
    assert [tokens_of(got[r]) for r in ("5", "6", "7")] == reference[1:]
    assert_clean(llm)


def test_leaving_a_stream_early_aborts_the_rest(llm, reference):
    stream = llm.generate_stream(PROMPTS, GREEDY)
    llm.abort_request(next(stream).req_id)  # its final output is never taken
    stream.close()
    assert not llm.scheduler.has_unfinished_requests()
    assert llm.step() == []  # nothing of the left stream is reported later
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert_clean(llm)


def _abort_when(req, rid: str, ids: list[str], steps: int, aborted: dict[str, str]) -> str | None:
    """Why to abort `req` now (each case once), or None."""
    waiting = req.status == RequestStatus.WAITING
    if rid == ids[0] and 0 < req.num_computed_tokens < len(req.prompt_token_ids):
        return "mid-prefill"
    if rid == ids[3] and waiting and steps == 1 and not req.num_preemptions:
        return "never admitted"
    if waiting and req.num_preemptions > 0 and "preempted" not in aborted.values():
        return "preempted"
    return None


SCENARIOS = {  # (engine kwargs, prompts, the aborts expected)
    "prefill_and_waiting": (dict(max_num_seqs=2, max_num_batched_tokens=8),
                            [list(range(10, 40)), [4, 5, 6], [7, 8], [9, 10, 11, 12]],
                            ["mid-prefill", "never admitted"]),
    "preempted": (dict(max_num_seqs=4, num_kv_blocks=10), [[1, 2, 3], [4, 5, 6], [7, 8], [9, 10, 11]], ["preempted"]),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("engine", ENGINES)
def test_abort_mid_prefill_waiting_and_preempted_through_step(engine, scenario):
    """A step() loop with aborts: mid-prefill (8-token chunks of a 30-token prompt), never admitted
    (max_num_seqs=2), and preempted (a 10-block cache); the others keep their tokens and every
    block returns to the pool."""
    kw, prompts, expected = SCENARIOS[scenario]
    # The reference run below would leave the prompts cached: a re-run must prefill them for real.
    llm = make_llm(engine == "async", enable_prefix_caching=False, **kw)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    reference = [o.token_ids for o in llm.generate(prompts, params)]
    base = llm._next_req_id
    ids = [str(base + i) for i in range(len(prompts))]
    llm._add_requests(prompts, params, stream=False)
    sched, finished, aborted = llm.scheduler, {}, {}
    steps = 0
    while sched.has_unfinished_requests() or llm._outputs.has_pending:
        for out in llm.step():
            finished[out.req_id] = out
        steps += 1
        for rid, req in list(sched.requests.items()):
            why = _abort_when(req, rid, ids, steps, aborted)
            if why is not None:
                aborted[rid] = why
                llm.abort_request(rid)
    llm.step()
    assert sorted(aborted.values()) == expected
    for i, rid in enumerate(ids):
        out = finished[rid]
        if rid in aborted:
            assert out.finish_reason == "abort" and out.token_ids == reference[i][:len(out.token_ids)]
        else:
            assert out.finish_reason == "length" and out.token_ids == reference[i]
    assert sched.block_allocator.num_free == sched.num_blocks


def test_abort_request_reports_through_step_and_ignores_unknown_ids():
    llm = make_llm(False)
    llm._add_requests(PROMPTS[:2], GREEDY, stream=False)
    llm.step()
    llm.abort_request(["0", "nope"])
    llm.abort_request("0")  # already aborted: ignored
    outs = {o.req_id: o for o in llm.step()}
    assert outs["0"].finish_reason == "abort" and len(outs["0"].token_ids) == 1
    while llm.scheduler.has_unfinished_requests():
        outs.update({o.req_id: o for o in llm.step()})
    assert outs["1"].finish_reason == "length" and len(outs["1"].token_ids) == GREEDY.max_tokens


# ------------------------------------------------------------------ the scheduler alone (async)


def _output(so, token: int = 7) -> ModelRunnerOutput:
    """A sampled token for every request of the plan whose chunk reaches the end of its tokens."""
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, [[token] for _ in req_ids])


def test_scheduler_drops_outputs_of_a_request_aborted_with_steps_in_flight():
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32, block_size=4, num_blocks=16,
                      async_scheduling=True)
    sched.add_request("a", [1, 2, 3], GREEDY)
    sched.add_request("b", [4, 5], GREEDY)
    so1 = sched.schedule()
    so2 = sched.schedule()  # both decode on their in-flight placeholders
    assert set(so2.num_scheduled_tokens) == {"a", "b"}
    out = sched.abort_request("a")
    assert out.finish_reason == "abort" and out.token_ids == []
    with pytest.raises(ValueError, match="duplicate req_id 'a'"):  # its steps are still in flight
        sched.add_request("a", [1], GREEDY)
    assert sched.update_from_output(so1, _output(so1)) == []
    assert sched.update_from_output(so2, _output(so2)) == []
    assert sched.requests["b"].output_token_ids == [7, 7]
    so3 = sched.schedule()
    assert so3.finished_req_ids == {"a"} and "a" not in so3.num_scheduled_tokens
    sched.add_request("a", [1], GREEDY)  # reported and no step in flight: the id is free again


def test_scheduler_finish_request_with_a_status():
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32, block_size=4, num_blocks=16)
    sched.add_request("a", [1, 2, 3], GREEDY)
    sched.schedule()
    out = sched.finish_request("a", RequestStatus.FINISHED_STOPPED)
    assert out.finish_reason == "stop" and sched.finish_request("a", RequestStatus.FINISHED_STOPPED) is None
    assert sched.schedule().finished_req_ids == {"a"}
    assert sched.block_allocator.num_free == sched.num_blocks


def test_readme_streaming_example_runs(capsys):
    """README.md's "## Streaming, abort, text in and out": its first python block runs as written."""
    import re
    from pathlib import Path

    section = (Path(__file__).resolve().parents[2] / "README.md").read_text().split(
        "## Streaming, abort, text in and out", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme_stream"})
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].endswith("length") and any(line.endswith("abort") for line in lines)
    assert sum(line.startswith("1 ") for line in lines) == 2  # one token, then the abort


# ------------------------------------------------------------------ pipelined PP (gloo, 2 ranks)


def _pp_stream_with_abort(rank: int, world: int) -> dict:
    """Every stage runs the same stream and aborts the same request at the same delta (SPMD)."""
    llm = LLM("builtin:tiny-llama", pipeline_parallel_size=world, device="cpu", max_num_seqs=6,
              max_num_batched_tokens=24, max_model_len=64, seed=3, collective_timeout_s=30.0,
              enable_prefix_caching=False)  # the reference run must not leave the prompts cached
    reference = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    victim = str(llm._next_req_id + 1)
    in_flight: list[bool] = []
    victim_seen: list[int] = []

    def on_delta(d, seen):
        # Abort on another request's delta while a launched step still computes the victim.
        if d.req_id == victim:
            victim_seen[:] = seen
        elif not in_flight and len(victim_seen) >= 2 and any(victim in so.num_scheduled_tokens
                                                              for so, _ in llm._in_flight):
            in_flight.append(True)
            llm.abort_request(victim)

    got = collect(llm.generate_stream(PROMPTS, GREEDY), on_delta)
    after = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    info = {"reference": reference, "after": after, "in_flight": in_flight,
            "streamed": {r: (tokens_of(ds), ds[-1].finish_reason) for r, ds in got.items()},
            "victim": victim, "pipelined": llm.runner.pp is not None and llm.runner.pp.defers_tokens}
    llm.shutdown()
    return info


def test_abort_mid_stream_under_pipelined_pp():
    from tests.dist_utils import run_world

    for rank, info in enumerate(run_world(2, _pp_stream_with_abort, timeout_s=180)):
        reference, streamed, victim = info["reference"], info["streamed"], info["victim"]
        assert info["pipelined"] == (rank == 0) and info["in_flight"] == [True]
        for i, r in enumerate(sorted(streamed, key=int)):
            toks, reason = streamed[r]
            if r == victim:
                assert reason == "abort" and toks == reference[i][:len(toks)] and len(toks) >= 2
            else:
                assert (toks, reason) == (reference[i], "length"), f"rank {rank} request {r}"
        assert info["after"] == reference  # the engine keeps serving, same tokens
