"""Structured outputs under pipeline parallelism (CPU, gloo): one process's tokens, and no split step.

A split constrained step (step/split.py) replays its forward graph from `execute_model`, before the
runner's `PipelineStage.receive`, which only runs in `_run` (from `sample_tokens`). Under
PP that hook is where a stage's inputs arrive: a non-first stage receives the previous stage's hidden
states, and a pipelined non-last stage applies the sampled tokens its requests still wait for (the
input tokens of this very step, `pp_token_placeholders`). A forward replayed before it would read
stale hidden states or placeholder tokens. `SplitStep.serves` therefore splits single-stage runners
only (the last stage that receives nothing): every PP stage runs a constrained step whole, after its
hook. Checked on a 2-stage world with CPU-emulated FULL graphs and `structured_output_graphs` on: no
stage captures or replays a split graph, and the tokens (greedy and seeded, JSON / regex / choice
requests beside an unconstrained one, placeholders or disjoint batches) equal one process, which does
replay its split graphs.
"""

from __future__ import annotations

import pytest

from tests.dist_utils import run_world

pytest.importorskip("xgrammar")

LLM_ARGS = dict(device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                block_size=8, num_kv_blocks=96, seed=3, collective_timeout_s=60.0, enforce_eager=False,
                compile_backend="eager", cudagraph_capture_sizes=[1, 2, 4, 8])


def _generate(rank: int, world: int, folder: str, extra: dict) -> dict:
    from graphrunner.engine.llm import LLM
    from graphrunner.protocol import SamplingParams
    from graphrunner.structured_outputs import StructuredOutputsParams

    llm = LLM(folder, pipeline_parallel_size=world, **{**LLM_ARGS, **extra})
    graphs = llm.runner.graphs
    split_replays = []
    for key, graph in graphs.split_graphs.items():
        def replay(key=key, inner=graph.replay):
            split_replays.append(str(key[0]))
            inner()
        graph.replay = replay
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema)),
        SamplingParams(max_tokens=30, temperature=1.0, seed=5, structured_outputs=StructuredOutputsParams(
            regex="(the|fox) (quick|lazy) dog")),
        SamplingParams(max_tokens=30, temperature=0.8, seed=7, structured_outputs=StructuredOutputsParams(
            choice=["hello world", "the graph runner"])),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    ] * 2
    outs = llm.generate(["hello", "the", "café", "hello world", "graphs", "the fox", "stop", "runs"], params)
    info = {"tokens": [o.token_ids for o in outs], "split_graphs": len(graphs.split_graphs),
            "split_replays": len(split_replays), "stage": (llm.runner.groups.pp.is_first,
                                                           llm.runner.groups.pp.is_last)}
    llm.shutdown()
    return info


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from tests.engine.test_engine_text import make_text_model

    return str(make_text_model(tmp_path_factory.mktemp("pp_structured_model")))


@pytest.fixture(scope="module")
def reference(folder) -> dict:
    (info,) = run_world(1, _generate, folder, {}, timeout_s=240)
    assert info["split_graphs"] > 0 and info["split_replays"] > 0, "one process must take the split path"
    return info


@pytest.mark.parametrize("placeholders", [True, False], ids=["placeholders", "disjoint"])
def test_pp_structured_outputs_match_one_process_without_split_steps(folder, reference, placeholders) -> None:
    infos = run_world(2, _generate, folder, {"pp_token_placeholders": placeholders}, timeout_s=240)
    for rank, info in enumerate(infos):
        assert info["stage"] == (rank == 0, rank == 1)
        assert info["split_graphs"] == 0 and info["split_replays"] == 0, f"rank {rank} split a constrained step"
        assert info["tokens"] == reference["tokens"], f"rank {rank}"
