"""Tiny PEFT adapters for the LoRA tests (peft is a test-only dependency).

    make_adapter(path, arch, r=8, targets=(...), seed=1, **options) -> path   PeftModel.save_pretrained
    peft_greedy(checkpoint, adapter, prompts, max_tokens) -> token lists     transformers + peft, greedy

Adapters are built with `init_lora_weights=False` (random A and B), so every adapter changes the
model's tokens; `seed` picks the weights.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from tests.hf_fixtures import load_hf_model, make_hf_model


def make_adapter(path: str | os.PathLike, arch: str = "llama", *, r: int = 8,
                 targets: Sequence[str] = ("q_proj", "v_proj"), seed: int = 1, **options) -> str:
    """Save a random LoRA adapter for `arch`'s tiny model (tests/hf_fixtures.py) under `path`."""
    from peft import LoraConfig, get_peft_model

    options.setdefault("lora_alpha", 2 * r)
    torch.manual_seed(seed)
    model = get_peft_model(make_hf_model(arch), LoraConfig(r=r, target_modules=list(targets),
                                                           init_lora_weights=False, **options))
    with torch.no_grad():  # B scaled so that each adapter moves the logits by O(1), like the base weights
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    model.save_pretrained(os.fspath(path))
    return os.fspath(path)


def peft_greedy(checkpoint: str, adapter: str | None, prompts: Sequence[Sequence[int]],
                max_tokens: int) -> list[list[int]]:
    """Greedy tokens of each prompt from transformers (with `adapter` through peft's PeftModel)."""
    from peft import PeftModel

    model = load_hf_model(checkpoint)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(prompt):].tolist())
    return out
