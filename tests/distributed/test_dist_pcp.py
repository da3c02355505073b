"""Prefill context parallelism end to end on CPU (gloo): tokens and prompt logprobs equal one process.

Each test runs `LLM(...)` in SPMD on a gloo world of P forked CPU processes with
`prefill_context_parallel_size=P` (builtin:tiny-llama, dummy weights) and compares every
rank's greedy tokens (and prompt logprobs) with a single-process run of the same workload.
The workload is built to exercise the split: prompts of many lengths (some not a multiple
of 2P, some shorter than 2P), chunked prefill (a small token budget), prefills batched with
decodes, and a KV cache small enough that requests are preempted and re-prefilled.
"""

from __future__ import annotations

import pytest

from tests.dist_utils import run_world

PROMPTS = [[(7 * i + 3 * j) % 251 + 1 for j in range(n)] for i, n in enumerate([37, 5, 3, 61, 12, 2, 29, 44])]
MAX_TOKENS = [7, 9, 4, 6, 12, 5, 8, 3]
LLM_ARGS = dict(
    device="cpu", max_num_seqs=6, max_num_batched_tokens=40, max_model_len=128, seed=3, collective_timeout_s=30.0,
)
GRAPH_ARGS = dict(enforce_eager=False, compile_backend="eager", cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 40])


def _generate(rank: int, world: int, pcp: int, extra: dict) -> dict:
    from graphrunner.engine.llm import LLM
    from graphrunner.protocol import SamplingParams

    llm = LLM("builtin:tiny-llama", prefill_context_parallel_size=pcp, **{**LLM_ARGS, **extra})
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, prompt_logprobs=1 if i == 3 else None)
              for i, n in enumerate(MAX_TOKENS)]
    outs = llm.generate(PROMPTS, params)
    pcp_side = llm.runner.body.pcp
    info = {
        "tokens": [o.token_ids for o in outs],
        "prompt_logprobs": [[None if e is None else sorted(e.items()) for e in (o.prompt_logprobs or [])]
                            for o in outs],
        "split_steps": pcp_side.num_split_steps if pcp_side is not None else 0,
        "preemptions": llm.scheduler.num_preemptions,
        "mode": llm.runner.graphs.mode.name,
    }
    llm.shutdown()
    return info


@pytest.fixture(scope="module", params=[{"num_kv_blocks": 64}, {"num_kv_blocks": 8}], ids=["roomy", "preempting"])
def case(request) -> tuple[dict, dict]:
    (info,) = run_world(1, _generate, 1, request.param, timeout_s=90)
    return request.param, info


def _close(a, b) -> bool:
    """Prompt logprobs equal up to float rounding of a differently blocked sum."""
    if len(a) != len(b):
        return False
    for ea, eb in zip(a, b, strict=True):
        if (ea is None) != (eb is None):
            return False
        if ea is None:
            continue
        if [t for t, _ in ea] != [t for t, _ in eb]:
            return False
        for (_, la), (_, lb) in zip(ea, eb, strict=True):
            if abs(la.logprob - lb.logprob) > 1e-4:
                return False
    return True


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_pcp2_matches_one_process(case, graphs: bool) -> None:
    extra, reference = case
    infos = run_world(2, _generate, 2, {**extra, **(GRAPH_ARGS if graphs else {})}, timeout_s=180)
    for rank, info in enumerate(infos):
        assert info["split_steps"] > 0, "no step was split: the test would not exercise PCP"
        assert info["preemptions"] == reference["preemptions"]
        assert (info["preemptions"] > 0) == (extra["num_kv_blocks"] < 16)  # the small cache preempts
        assert info["tokens"] == reference["tokens"], f"rank {rank}"
        for i, (a, b) in enumerate(zip(info["prompt_logprobs"], reference["prompt_logprobs"], strict=True)):
            assert _close(a, b), f"rank {rank}: prompt logprobs of prompt {i} differ"


def test_pcp3_matches_one_process(case) -> None:
    extra, reference = case
    infos = run_world(3, _generate, 3, extra, timeout_s=180)
    for rank, info in enumerate(infos):
        assert info["split_steps"] > 0
        assert info["tokens"] == reference["tokens"], f"rank {rank}"


def test_pcp2_with_ngram_speculation_matches_one_process(case) -> None:
    """Verification entries (1 + k tokens) run whole on both ranks inside split steps."""
    extra, reference = case
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}}
    infos = run_world(2, _generate, 2, {**extra, **spec}, timeout_s=180)
    for rank, info in enumerate(infos):
        assert info["split_steps"] > 0
        assert info["tokens"] == reference["tokens"], f"rank {rank}"


def test_pcp_refuses_what_it_does_not_run() -> None:
    from graphrunner.distributed.groups import ParallelGroup, ParallelGroups
    def groups(pp: int = 1, dcp: int = 1) -> ParallelGroups:
        g = ParallelGroups.single()
        g.pcp = ParallelGroup("pcp", [0, 1], 0)
        g.pp = ParallelGroup("pp", list(range(pp)), 0)
        g.dcp = ParallelGroup("dcp", list(range(dcp)), 0)
        return g

    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        groups(pp=2).check_context_parallel(has_draft_model=False)
    with pytest.raises(ValueError, match="decode_context_parallel_size=2: use one kind"):
        groups(dcp=2).check_context_parallel(has_draft_model=False)
    groups().check_context_parallel(has_draft_model=False)  # PCP alone is served
    with pytest.raises(ValueError, match="with a draft model"):
        groups().check_context_parallel(has_draft_model=True)
