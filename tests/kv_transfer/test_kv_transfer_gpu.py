"""KV connectors on a CUDA GPU, with captured graphs and bf16 KV: the consumer's and the CPU-offload
instance's tokens equal one LLM computing everything (pinned host memory, copies on the main stream).
NcclConnector links two GPUs, an instance in a process on each (skipped with fewer than two)."""

from __future__ import annotations

import pytest

from tests.cuda_graphs import never_syncing

pytestmark = pytest.mark.gpu

ARGS = dict(device="cuda", max_num_seqs=8, max_model_len=256, block_size=16, seed=0, num_kv_blocks=64)
PROMPTS = [[(i * 7 + j * 13) % 500 + 3 for j in range(150)] for i in range(4)]


def _generate(llm, prompts=PROMPTS):
    from graphrunner.protocol import SamplingParams

    params = [SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


def test_shared_storage_on_cuda_equals_one_llm(tmp_path):
    from graphrunner.engine import LLM

    def storage(role):
        return {"kv_connector": "SharedStorageConnector", "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}

    reference, _ = _generate(LLM("builtin:tiny-llama", **ARGS))
    produced, _ = _generate(LLM("builtin:tiny-llama", kv_transfer_config=storage("kv_producer"), **ARGS))
    consumer = LLM("builtin:tiny-llama", kv_transfer_config=storage("kv_consumer"), async_scheduling=True, **ARGS)
    consumer.runner.execute_model = never_syncing(consumer.runner.execute_model)  # loading blocks included
    consumed, cached = _generate(consumer)
    assert produced == reference and consumed == reference
    assert cached == [149] * len(PROMPTS)  # every prompt token but the last
    assert consumer.runner.capture_report is not None and consumer.runner.capture_report.num_graphs > 0


def test_cpu_offload_on_cuda_equals_one_llm():
    from graphrunner.engine import LLM

    small = {**ARGS, "num_kv_blocks": 24, "max_num_seqs": 1}
    reference, _ = _generate(LLM("builtin:tiny-llama", **small), PROMPTS[:1])
    llm = LLM("builtin:tiny-llama", kv_transfer_config={
        "kv_connector": "CpuOffloadConnector", "kv_connector_extra_config": {"cpu_bytes": 64 << 20}}, **small)
    first, _ = _generate(llm, PROMPTS[:1])
    _generate(llm, PROMPTS[1:])  # evicts the first prompt's GPU blocks
    assert llm.runner.kv_connector.host.is_pinned()
    again, cached = _generate(llm, PROMPTS[:1])
    assert first == reference and again == reference
    assert cached == [144] and llm.scheduler.kv_connector.num_external_hit_tokens == 144


NCCL_BLOCKS = len(PROMPTS) * -(-150 // 16)  # every prompt block the producer computes, the partial last too


def _nccl_instance(rank: int, world_size: int, port: int, marker_dir: str, device: str) -> list:
    """One of two independent instances in its own process: rank 0 the producer (then, on the same
    GPU, one LLM computing everything: the reference), rank 1 the consumer, which generates once
    every prompt block has arrived. `device` "cuda": each process sees only its own GPU (NCCL
    link); "cpu": the same logic over gloo. Returns [tokens and logprobs, num_cached_tokens] per
    instance, the reference's after the producer's."""
    import os
    import time
    from pathlib import Path

    # Two instances, not a world: the LLM must not join one from the torchrun variables run_world sets.
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    if device == "cuda":  # before CUDA starts in this process: GPU `rank` becomes its only GPU, cuda:0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(world_size)]
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[rank].strip()
    from graphrunner.engine import LLM
    from tests.kv_transfer.test_connectors import _result

    args = {**ARGS, "device": device, "dtype": "float32", "enforce_eager": False,
            "cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}
    if device == "cpu":
        args["compile_backend"] = "eager"  # inductor's CPU codegen would take minutes
    role = "kv_producer" if rank == 0 else "kv_consumer"
    llm = LLM("builtin:tiny-llama", **args, kv_transfer_config={
        "kv_connector": "NcclConnector", "kv_role": role,
        "kv_connector_extra_config": {"kv_port": port, "backend": "nccl" if device == "cuda" else "gloo",
                                      "timeout_s": 60.0}})
    received = Path(marker_dir) / "received"
    if rank == 1:
        deadline = time.monotonic() + 120
        link = llm.scheduler.kv_connector.link
        while link.num_received_blocks < NCCL_BLOCKS:
            assert time.monotonic() < deadline, f"{link.num_received_blocks} of {NCCL_BLOCKS} blocks arrived"
            time.sleep(0.05)
        received.write_text("ok")
        outs = llm.generate(PROMPTS, _sampled_params(), use_tqdm=False)
        return [[_result(outs), [o.num_cached_tokens for o in outs]]]
    outs = llm.generate(PROMPTS, _sampled_params(), use_tqdm=False)
    reference = LLM("builtin:tiny-llama", **args).generate(PROMPTS, _sampled_params(), use_tqdm=False)
    # Under NCCL a finished send is only queued on the GPU: the producer stays until the consumer
    # holds every block, or its exit would cut them off.
    deadline = time.monotonic() + 120
    while not received.exists():
        assert time.monotonic() < deadline, "the consumer never received the blocks"
        time.sleep(0.05)
    return [[_result(outs), [o.num_cached_tokens for o in outs]],
            [_result(reference), [o.num_cached_tokens for o in reference]]]


def _sampled_params():
    from graphrunner.protocol import SamplingParams

    # Greedy but for one seeded sampled request; logprobs move with any change of the KV a step reads.
    return [SamplingParams(max_tokens=12, temperature=0.8 if i == 1 else 0.0, seed=i, logprobs=0, ignore_eos=True)
            for i in range(len(PROMPTS))]


def test_nccl_connector_between_two_gpus_equals_one_gpu(tmp_path, monkeypatch):
    """A producer on GPU 0 and a consumer on GPU 1, each its own process with FULL_AND_PIECEWISE
    graphs, linked by NcclConnector over NCCL: the consumer's tokens and logprobs are those of one
    LLM computing everything, and its loaded prompt blocks count as cached."""
    import torch

    from tests.dist_utils import free_port, run_world
    from tests.kv_transfer.test_connectors import _assert_same

    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip(f"needs 2 CUDA GPUs, found {count}")
    # Spawned: a child forked from a process whose CUDA has started cannot start its own.
    monkeypatch.setenv("GRAPHRUNNER_TEST_START", "spawn")
    (produced, reference), (consumed,) = run_world(2, _nccl_instance, free_port(), str(tmp_path), "cuda",
                                                   init_pg=False, timeout_s=420)
    _assert_same([tuple(r) for r in produced[0]], [tuple(r) for r in reference[0]])
    _assert_same([tuple(r) for r in consumed[0]], [tuple(r) for r in reference[0]])
    assert consumed[1] == [149] * len(PROMPTS)  # every prompt token but the last, loaded rather than computed
