"""Prompt embeddings (vLLM's `enable_prompt_embeds`): a prompt given as the model's own token
embeddings generates exactly the tokens of its token ids, alone or mixed with token-id prompts,
chunked over steps, eagerly and from FULL and PIECEWISE graphs (the first stage reads the persistent
inputs_embeds buffer); bad embeddings raise and leave the other requests alone."""

from __future__ import annotations

import pytest
import torch

from graphrunner import LLM, SamplingParams

MODES = ["NONE", "FULL", "PIECEWISE"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [9] * 40]  # the last is chunked (32-token budget)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _llm(mode: str) -> LLM:
    kw = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96,
              block_size=4, num_kv_blocks=64, enable_prompt_embeds=True)
    if mode == "NONE":
        return LLM("builtin:tiny-llama", enforce_eager=True, **kw)
    return LLM("builtin:tiny-llama", enforce_eager=False, cudagraph_mode=mode, compile_backend="eager",
               cudagraph_capture_sizes=(1, 2, 4, 8, 16, 32), debug_cudagraphs=True, **kw)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("mode", MODES)
def test_prompt_embeds_equal_the_token_id_path(mode):
    llm = _llm(mode)
    table = llm.runner.model.embed_input_ids
    embeds = [{"prompt_embeds": table(torch.tensor(p)).clone()} for p in PROMPTS]
    ref = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert _tokens(llm.generate(embeds, GREEDY, use_tqdm=False)) == ref
    assert _tokens(llm.generate([embeds[0], PROMPTS[1], embeds[2]], GREEDY, use_tqdm=False)) == ref
    # Other embeddings than the table's give other tokens: the buffer is really read.
    shifted = [{"prompt_embeds": e["prompt_embeds"] + 0.5} for e in embeds]
    assert _tokens(llm.generate(shifted, GREEDY, use_tqdm=False)) != ref


def test_bad_prompt_embeds_raise_and_leave_others_alone():
    llm = _llm("NONE")
    with pytest.raises(ValueError, match=r"prompt_embeds must be a float tensor \[length >= 1, hidden_size=128\]"):
        llm.generate([PROMPTS[0], {"prompt_embeds": torch.zeros(3, 7)}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="'prompt_embeds' replaces the prompt's token ids"):
        llm.generate([{"prompt_embeds": torch.zeros(3, 128), "prompt_token_ids": [1, 2, 3]}], GREEDY)
    assert not llm.scheduler.has_unfinished_requests()
    assert len(_tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))) == 3
    plain = LLM("builtin:tiny-llama", device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=32,
                max_model_len=64, num_kv_blocks=16)
    with pytest.raises(ValueError, match="enable_prompt_embeds"):
        plain.generate([{"prompt_embeds": torch.zeros(3, 128)}], GREEDY)
    with pytest.raises(ValueError, match="text-only"):
        plain.generate([{"prompt_token_ids": [1, 2], "multi_modal_data": {"image": torch.zeros(3, 8, 8)}}], GREEDY)


@pytest.mark.gpu
def test_gpu_prompt_embeds_equal_the_token_id_path():
    llm = LLM("builtin:tiny-llama", device="cuda", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=96, num_kv_blocks=32, enable_prompt_embeds=True)
    table = llm.runner.model.embed_input_ids
    embeds = [{"prompt_embeds": table(torch.tensor(p, device="cuda")).cpu()} for p in PROMPTS]
    assert _tokens(llm.generate(embeds, GREEDY, use_tqdm=False)) == _tokens(llm.generate(PROMPTS, GREEDY,
                                                                                         use_tqdm=False))
    llm.shutdown()
