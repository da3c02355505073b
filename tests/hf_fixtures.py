"""Tiny Hugging Face checkpoints for parity tests (transformers is a test-only dependency).

    make_hf_checkpoint(arch, path, *, seed=0, make_sharded=False, **overrides) -> path
    load_hf_model(path) -> the transformers model, fp32, eval, eager attention
    write_legacy_config(path)  rewrites config.json with pre-transformers-5 keys

`arch` is one of ARCHS. Weights are random with a fixed seed, at a scale that makes
logits O(1); norm weights and biases are perturbed away from 1 / 0 so that a model that
ignores them fails parity. `overrides` are config fields (e.g. tie_word_embeddings=True,
attention_bias=True, rope_parameters={...}).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")

_COMMON: dict[str, Any] = dict(
    vocab_size=640,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

# Per-arch config fields on top of _COMMON: every arch exercises something different.
_ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "llama3": dict(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        eos_token_id=[2, 3],
        # A short pretraining length puts every frequency band (kept, smoothed,
        # divided) inside head_dim=32, so all three branches of the scaling matter.
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": dict(
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=None,  # full attention, like graphrunner's backends
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
    "qwen2": dict(
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        eos_token_id=[2, 4],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
    # head_dim 32 != hidden / heads = 16: Qwen3 states head_dim explicitly.
    "qwen3": dict(head_dim=32, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # Mixture of experts: 8 experts of width 32 (Mixtral's experts take intermediate_size).
    "mixtral": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=None,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # Top-3 without renormalisation, a shared expert with its sigmoid gate, qkv bias, and a dense
    # layer (mlp_only_layers) of the model's intermediate_size.
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1],
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen3_moe": dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}

_INIT_STD = 0.1  # logits O(1) at hidden 64-128, so an atol of 1e-4 is a real check


def _config_class(arch: str):
    import transformers

    names = {
        "llama": "LlamaConfig",
        "llama3": "LlamaConfig",
        "mistral": "MistralConfig",
        "qwen2": "Qwen2Config",
        "qwen3": "Qwen3Config",
        "mixtral": "MixtralConfig",
        "qwen2_moe": "Qwen2MoeConfig",
        "qwen3_moe": "Qwen3MoeConfig",
    }
    if arch not in names:
        raise ValueError(f"unknown fixture arch {arch!r}; allowed: {list(ARCHS)}")
    return getattr(transformers, names[arch])


def make_hf_config(arch: str, **overrides: Any):
    """The transformers config of fixture `arch`, with `overrides` applied."""
    fields = {**_COMMON, **_ARCH_CONFIGS.get(arch, {}), **overrides}
    return _config_class(arch)(**fields)


@torch.no_grad()
def make_hf_model(arch: str, *, seed: int = 0, **overrides: Any):
    """A randomly initialized fp32 transformers model of fixture `arch` (eval mode)."""
    from transformers import AutoModelForCausalLM

    config = make_hf_config(arch, **overrides)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():  # tied weights are listed once
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.2 * noise)
        elif name.endswith(".bias"):
            param.copy_(0.2 * noise)
        else:
            param.copy_(_INIT_STD * noise)
    return model


def make_hf_checkpoint(
    arch: str,
    path: str | os.PathLike,
    *,
    seed: int = 0,
    make_sharded: bool = False,
    num_shards: int = 3,
    **overrides: Any,
) -> Path:
    """Save a tiny fp32 checkpoint of fixture `arch` to `path` (config.json + safetensors).

    With `make_sharded`, weights go to `model-0000i-of-0000N.safetensors` files plus
    `model.safetensors.index.json` instead of one `model.safetensors`.
    """
    path = Path(path)
    model = make_hf_model(arch, seed=seed, **overrides)
    model.save_pretrained(path)
    if make_sharded:
        shard_checkpoint(path, num_shards)
    return path


def shard_checkpoint(path: str | os.PathLike, num_shards: int = 3) -> None:
    """Split `path/model.safetensors` into `num_shards` files with an index, round-robin by tensor."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    single = path / "model.safetensors"
    tensors = load_file(single)
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    total = 0
    for s in range(num_shards):
        file = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::num_shards]}
        save_file(part, path / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    with open(path / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    single.unlink()


def write_legacy_config(path: str | os.PathLike) -> None:
    """Rewrite `path/config.json` with the keys checkpoints had before transformers 5:
    top-level `rope_theta`, `rope_scaling` with `type` (None for plain rope), `torch_dtype`."""
    file = Path(path) / "config.json"
    raw = json.loads(file.read_text())
    params = dict(raw.pop("rope_parameters", None) or {})
    raw["rope_theta"] = params.pop("rope_theta", 10000.0)
    rope_type = params.pop("rope_type", "default")
    raw["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **params}
    if "dtype" in raw:
        raw["torch_dtype"] = raw.pop("dtype")
    file.write_text(json.dumps(raw, indent=2))


def load_hf_model(path: str | os.PathLike):
    """The saved checkpoint as a transformers model: fp32, eval, eager attention (the reference)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
