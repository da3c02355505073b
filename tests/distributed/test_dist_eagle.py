"""EAGLE heads under TP and PP on CPU (gloo): tokens equal plain decoding, drafts equal one process.

Each rank runs `LLM(...)` over builtin:tiny-llama (sharded dummy weights) with a built-in head,
records every step's proposals, and compares them with a single-process run: under PP the
last stage drafts from features that crossed the stage boundary (EAGLE-3's feature layers
of stage 0 travel with the hidden states), so its drafts equal one process's exactly; under
TP every rank runs the whole head over all-reduced features.
"""

from __future__ import annotations

import pytest

from tests.dist_utils import run_world
from tests.distributed.test_dist_engine import LLM_ARGS, MAX_TOKENS, PROMPTS

EAGLE3 = {"method": "eagle3", "model": "builtin:eagle3-tiny-llama", "num_speculative_tokens": 3}
EAGLE = {"method": "eagle", "model": "builtin:eagle-tiny-llama", "num_speculative_tokens": 2}


def _generate(rank: int, world: int, tp: int, pp: int, spec: dict | None) -> dict:
    from graphrunner.engine.llm import LLM
    from graphrunner.protocol import SamplingParams

    extra = {"speculative_config": spec} if spec is not None else {}
    llm = LLM("builtin:tiny-llama", tensor_parallel_size=tp, pipeline_parallel_size=pp, **LLM_ARGS, **extra)
    drafts: list = []
    outputs = llm.runner.outputs
    build = getattr(outputs, "_build_speculative", None)
    if build is not None:
        def recording(*args, **kwargs):
            out = build(*args, **kwargs)
            drafts.append((outputs.drafts.req_ids, outputs.drafts.draft_token_ids))
            return out

        outputs._build_speculative = recording
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    tokens = [o.token_ids for o in llm.generate(PROMPTS, params)]
    llm.shutdown()
    return {"tokens": tokens, "drafts": drafts}


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    (info,) = run_world(1, _generate, 1, 1, None, timeout_s=60)
    return info["tokens"]


@pytest.mark.parametrize("tp,pp,spec", [(1, 2, EAGLE3), (2, 1, EAGLE3), (1, 2, EAGLE)], ids=["pp2-eagle3", "tp2-eagle3",
                                                                                             "pp2-eagle"])
def test_eagle_under_tp_and_pp_matches_one_process(plain, tp, pp, spec):
    (one,) = run_world(1, _generate, 1, 1, spec, timeout_s=60)
    assert one["tokens"] == plain and one["drafts"]
    infos = run_world(tp * pp, _generate, tp, pp, spec, timeout_s=120)
    for info in infos:
        assert info["tokens"] == plain
    last = infos[-1]["drafts"]
    if pp > 1:  # the same arithmetic on one process and over two stages
        assert last == one["drafts"]
    else:  # all-reduced sums may round differently: nearly every proposal agrees
        pairs = [(a, b) for (_, xs), (_, ys) in zip(last, one["drafts"], strict=True)
                 for a, b in zip(xs, ys, strict=True)]
        assert sum(a == b for a, b in pairs) >= 0.9 * len(pairs)
