"""KV connectors on a CUDA GPU, with captured graphs and bf16 KV: the consumer's and the CPU-offload
instance's tokens equal one LLM computing everything (pinned host memory, copies on the main stream)."""

from __future__ import annotations

import pytest

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
    consumer = LLM("builtin:tiny-llama", kv_transfer_config=storage("kv_consumer"), **ARGS)
    consumed, cached = _generate(consumer)
    assert produced == reference and consumed == reference
    assert cached == [144] * len(PROMPTS)  # (150 - 1) // 16 blocks
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
