"""GPU: TP, PP, DP, PCP, DCP and their four-GPU combinations with graphs (NCCL) give one GPU's greedy
tokens, and exit cleanly.

Each case runs this module as a worker (`python -m tests.distributed.test_dist_gpu --worker LAYOUT_JSON OUT`)
under `graphrunner launch` (one process per GPU, NCCL), with builtin:tiny-llama (or its 8-head
variant, for TP4) in float32 (so TP's different reduction order cannot flip a greedy token) and the
default FULL_AND_PIECEWISE mode with inductor: FULL graphs capture the step body with its NCCL
all-reduces, PIECEWISE pieces capture theirs. The reference is the same worker on one GPU. A case
is skipped without enough GPUs: two-GPU cases need two, the four-GPU matrix four.
`tools/gpu_suite.sh dist` runs these.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

WORKER_TIMEOUT_S = 420
PROMPTS = [[1 + i, 5, 9, 13 + i, 100 + i] for i in range(6)] + [[7] * 40, [3, 4]]
MAX_TOKENS = [12, 5, 16, 3, 12, 8, 10, 6]
TINY = "builtin:tiny-llama"
NGRAM3 = {"method": "ngram", "num_speculative_tokens": 3}
EAGLE3 = {"method": "eagle3", "model": "builtin:eagle3-tiny-llama", "num_speculative_tokens": 3}
EAGLE = {"method": "eagle", "model": "builtin:eagle-tiny-llama", "num_speculative_tokens": 2}
SIZES = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "prefill_context_parallel_size")


def _dummy_steps(llm) -> int:
    """Idle-replica dummy steps the runner ran (lockstep DP; 0 without it)."""
    return llm.runner.dp.num_dummy_steps if llm.runner.dp is not None else 0


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # pragma: no cover
        return 0


def _world_size(layout: dict) -> int:
    """GPUs a layout needs: tp x pp x dp x pcp (DCP lives inside TP)."""
    size = 1
    for key in SIZES:
        size *= layout.get(key, 1)
    return size


def _run(tmp_path, layout: dict) -> dict:
    """Launch the worker on the layout's world; rank 0's JSON (tokens and what the engine did)."""
    from graphrunner.distributed.launch import launch

    need = _world_size(layout)
    if _gpus() < need:
        pytest.skip(f"needs {need} GPUs, found {_gpus()}")
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "tests.distributed.test_dist_gpu", "--worker", json.dumps(layout), str(out)]
    status = launch(cmd, need, timeout=WORKER_TIMEOUT_S)
    assert status == 0, f"{layout}: launcher exit status {status} (124 = timeout/hang)"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One GPU's tokens, per model (computed on first use)."""
    if _gpus() < 1:
        pytest.skip("needs a CUDA GPU")
    cache: dict[str, list] = {}

    def tokens_of(model: str) -> list:
        if model not in cache:
            cache[model] = _run(tmp_path_factory.mktemp("ref"), {"model": model})["tokens"]
        return cache[model]

    return tokens_of


def _check(references, tmp_path, layout: dict) -> dict:
    info = _run(tmp_path, layout)
    assert info["captured"], f"{layout}: no graphs captured"
    assert info["tokens"] == references(layout.get("model", TINY)), f"{layout}: tokens differ from one GPU"
    return info


