"""Pipelined PP on CPU (gloo): 2, 3 and 4 stages give one process's tokens while batches overlap.

Under pipeline parallelism the engine keeps several batches in flight: a non-last stage runs
step T + 1 before step T's tokens come back from the last stage. By default
(`pp_token_placeholders`) a request runs again while its last token is still on its way, and
stage 0 applies that token on the device before the step's inputs (`PipelineStage.receive`);
with `pp_token_placeholders=False` the batches in flight are disjoint and each step's tokens
are applied when the engine resolves it (`PipelineStage.take_tokens`). Each world runs several
randomized workloads (request churn: prompts of many lengths, different max_tokens, so
requests finish and rows change hands mid-flight; chunked prefill under a small token budget;
a small KV cache that preempts) and compares every rank's tokens (greedy and seeded random
requests) with one process. It also checks that the pipeline really ran ahead (some step was
launched while an earlier one was still unresolved) and that each mode scheduled as it says
(requests with a token in flight: some with placeholders, none when disjoint).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.dist_utils import run_world

LLM_ARGS = dict(device="cpu", max_num_seqs=6, max_num_batched_tokens=24, max_model_len=96, seed=3,
                collective_timeout_s=30.0)
GRAPH_ARGS = dict(enforce_eager=False, compile_backend="eager", cudagraph_capture_sizes=[1, 2, 4, 8, 16, 24])


def _workloads(seed: int, count: int = 3) -> list[tuple[list[list[int]], list[int], list[int]]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(3, 9))
        prompts = [rng.integers(1, 2000, size=int(rng.integers(1, 40))).tolist() for _ in range(n)]
        out.append((prompts, rng.integers(1, 12, size=n).tolist(), rng.integers(0, 2, size=n).tolist()))
    return out


def _generate(rank: int, world: int, pp: int, extra: dict, seed: int) -> dict:
    from graphrunner.engine.llm import LLM
    from graphrunner.protocol import SamplingParams

    llm = LLM("builtin:tiny-llama", pipeline_parallel_size=pp, **{**LLM_ARGS, **extra})
    most_in_flight = 0  # steps launched and unresolved when the oldest one is resolved
    resolve = llm._resolve_oldest

    def counting_resolve():
        nonlocal most_in_flight
        most_in_flight = max(most_in_flight, len(llm._in_flight))
        return resolve()

    llm._resolve_oldest = counting_resolve  # type: ignore[method-assign]
    ran_ahead = 0  # requests scheduled while one of their tokens was still in flight
    schedule = llm.scheduler.schedule

    def counting_schedule():
        nonlocal ran_ahead
        pending = {r.req_id for r in llm.scheduler.running if r.num_output_placeholders}
        so = schedule()
        ran_ahead += len(pending & set(so.num_scheduled_tokens))
        return so

    llm.scheduler.schedule = counting_schedule  # type: ignore[method-assign]
    tokens = []
    for prompts, max_tokens, seeded in _workloads(seed):
        # Greedy and seeded random requests: a seeded draw depends on the request only, not the batch.
        params = [SamplingParams(max_tokens=m, temperature=0.9 if r else 0.0, top_p=0.9, seed=17 + i,
                                 ignore_eos=True) for i, (m, r) in enumerate(zip(max_tokens, seeded, strict=True))]
        tokens.append([o.token_ids for o in llm.generate(prompts, params)])
    info = {"tokens": tokens, "most_in_flight": most_in_flight, "preemptions": llm.scheduler.num_preemptions,
            "pipelined": llm.runner.pp is not None and llm.runner.pp.defers_tokens, "ran_ahead": ran_ahead}
    llm.shutdown()
    return info


@pytest.fixture(scope="module", params=[{"num_kv_blocks": 48}, {"num_kv_blocks": 6}], ids=["roomy", "preempting"])
def case(request) -> tuple[dict, dict]:
    (info,) = run_world(1, _generate, 1, request.param, 11, timeout_s=120)
    return request.param, info


@pytest.mark.parametrize("pp", [2, 3])
@pytest.mark.parametrize("placeholders", [True, False], ids=["placeholders", "disjoint"])
def test_pipelined_pp_matches_one_process(case, pp: int, placeholders: bool) -> None:
    """(Sync and async scheduling run the same pipelined loop under PP: async is asked for in one
    mode each, so that both spellings stay accepted.)"""
    extra, reference = case
    infos = run_world(pp, _generate, pp, {**extra, "pp_token_placeholders": placeholders,
                                          "async_scheduling": placeholders}, 11, timeout_s=180)
    for rank, info in enumerate(infos):
        assert info["tokens"] == reference["tokens"], f"rank {rank} of {pp} stages"
        assert info["pipelined"] == (rank < pp - 1)  # every stage but the last defers its tokens
        assert info["most_in_flight"] >= 2, "no step was launched ahead of an unresolved one"
        assert (info["ran_ahead"] > 0) == placeholders, info["ran_ahead"]
    assert (infos[0]["preemptions"] > 0) == (extra["num_kv_blocks"] < 16)


def test_pipelined_pp_with_graphs_matches_one_process(case) -> None:
    extra, reference = case
    infos = run_world(2, _generate, 2, {**extra, **GRAPH_ARGS}, 11, timeout_s=180)
    for rank, info in enumerate(infos):
        assert info["tokens"] == reference["tokens"], f"rank {rank}"


@pytest.mark.parametrize("case", [{"num_kv_blocks": 48}], indirect=True, ids=["roomy"])
def test_four_stages_keep_four_batches_in_flight(case) -> None:
    """PP4: the last stage holds four unresolved outputs (one per batch in flight), beyond the default
    number of async output slots; every stage still gives one process's tokens."""
    extra, reference = case
    infos = run_world(4, _generate, 4, extra, 11, timeout_s=240)
    for rank, info in enumerate(infos):
        assert info["tokens"] == reference["tokens"], f"rank {rank} of 4 stages"
    assert max(info["most_in_flight"] for info in infos) >= 4, "the pipeline never held four batches"
