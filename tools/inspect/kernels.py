"""`graphrunner inspect kernels`: the kernel choices of a runner, and the plan each projection gets.

The choices are `KernelConfig`'s fields (the defaults, or `--kernel-config` JSON); the plans come
from them, the projection's shape and the device's properties (`graphrunner.kernels.device`), as
the layers pick them at construction. No model is built: the shapes come from the model's config.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def projection_shapes(model: Any, tp_size: int = 1) -> dict[str, tuple[int, int]]:
    """[N, K] of each projection one rank holds (a `ModelConfig`)."""
    h, d = model.hidden_size, model.head_dim
    heads, kv_heads = model.num_attention_heads // tp_size, max(1, model.num_key_value_heads // tp_size)
    inter = model.intermediate_size // tp_size
    return {
        "qkv_proj": ((heads + 2 * kv_heads) * d, h),
        "o_proj": (h, heads * d),
        "gate_up_proj": (2 * inter, h),
        "down_proj": (h, inter),
        "lm_head": (model.vocab_size, h),
    }


def kernel_report(model_name: str, kernel: Any, device: str) -> dict[str, Any]:
    """The config, the device's properties (None off a GPU) and each projection's method."""
    from graphrunner.kernels.device import device_properties
    from graphrunner.layers.linear import choose_linear_method
    from graphrunner.models.loader import load_model_config

    model = load_model_config(model_name)
    props = device_properties(device)
    return {
        "model": model_name,
        "device": device,
        "kernel_config": dataclasses.asdict(kernel),
        "device_properties": None if props is None else {**dataclasses.asdict(props), "wide_memory": props.wide_memory},
        "projections": {
            name: {"n": n, "k": k, "method": repr(choose_linear_method(kernel, props, n, k))}
            for name, (n, k) in projection_shapes(model).items()
        },
    }


def kernel_text(report: dict[str, Any]) -> str:
    lines = [f"KernelConfig ({report['model']} on {report['device']})"]
    lines += [f"  {name:<26} {value}" for name, value in report["kernel_config"].items()]
    props = report["device_properties"]
    lines.append("device properties: " + ("none (not a GPU: torch paths)" if props is None else ""))
    if props is not None:
        lines += [f"  {name:<26} {value}" for name, value in props.items()]
    lines.append("projections (one rank):")
    for name, p in report["projections"].items():
        lines.append(f"  {name:<14} N={p['n']:<7} K={p['k']:<6} {p['method']}")
    return "\n".join(lines)
