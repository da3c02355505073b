"""Decode context parallelism end to end on CPU (gloo): tokens equal one process, capacity doubles.

`LLM(tensor_parallel_size=2, decode_context_parallel_size=2)` on two forked gloo processes
(builtin:tiny-llama, dummy weights): the two ranks of the DCP group compute the same K/V
heads and each caches every other run of `cp_kv_cache_interleave_size` tokens; attention
all-gathers the query heads, attends over the local share and merges the partial results
exactly. The reference is one process with twice the KV blocks: under DCP2 each block
serves 2 x block_size positions of a request, so half the blocks hold the same tokens.
"""

from __future__ import annotations

import pytest

from tests.dist_utils import run_world
from tests.distributed.test_dist_pcp import MAX_TOKENS, PROMPTS, _close

LLM_ARGS = dict(
    device="cpu", max_num_seqs=6, max_num_batched_tokens=40, max_model_len=128, seed=3, collective_timeout_s=30.0,
)
GRAPH_ARGS = dict(enforce_eager=False, compile_backend="eager", cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 40])


SIX_HEADS = "builtin:tiny-llama-6h"  # 6 query / 3 KV heads: TP3 x DCP3 (tiny-llama's 4 heads do not split in 3)


def _register_six_heads() -> None:
    """Add SIX_HEADS to the built-ins of this (forked) process."""
    import dataclasses
    from types import MappingProxyType

    from graphrunner.models import registry

    tiny = registry.BUILTIN_MODELS["builtin:tiny-llama"]
    six = dataclasses.replace(tiny, name=SIX_HEADS, hidden_size=192, intermediate_size=384, num_attention_heads=6,
                              num_key_value_heads=3)
    registry.BUILTIN_MODELS = MappingProxyType({**registry.BUILTIN_MODELS, SIX_HEADS: six})


def _generate(rank: int, world: int, tp: int, dcp: int, extra: dict, model: str = "builtin:tiny-llama") -> dict:
    from graphrunner.engine.llm import LLM
    from graphrunner.protocol import SamplingParams

    if model == SIX_HEADS:
        _register_six_heads()
    llm = LLM(model, tensor_parallel_size=tp, decode_context_parallel_size=dcp, **{**LLM_ARGS, **extra})
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, prompt_logprobs=1 if i == 3 else None)
              for i, n in enumerate(MAX_TOKENS)]
    outs = llm.generate(PROMPTS, params)
    info = {
        "tokens": [o.token_ids for o in outs],
        "prompt_logprobs": [[None if e is None else sorted(e.items()) for e in (o.prompt_logprobs or [])]
                            for o in outs],
        "capacity_tokens": llm.scheduler.num_blocks * llm.config.tokens_per_block,
        "preemptions": llm.scheduler.num_preemptions,
        "kv_heads": llm.runner.num_kv_heads_local,
    }
    llm.shutdown()
    return info


@pytest.fixture(scope="module")
def reference() -> dict:
    (info,) = run_world(1, _generate, 1, 1, {"num_kv_blocks": 16}, timeout_s=90)
    return info


@pytest.mark.parametrize("interleave", [1, 2], ids=["interleave1", "interleave2"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_dcp2_matches_one_process_with_half_the_blocks(reference, interleave: int, graphs: bool) -> None:
    extra = {"num_kv_blocks": 8, "cp_kv_cache_interleave_size": interleave, **(GRAPH_ARGS if graphs else {})}
    infos = run_world(2, _generate, 2, 2, extra, timeout_s=180)
    for rank, info in enumerate(infos):
        assert info["capacity_tokens"] == reference["capacity_tokens"]  # 8 blocks x 32 positions = 16 x 16
        assert info["kv_heads"] == reference["kv_heads"]  # both ranks hold every KV head (one K/V shard)
        assert info["tokens"] == reference["tokens"], f"rank {rank}"  # (coarser blocks may preempt differently)
        for i, (a, b) in enumerate(zip(info["prompt_logprobs"], reference["prompt_logprobs"], strict=True)):
            assert _close(a, b), f"rank {rank}: prompt logprobs of prompt {i} differ"


def test_dcp3_matches_one_process() -> None:
    """Three ranks: TP3 x DCP3 over a 6-head model (each rank caches every third position)."""
    (reference,) = run_world(1, _generate, 1, 1, {"num_kv_blocks": 24}, SIX_HEADS, timeout_s=90)
    infos = run_world(3, _generate, 3, 3, {"num_kv_blocks": 8, "cp_kv_cache_interleave_size": 2}, SIX_HEADS,
                      timeout_s=180)
    for rank, info in enumerate(infos):
        assert info["capacity_tokens"] == reference["capacity_tokens"] == 384
        assert info["tokens"] == reference["tokens"], f"rank {rank}"


def test_dcp2_with_ngram_speculation_matches_one_process(reference) -> None:
    """Verification queries (1 + k rows) mask each rank's keys by global position."""
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}}
    infos = run_world(2, _generate, 2, 2, {"num_kv_blocks": 8, **spec}, timeout_s=180)
    for rank, info in enumerate(infos):
        assert info["tokens"] == reference["tokens"], f"rank {rank}"


def test_dcp2_with_async_scheduling_matches_one_process(reference) -> None:
    """Async scheduling under TP2 x DCP2: every rank reads its next input token on the device."""
    infos = run_world(2, _generate, 2, 2, {"num_kv_blocks": 8, "async_scheduling": True}, timeout_s=180)
    for rank, info in enumerate(infos):
        assert info["tokens"] == reference["tokens"], f"rank {rank}"
