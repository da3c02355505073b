"""A checkpoint's `quantization_config` -> `QuantConfig`, and `LLM(quantization=...)` on top of it.

Two published fp8 formats load as they are:

- compressed-tensors (`quant_method: "compressed-tensors"`, the format of llm-compressor's FP8 and
  FP8-dynamic checkpoints): one config group of 8-bit float weights with a "channel", "tensor"
  or "block" strategy; activations dynamic per token (or per group with block weights) or static
  per tensor (`input_scale`). Tensors: `weight` (e4m3), `weight_scale`, `input_scale`.
- fp8 (`quant_method: "fp8"`, as Qwen3-FP8 and DeepSeek publish): `weight_block_size` [rows,
  columns] with `weight_scale_inv` per tile and dynamic activations; without a block size, one
  `weight_scale` per tensor, activations as `activation_scheme` says.

Anything else is refused with an error naming the field, its value and what is supported.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from graphrunner.config import QUANT_METHODS, ModelConfig, QuantConfig

CHECKPOINT_FORMATS = ("compressed-tensors", "fp8")


def parse_quantization_config(raw: Any) -> QuantConfig:
    """The `QuantConfig` of a config.json's `quantization_config` (ValueError naming what is not
    supported)."""
    if not isinstance(raw, dict):
        raise ValueError(f"quantization_config={raw!r} must be a JSON object")
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    if method == "fp8":
        return _fp8(raw)
    raise ValueError(f"quantization_config.quant_method={method!r} is not supported; supported: "
                     f"{list(CHECKPOINT_FORMATS)} with 8-bit float (e4m3) weights")


def _ignore(raw: dict[str, Any], key: str) -> tuple[str, ...]:
    names = raw.get(key) or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"quantization_config.{key}={names!r} must be a list of module names")
    return tuple(names)


def _block(value: Any, field: str) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2 and all(type(v) is int and v > 0 for v in value)):
        raise ValueError(f"quantization_config.{field}={value!r} must be [rows, columns], two ints > 0")
    return value[0], value[1]


def _fp8(raw: dict[str, Any]) -> QuantConfig:
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt={fmt!r} is not supported; supported: 'e4m3'")
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"quantization_config.activation_scheme={scheme!r} must be 'dynamic' or 'static'")
    ignore = _ignore(raw, "ignored_layers") + _ignore(raw, "modules_to_not_convert")
    block = raw.get("weight_block_size")
    if block is not None:
        if scheme != "dynamic":
            raise ValueError("quantization_config: block-wise fp8 weights (weight_block_size) take "
                             f"activation_scheme 'dynamic', not {scheme!r}")
        return QuantConfig(weight_scale="block", block_size=_block(block, "weight_block_size"),
                           prequantized=True, ignore=ignore, scale_name="weight_scale_inv")
    return QuantConfig(weight_scale="tensor", activation_scheme=scheme, prequantized=True, ignore=ignore)


def _compressed_tensors(raw: dict[str, Any]) -> QuantConfig:
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ValueError("quantization_config.config_groups must hold exactly one group (one fp8 scheme for "
                         f"every linear layer); got {groups!r}")
    (name, group), = groups.items()
    where = f"quantization_config.config_groups.{name}"
    if not isinstance(group, dict):
        raise ValueError(f"{where}={group!r} must be a JSON object")
    weights = group.get("weights")
    if not isinstance(weights, dict) or weights.get("num_bits") != 8 or weights.get("type") != "float":
        raise ValueError(f"{where}.weights={weights!r} is not supported; supported: 8-bit float weights "
                         "(num_bits 8, type 'float')")
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor", "block"):
        raise ValueError(f"{where}.weights.strategy={strategy!r} is not supported; supported: "
                         "'channel', 'tensor', 'block'")
    if weights.get("dynamic"):
        raise ValueError(f"{where}.weights.dynamic=true is not supported: fp8 weights carry their scales")
    block = _block(weights.get("block_structure"), f"config_groups.{name}.weights.block_structure") \
        if strategy == "block" else None
    acts = group.get("input_activations")
    if acts is None:
        raise ValueError(f"{where}.input_activations is null (fp8 weights with unquantized activations); "
                         "supported: 8-bit float activations, dynamic or static")
    if not isinstance(acts, dict) or acts.get("num_bits") != 8 or acts.get("type") != "float":
        raise ValueError(f"{where}.input_activations={acts!r} is not supported; supported: 8-bit float")
    dynamic = acts.get("dynamic")
    act_strategy = acts.get("strategy")
    if dynamic is True:
        want = ("group",) if block is not None else ("token",)
        if act_strategy not in want:
            raise ValueError(f"{where}.input_activations.strategy={act_strategy!r} with dynamic scales and "
                             f"{strategy!r} weights is not supported; supported: {list(want)}")
        if block is not None and acts.get("group_size") not in (None, block[1]):
            raise ValueError(f"{where}.input_activations.group_size={acts.get('group_size')!r} must equal the "
                             f"weight block's columns, {block[1]}")
        scheme = "dynamic"
    elif dynamic is False and act_strategy == "tensor" and block is None:
        scheme = "static"
    else:
        raise ValueError(f"{where}.input_activations (dynamic={dynamic!r}, strategy={act_strategy!r}) is not "
                         "supported; supported: dynamic per token, dynamic per group (block weights), static "
                         "per tensor")
    return QuantConfig(weight_scale=strategy, block_size=block, activation_scheme=scheme, prequantized=True,
                       ignore=_ignore(raw, "ignore"))


def with_quantization(config: ModelConfig, quantization: str | None) -> ModelConfig:
    """`config` with `LLM(quantization=...)` applied: None keeps the checkpoint's own (or none);
    "fp8" keeps a pre-quantized checkpoint's format, else quantizes the weights at load (per output
    channel, dynamic per-token activations, as vLLM's online fp8)."""
    if quantization is None:
        return config
    if quantization not in QUANT_METHODS:
        raise ValueError(f"quantization={quantization!r} is not supported; supported: {list(QUANT_METHODS)} "
                         "(or None: the checkpoint's own quantization_config, if any)")
    if config.quant is not None:
        return config
    return dataclasses.replace(config, quant=QuantConfig())


__all__ = ["CHECKPOINT_FORMATS", "parse_quantization_config", "with_quantization"]