TWO_GPU_LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "pp2": dict(pipeline_parallel_size=2),  # token placeholders: stage 0 applies due tokens on the device
    "pp2-disjoint": dict(pipeline_parallel_size=2, pp_token_placeholders=False),
    "dp2": dict(data_parallel_size=2),
    "tp2-FULL": dict(tensor_parallel_size=2, cudagraph_mode="FULL"),
    "tp2-PIECEWISE": dict(tensor_parallel_size=2, cudagraph_mode="PIECEWISE"),
    # n-gram speculation (k = 3) in FULL graphs: under PP the last stage's [rows, 2k + 4] outcome goes
    # to the other stage over NCCL; under TP every rank verifies alike.
    "pp2-ngram3": dict(pipeline_parallel_size=2, speculative_config=NGRAM3),
    "tp2-ngram3": dict(tensor_parallel_size=2, speculative_config=NGRAM3),
    # EAGLE heads in FULL graphs: under PP stage 0's EAGLE-3 feature layers travel to the last stage
    # with the hidden states over NCCL; under TP the head runs whole on each rank over all-reduced features.
    "pp2-eagle3": dict(pipeline_parallel_size=2, speculative_config=EAGLE3),
    "tp2-eagle3": dict(tensor_parallel_size=2, speculative_config=EAGLE3),
    "tp2-eagle": dict(tensor_parallel_size=2, speculative_config=EAGLE),
    # TP2 x DCP2: both GPUs hold every KV head and half of each sequence; the query all-gather, the
    # sharded attention and the LSE merge run in FULL decode graphs (NCCL captured) and between pieces.
    "tp2dcp2": dict(tensor_parallel_size=2, decode_context_parallel_size=2),
    "tp2dcp2-ngram3": dict(tensor_parallel_size=2, decode_context_parallel_size=2, speculative_config=NGRAM3),
    # Mixture of experts: every expert split over both GPUs, or 4 whole experts each (expert parallel);
    # the fused MoE kernels and the layer's NCCL all-reduce inside FULL graphs and PIECEWISE pieces.
    "moe-tp2": dict(model="builtin:tiny-moe", tensor_parallel_size=2),
    "moe-tp2-ep": dict(model="builtin:tiny-moe", tensor_parallel_size=2, enable_expert_parallel=True),
    # Data-parallel attention with expert parallelism: 4 experts per GPU, every MoE layer's NCCL
    # all-gather / reduce-scatter over the DP group captured in FULL graphs; lockstep with dummy steps.
    "moe-dp2-ep": dict(model="builtin:tiny-moe", data_parallel_size=2, enable_expert_parallel=True),
}
# The same with dual-batch overlap: decode steps replay FULL graphs of two microbatches on two streams.
DBO_LAYOUT = dict(model="builtin:tiny-moe", data_parallel_size=2, enable_expert_parallel=True,
                  enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=4)

# EPLB: (8 + 2) slots over two GPUs, rebalanced every 4 steps while the requests run (weights over NCCL
# point to point, tables rewritten in place): the tokens stay one GPU's and nothing is recaptured.
EPLB_LAYOUT = dict(model="builtin:tiny-moe", data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
                   num_redundant_experts=2, eplb_step_interval=4)

FOUR_GPU_LAYOUTS = {  # combined parallelism
    "tp2pp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2),  # the pipelined engine (2 in flight)
    "tp2pp2-async": dict(tensor_parallel_size=2, pipeline_parallel_size=2, async_scheduling=True),
    "tp4": dict(model="builtin:tiny-llama-8h", tensor_parallel_size=4),
    "tp4dcp2": dict(tensor_parallel_size=4, decode_context_parallel_size=2),
    "dp2tp2": dict(tensor_parallel_size=2, data_parallel_size=2),
    "dp2tp2-lockstep": dict(tensor_parallel_size=2, data_parallel_size=2, data_parallel_lockstep=True),
    "pp3": dict(pipeline_parallel_size=3),
    "pp4": dict(pipeline_parallel_size=4),  # one layer per stage
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(TWO_GPU_LAYOUTS))
def test_two_gpu_layouts_match_one_gpu(references, tmp_path, name: str) -> None:
    _check(references, tmp_path, TWO_GPU_LAYOUTS[name])


@pytest.mark.gpu
def test_dbo_decode_steps_replay_the_microbatched_graphs(references, tmp_path) -> None:
    """Both streams' work and the second communicators' collectives inside one FULL graph per decode size."""
    info = _check(references, tmp_path, DBO_LAYOUT)
    assert 0 < info["microbatched_graphs"] <= info["microbatched"], info


