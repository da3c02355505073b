"""The runner protocol with adapters: `NewRequestData.lora_request` (vLLM's field).

A new request with a missing adapter folder, one of the wrong type, or a step with more distinct
adapters than `max_loras` raise ValueError before any state changes: the runner keeps serving the
other requests, whose tokens are those of a runner that never saw the bad step. Layouts LoRA does not
serve are refused by name.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from graphrunner.config import CacheConfig, CompilationConfig, LoadConfig, LoRAConfig, RunnerConfig, SchedulerConfig
from graphrunner.layers.lora.peft import write_dummy_adapter
from graphrunner.models.loader import load_model_config
from graphrunner.protocol import LoRARequest, NewRequestData, SamplingParams, SchedulerOutput
from graphrunner.runner import ModelRunner, _check_lora_layout

MODEL = "builtin:tiny-llama"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    config = load_model_config(MODEL)
    return [LoRARequest(f"a{i}", i + 1, write_dummy_adapter(root / f"a{i}", config, 4, seed=i, dtype=torch.float32,
                                                                scale=1.0))
            for i in range(3)]


def _runner(max_loras: int = 2, mode: str | None = None) -> ModelRunner:
    compilation = CompilationConfig(enforce_eager=True) if mode is None else CompilationConfig(
        cudagraph_mode=mode, cudagraph_capture_sizes=(2, 4, 8, 16), compile_backend="eager")
    config = RunnerConfig(
        model=load_model_config(MODEL), load=LoadConfig(model=MODEL, load_format="dummy"),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64),
        cache=CacheConfig(block_size=4, num_blocks=32), compilation=compilation,
        lora=LoRAConfig(max_loras=max_loras, max_lora_rank=4), dtype="float32")
    runner = ModelRunner(config, "cpu")
    runner.load_model()
    runner.initialize_kv_cache(32)
    return runner


def _new(req_id: str, block: int, lora: LoRARequest | None) -> NewRequestData:
    return NewRequestData(req_id, [3, 1, 4, 1, 5], SamplingParams(temperature=0), [block, block + 1],
                          lora_request=lora)


def _admit(runner: ModelRunner, reqs: list[NewRequestData]) -> list[list[int]]:
    so = SchedulerOutput(scheduled_new_reqs=reqs, num_scheduled_tokens={r.req_id: 5 for r in reqs},
                         total_num_scheduled_tokens=5 * len(reqs))
    runner.execute_model(so)
    return runner.sample_tokens().sampled_token_ids


def test_bad_requests_change_nothing(adapters, tmp_path):
    runner, clean = _runner(), _runner()
    want = _admit(clean, [_new("a", 0, adapters[0]), _new("b", 2, None)])
    assert want != _admit(_runner(), [_new("a", 0, None), _new("b", 2, None)])  # the adapter matters
    missing = LoRARequest("gone", 9, str(tmp_path / "gone"))
    with pytest.raises(ValueError, match=r"request 'x'.*does not exist"):
        _admit(runner, [_new("a", 0, adapters[0]), _new("x", 4, missing)])
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
        _admit(runner, [_new("y", 4, "a0")])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"3 distinct LoRA adapters.*above max_loras=2"):
        _admit(runner, [_new(f"r{i}", 2 * i, lora) for i, lora in enumerate(adapters)])
    assert runner.state.requests.num_live == 0 and runner.lora.num_live == 0
    assert _admit(runner, [_new("a", 0, adapters[0]), _new("b", 2, None)]) == want


def test_capture_after_a_lora_step_compiles_each_variant_once(adapters):
    """A LoRA step before capture leaves the adapters' flag set; the plain compile still traces without
    adapters, and each compile stays at one graph through capture and both kinds of steps."""
    eager = _admit(_runner(), [_new("a", 0, adapters[0]), _new("b", 2, None)])
    runner = _runner(mode="PIECEWISE")
    assert _admit(runner, [_new("a", 0, adapters[0])]) == eager[:1]
    runner.execute_model(SchedulerOutput(finished_req_ids={"a"}))
    runner.sample_tokens()
    runner.capture_model(progress=False)
    assert _admit(runner, [_new("a2", 0, adapters[0]), _new("b2", 2, None)]) == eager
    assert _admit(runner, [_new("c", 4, None)]) == eager[1:]
    body = runner.body
    assert body.compiled.num_graphs_compiled == 1 and body.compiled_lora.num_graphs_compiled == 1


def test_a_runner_without_lora_refuses_adapters(adapters):
    config = RunnerConfig(
        model=load_model_config(MODEL), load=LoadConfig(model=MODEL, load_format="dummy"),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32),
        cache=CacheConfig(block_size=4, num_blocks=8), compilation=CompilationConfig(enforce_eager=True))
    runner = ModelRunner(config, "cpu")
    runner.load_model()
    runner.initialize_kv_cache(8)
    with pytest.raises(ValueError, match="needs a runner with LoRA on"):
        _admit(runner, [_new("a", 0, adapters[0])])
    assert runner.state.requests.num_live == 0


@pytest.mark.parametrize(("groups", "what"), [
    (SimpleNamespace(pp_size=2, dp_lockstep=False), "pipeline_parallel_size=2"),
    (SimpleNamespace(pp_size=1, dp_lockstep=True), "data_parallel_lockstep=True"),
])
def test_unserved_layouts_are_refused(groups, what):
    config = RunnerConfig(model=load_model_config(MODEL), lora=LoRAConfig())
    with pytest.raises(ValueError, match=f"enable_lora=True with {what}"):
        _check_lora_layout(config, groups)
