"""Per-layer scales of an fp8 KV cache, read from a checkpoint.

An fp8 KV cache (`CacheConfig.cache_dtype="fp8"`) stores `k / k_scale` and `v / v_scale` as
float8_e4m3fn and reads `element * scale` back (graphrunner.attention.torch_ref). Each attention
layer holds its two scales in a persistent [2] fp32 buffer, `Attention.kv_scale` (k_scale,
v_scale), which every kernel reads on the device, so graphs captured before the scales change
still read the new ones. They are 1.0 unless the checkpoint carries them, under the names vLLM
and compressed-tensors write:

    model.layers.N.self_attn.k_scale         model.layers.N.self_attn.v_scale
    model.layers.N.self_attn.attn.k_scale    model.layers.N.self_attn.attn.v_scale

(any prefix before `layers.`, e.g. a vision-language model's `language_model.`). A scale is one
finite positive number (a 0-d or one-element tensor). Query and probability scales
(`q_scale`, `prob_scale`) are accepted and unused: queries and probabilities stay in the
activation dtype. A model built with an "auto" cache keeps the loaded scales unused.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

import torch
from torch import nn

_KV_SCALE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.)?([kv])_scale$")
_UNUSED_SCALE = re.compile(r"(?:^|\.)layers\.\d+\.self_attn\.(?:attn\.)?(?:q|prob)_scale$")
_ATTENTION_MODULE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn$")


def is_kv_scale_name(name: str) -> bool:
    """Whether a checkpoint tensor is an attention layer's KV-cache (or unused query / probability) scale."""
    return bool(_KV_SCALE.search(name) or _UNUSED_SCALE.search(name))


def attention_layers(model: nn.Module) -> dict[int, nn.Module]:
    """Global layer index -> the attention module holding that layer's `kv_scale`, for this rank's layers."""
    found: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        match = _ATTENTION_MODULE.search(name)
        if match is not None and isinstance(getattr(module, "kv_scale", None), torch.Tensor):
            found[int(match.group(1))] = module
    return found


@torch.no_grad()
def load_kv_scales(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy checkpoint KV scales (`is_kv_scale_name`) into the layers' `kv_scale` buffers; returns how
    many were set. Layers of another pipeline stage are skipped. ValueError naming the tensor for a
    scale that is not one finite positive number, names a layer the model does not have, or comes twice
    (under both name forms)."""
    layers = attention_layers(model)
    config = getattr(model, "config", None)
    num_layers = getattr(config, "num_hidden_layers", None)
    seen: dict[tuple[int, str], str] = {}
    count = 0
    for name, tensor in tensors:
        match = _KV_SCALE.search(name)
        if match is None:  # q_scale / prob_scale: nothing reads them
            continue
        layer, which = int(match.group(1)), match.group(2)
        if num_layers is not None and layer >= num_layers:
            raise ValueError(f"KV scale {name!r} names layer {layer} of a model with {num_layers} layers")
        if (layer, which) in seen:
            raise ValueError(f"KV scale {name!r} repeats {seen[layer, which]!r} (one scale per layer and half)")
        seen[layer, which] = name
        if tensor.numel() != 1 or not tensor.dtype.is_floating_point:
            raise ValueError(f"KV scale {name!r} is {tensor.dtype} {tuple(tensor.shape)}; expected one floating "
                             "point number (per-tensor scale)")
        value = float(tensor.reshape(()).float())
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"KV scale {name!r} = {value!r} must be a finite number > 0")
        module = layers.get(layer)
        if module is None:  # another pipeline stage's layer
            continue
        buffer = module.kv_scale
        assert isinstance(buffer, torch.Tensor)
        buffer[0 if which == "k" else 1] = value
        count += 1
    return count


__all__ = ["attention_layers", "is_kv_scale_name", "load_kv_scales"]
