"""Mixture-of-experts models under tensor and expert parallelism on CPU (gloo): greedy tokens
equal one process, eagerly and with graphs, from dummy weights (the sharded initialiser) and
from a Hugging Face checkpoint (per-expert tensors, a shared expert and a dense layer)."""

from __future__ import annotations

import pytest

from tests.dist_utils import run_world

PROMPTS = [[1 + i, 5, 9, 13 + i, 100 + i] for i in range(3)] + [[7] * 18, [3, 4]]
LLM_ARGS = dict(device="cpu", dtype="float32", num_kv_blocks=48, max_num_seqs=8, max_num_batched_tokens=32,
                max_model_len=96, seed=3, collective_timeout_s=30.0)
GRAPH_ARGS = dict(enforce_eager=False, compile_backend="eager", cudagraph_capture_sizes=[1, 2, 4, 8])


def _generate(rank: int, world: int, model: str, tp: int, extra: dict) -> dict:
    from graphrunner.engine.llm import LLM
    from graphrunner.layers.moe.layer import FusedMoE
    from graphrunner.protocol import SamplingParams

    llm = LLM(model, tensor_parallel_size=tp, **LLM_ARGS, **extra)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    moe = [m for m in llm.runner.model.modules() if isinstance(m, FusedMoE)]
    info = {"tokens": [o.token_ids for o in outs], "local_experts": moe[0].num_local_experts,
            "width": moe[0].intermediate_local, "mode": llm.runner.graphs.mode.name}
    llm.shutdown()
    return info


def _make_checkpoint(rank: int, world: int, path: str) -> None:
    from tests.hf_fixtures import make_hf_checkpoint

    make_hf_checkpoint("qwen2_moe", path, seed=4)


@pytest.fixture(scope="module")
def tiny_moe_reference() -> list[list[int]]:
    (info,) = run_world(1, _generate, "builtin:tiny-moe", 1, {}, timeout_s=60)
    return info["tokens"]


# Expert parallelism with graphs (collectives inside the compiled pieces and FULL step bodies);
# TP over the experts' width eagerly (the checkpoint test below runs it too, with a shared expert).
@pytest.mark.parametrize("ep,graphs", [(False, False), (True, True)], ids=["tp2-eager", "tp2-ep-graphs"])
def test_tp2_and_expert_parallel_match_one_process(tiny_moe_reference, ep: bool, graphs: bool) -> None:
    extra = {"enable_expert_parallel": ep, **(GRAPH_ARGS if graphs else {})}
    infos = run_world(2, _generate, "builtin:tiny-moe", 2, extra, timeout_s=120)
    for rank, info in enumerate(infos):
        assert info["tokens"] == tiny_moe_reference, f"rank {rank} (ep={ep}, graphs={graphs})"
        # tiny-moe: 8 experts of width 64. EP: 4 whole experts per rank; TP: 8 halves.
        assert (info["local_experts"], info["width"]) == ((4, 64) if ep else (8, 32))
        assert info["mode"] == ("FULL_AND_PIECEWISE" if graphs else "NONE")


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "tp2-ep"])
def test_checkpoint_with_shared_expert_sharded_load_matches_one_process(tmp_path, ep: bool) -> None:
    path = str(tmp_path / "qwen2-moe")
    run_world(1, _make_checkpoint, path, timeout_s=60)
    (ref,) = run_world(1, _generate, path, 1, {}, timeout_s=60)
    got = run_world(2, _generate, path, 2, {"enable_expert_parallel": ep}, timeout_s=90)
    assert got[0]["tokens"] == ref["tokens"] and got[1]["tokens"] == ref["tokens"]