@pytest.mark.gpu
def test_eplb_rebalances_without_recapture_and_matches_one_gpu(references, tmp_path) -> None:
    info = _check(references, tmp_path, EPLB_LAYOUT)
    assert info["rearrangements"] > 0, info
    assert info["captures_after_load"] == 0, f"a rebalance recaptured graphs: {info}"
    assert info["dummy_steps"] > 0, info


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FOUR_GPU_LAYOUTS))
def test_four_gpu_layouts_match_one_gpu(references, tmp_path, name: str) -> None:
    layout = FOUR_GPU_LAYOUTS[name]
    info = _check(references, tmp_path, layout)
    pp = layout.get("pipeline_parallel_size", 1)
    if pp > 1:  # the pipelined engine keeps up to P + 1 batches in flight (P disjoint ones without placeholders)
        assert info["keep_in_flight"] == pp - 1 + layout.get("pp_token_placeholders", True), info
    # Lockstep DP: the replica whose requests end first keeps stepping with dummies; independent: never.
    assert (info["dummy_steps"] > 0) == layout.get("data_parallel_lockstep", False), info


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [None, NGRAM3], ids=["plain", "ngram3"])
@pytest.mark.parametrize("tp", [1, 2], ids=["pcp2", "pcp2tp2"])
def test_prefill_context_parallel_matches_one_gpu(references, tmp_path, tp: int, spec: dict | None) -> None:
    """PCP2 (x TP2 on four GPUs): prefills split DualChunkSwap over the PCP ranks (K/V all-gathered
    over NCCL in the attention op between PIECEWISE pieces), decodes in FULL graphs; one GPU's tokens."""
    layout = dict(prefill_context_parallel_size=2, tensor_parallel_size=tp, speculative_config=spec)
    info = _check(references, tmp_path, layout)
    assert info["split_steps"] > 0


def _worker(layout: dict, out_path: str) -> None:
    from graphrunner.engine.llm import LLM
    from graphrunner.protocol import SamplingParams
    from tests.dist_utils import EIGHT_HEADS, register_eight_heads

    layout = dict(layout)
    model = layout.pop("model", TINY)
    if model == EIGHT_HEADS:
        register_eight_heads()
    args = dict(dtype="float32", device="cuda", max_num_seqs=16, max_num_batched_tokens=128, max_model_len=256,
                num_kv_blocks=128, enforce_eager=False, cudagraph_mode="FULL_AND_PIECEWISE",
                collective_timeout_s=120.0, seed=5)
    llm = LLM(model, **{**args, **layout})
    generation = llm.runner.graphs.generation  # bumped by every capture and release
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params)
    pcp = llm.runner.body.pcp
    dummy_steps = [_dummy_steps(llm)]  # per rank: the replica that ends first runs dummies
    if llm.groups.world_size > 1:
        import torch.distributed as dist

        dummy_steps = [0] * llm.groups.world_size
        dist.all_gather_object(dummy_steps, _dummy_steps(llm), group=llm.groups.world_cpu_group)
    info = {
        "tokens": [o.token_ids for o in outs],
        "captured": bool(llm.runner.graphs.captured),
        "mode": llm.runner.graphs.mode.name,
        "split_steps": pcp.num_split_steps if pcp is not None else 0,
        "keep_in_flight": llm._keep_in_flight,
        "dummy_steps": sum(dummy_steps),
        "rearrangements": len(llm.runner.eplb.rearrangements) if llm.runner.eplb is not None else 0,
        "captures_after_load": llm.runner.graphs.generation - generation,
        "microbatched": llm.runner.dp.num_microbatched_steps if llm.runner.dp is not None else 0,
        "microbatched_graphs": llm.runner.dp.num_microbatched_graph_steps if llm.runner.dp is not None else 0,
    }
    rank = llm.groups.rank
    llm.shutdown()  # graphs and pool, then the process groups: must not hang
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(info, f)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]), sys.argv[3])
        sys.stdout.flush()
        os._exit(0)
    raise SystemExit("usage: python -m tests.distributed.test_dist_gpu --worker LAYOUT_JSON OUT.json")
