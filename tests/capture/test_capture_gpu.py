"""Real CUDA graphs: default-size capture of a real-shaped model, and a leak-free lifecycle."""

import gc

import pytest
import torch

from graphrunner import LLM, SamplingParams


def _release(llm):
    llm.runner.shutdown()
    del llm
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_capture_default_sizes_qwen_0_5b():
    llm = LLM("builtin:qwen2.5-0.5b", device="cuda", max_num_seqs=256, max_num_batched_tokens=2048,
              max_model_len=2048, num_kv_blocks=4096, enforce_eager=False)
    report = llm.runner.capture_report
    graphs = llm.runner.graphs
    full = [d for d in graphs.table.descriptors if d.is_full]
    piecewise = [d for d in graphs.table.descriptors if d.is_piecewise]
    # One graph per start-up sampling variant (greedy, sampled; the all-features one on first
    # use) per FULL descriptor, one record per PIECEWISE size.
    from graphrunner.step.graphs import GREEDY, SAMPLED

    assert graphs.eager_variants == (GREEDY, SAMPLED)
    assert report.num_graphs == len(graphs.eager_variants) * len(full) + len(piecewise)
    assert graphs.captured and report.total_seconds > 0 and report.pool_bytes >= 0
    print(report)
    out = llm.generate([[1, 2, 3]] * 3, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert all(len(o.token_ids) == 8 for o in out)
    _release(llm)


@pytest.mark.gpu
def test_create_capture_destroy_repeatedly_does_not_grow_memory():
    readings = []
    for _ in range(3):
        llm = LLM("builtin:tiny-llama", device="cuda", max_num_seqs=16, max_num_batched_tokens=128,
                  max_model_len=256, num_kv_blocks=256, enforce_eager=False, cudagraph_mode="FULL_AND_PIECEWISE")
        llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        _release(llm)
        readings.append((torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))
    allocated, reserved = zip(*readings, strict=True)
    assert allocated[2] <= allocated[0] + (1 << 20), readings
    assert reserved[2] <= reserved[0] + (8 << 20), readings


@pytest.mark.gpu
def test_lazy_all_features_variant_matches_eager_capture_on_cuda():
    """Real CUDA graphs: a penalty request joining live decodes captures the all-features graph
    mid-run; its tokens equal those of a runner that captured every variant at start-up."""
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12]]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.3, logprobs=2)]
    tokens = []
    for lazy in (True, False):
        llm = LLM("builtin:qwen2.5-0.5b", device="cuda", max_num_seqs=8, max_num_batched_tokens=256,
                  max_model_len=512, num_kv_blocks=256, enforce_eager=False, lazy_sampler_variants=lazy)
        tokens.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        _release(llm)
    assert tokens[0] == tokens[1]
