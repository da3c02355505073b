"""End-to-end parity with Hugging Face transformers on the same weights.

Tiny Llama / Llama-3 (rope scaling) / Mistral / Qwen2 / Qwen3 checkpoints, and the
mixture-of-experts Mixtral / Qwen2-MoE / Qwen3-MoE ones, are built with
transformers, saved, loaded by our loader and run through the reference engine; 32 greedy
tokens must equal a plain transformers greedy loop (full recompute each step, an
independent reference), alone and in a mixed batch under chunked prefill and preemption.
"""

import pytest
import torch

from graphrunner import LLM, SamplingParams
from tests.hf_fixtures import ARCHS, load_hf_model, make_hf_checkpoint

NUM_TOKENS = 32


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    for _ in range(n):
        nxt = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    path = make_hf_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, load_hf_model(path)


def test_single_request_greedy_matches_transformers(checkpoint):
    arch, path, hf = checkpoint
    prompt = _prompts(hf.config.vocab_size, [11], seed=1)[0]
    llm = LLM(str(path), device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
              max_model_len=128, block_size=8, num_kv_blocks=64)
    out = llm.generate([prompt], SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True))
    assert out[0].token_ids == hf_greedy(hf, prompt, NUM_TOKENS)


def test_mixed_batch_under_chunked_prefill_and_preemption_matches_transformers(checkpoint):
    arch, path, hf = checkpoint
    prompts = _prompts(hf.config.vocab_size, [5, 23, 1, 40, 12], seed=2)
    # A 16-token budget chunks the longer prompts; 20 blocks of 4 tokens cannot hold every
    # request's 32 new tokens at once, so the scheduler must preempt and recompute.
    llm = LLM(str(path), device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=16,
              max_model_len=128, block_size=4, num_kv_blocks=20)
    out = llm.generate(prompts, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True))
    assert llm.scheduler.num_preemptions > 0
    for prompt, o in zip(prompts, out, strict=True):
        assert o.token_ids == hf_greedy(hf, prompt, NUM_TOKENS)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3"])
def test_gpu_greedy_matches_transformers(arch, tmp_path):
    """CUDA, fp32, Triton kernels: same tokens as transformers on the CPU."""
    path = make_hf_checkpoint(arch, tmp_path)
    hf = load_hf_model(path)
    prompts = _prompts(hf.config.vocab_size, [5, 23, 1, 40, 12], seed=3)
    llm = LLM(str(path), device="cuda", dtype="float32", max_num_seqs=4, max_num_batched_tokens=16,
              max_model_len=128, block_size=16, num_kv_blocks=12)
    out = llm.generate(prompts, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True))
    for prompt, o in zip(prompts, out, strict=True):
        assert o.token_ids == hf_greedy(hf, prompt, NUM_TOKENS)
