"""Sampled and prompt logprobs through the engine, against Hugging Face transformers.

The reference is an independent full-sequence forward of the same weights in
transformers: `log_softmax` over the whole vocabulary at every position. Our engine
computes logprobs without a full-vocabulary tensor, prompt logprobs chunk by chunk
(under several token budgets, so prompts are split differently), and in eager and
(CPU-emulated) FULL graph modes.
"""

import pytest
import torch

from graphrunner import LLM, SamplingParams
from tests.hf_fixtures import load_hf_model, make_hf_checkpoint

K = 3  # top-k logprobs per position
PROMPT_K = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_hf_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2_lp"))
    return path, load_hf_model(path)


@torch.no_grad()
def reference_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] log-probabilities of the next token at every position."""
    return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].double(), dim=-1)


def check_position(entry: dict, ref_row: torch.Tensor, token: int, k: int) -> None:
    """One position's {token: Logprob}: the chosen token with its rank, plus the top-k."""
    assert token in entry
    assert entry[token].logprob == pytest.approx(float(ref_row[token]), abs=1e-4)
    assert entry[token].rank == 1 + int((ref_row > ref_row[token] + 1e-9).sum())
    top = torch.topk(ref_row, k)
    for rank, (value, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True), start=1):
        assert tid in entry, f"top-{rank} token {tid} missing from {sorted(entry)}"
        assert entry[tid].logprob == pytest.approx(value, abs=1e-4)
    # Nothing beyond the chosen token and the request's own top-k.
    assert len(entry) <= k + 1


@pytest.mark.parametrize("budget,mode", [(64, "eager"), (8, "eager"), (5, "graphs")])
def test_logprobs_match_transformers_across_chunk_sizes(checkpoint, budget, mode):
    path, hf = checkpoint
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (13, 1, 21)]
    kwargs = dict(enforce_eager=True) if mode == "eager" else dict(
        enforce_eager=False, cudagraph_mode="FULL_AND_PIECEWISE", cudagraph_capture_sizes=(1, 2, 4, 8),
        compile_backend="eager",
    )
    llm = LLM(str(path), device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=budget,
              max_model_len=64, block_size=4, num_kv_blocks=64, **kwargs)
    params = [
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=K, prompt_logprobs=PROMPT_K),
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),  # asks for nothing
        SamplingParams(max_tokens=5, temperature=0.8, seed=7, ignore_eos=True, logprobs=0, prompt_logprobs=0),
    ]
    outs = llm.generate(prompts, params)

    plain = outs[1]
    assert plain.logprobs is None and plain.prompt_logprobs is None
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        if p.logprobs is None:
            continue
        ref = reference_logprobs(hf, prompt + out.token_ids)
        # Sampled logprobs: the distribution the token was drawn from, before temperature.
        assert len(out.logprobs) == len(out.token_ids)
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            check_position(entry, ref[len(prompt) - 1 + i], token, p.logprobs)
        # Prompt logprobs: None for the first token, then one per later prompt token.
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        for pos in range(1, len(prompt)):
            check_position(out.prompt_logprobs[pos], ref[pos - 1], prompt[pos], p.prompt_logprobs)


def test_bad_logprobs_request_is_rejected_and_others_keep_running(checkpoint):
    path, hf = checkpoint
    llm = LLM(str(path), device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=64, block_size=4, num_kv_blocks=64, enforce_eager=True)
    with pytest.raises(ValueError, match="logprobs=999 exceeds max_logprobs"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=999))
    with pytest.raises(ValueError, match="logit_bias contains token id"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logit_bias={hf.config.vocab_size + 5: 1.0}))
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=1))
    assert len(out[0].token_ids) == 3 and len(out[0].logprobs) == 3
