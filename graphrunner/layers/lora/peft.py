"""PEFT adapter folders: read, check against the model, and hold on the host.

A folder has `adapter_config.json` and `adapter_model.safetensors` (what `PeftModel.save_pretrained`
writes). Supported: `peft_type` LORA on any of q/k/v/o_proj and gate/up/down_proj of the decoder
layers, any rank up to `max_lora_rank` (per module, so `rank_pattern` is fine), scaling
`lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`. Everything else that changes the
computation is refused with a ValueError naming the option and the file: DoRA (`use_dora`),
trained biases (`bias`, `lora_bias`), `modules_to_save`, embedding or LM-head adapters, per-module
alphas (`alpha_pattern`), `fan_in_fan_out`, and tensors of modules the model does not have (a layer
index past the model's, an MLP projection of a mixture-of-experts layer).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphrunner.config import ModelConfig
from graphrunner.protocol import LoRARequest

__all__ = ["CONFIG_FILE", "LORA_MODULES", "WEIGHTS_FILE", "LoraAdapter", "load_adapter", "module_shapes",
           "write_dummy_adapter"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_MODULES = ATTENTION_MODULES + MLP_MODULES

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (an adapter name may follow lora_A)
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?"
                  r"\.weight$")


@dataclass
class LoraAdapter:
    """One adapter on the host: per (layer, module) its A [r, in], B [out, r] (full, unsharded HF shapes)
    and scaling. `rank` is its largest module rank."""

    request: LoRARequest
    rank: int
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)

    @property
    def int_id(self) -> int:
        return self.request.lora_int_id

    def targets(self) -> set[str]:
        """The projection names this adapter changes (q_proj, ..., down_proj)."""
        return {module for _, module in self.modules}


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each adaptable projection of `config`'s decoder layers (full HF shapes)."""
    h, i = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (config.q_size, h), "k_proj": (config.kv_size, h), "v_proj": (config.kv_size, h),
        "o_proj": (h, config.q_size), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
    }


def _refuse(request: LoRARequest, file: Path, what: str) -> ValueError:
    return ValueError(f"LoRA {request}: {what} ({file})")


def read_adapter_config(folder: Path, where: str) -> dict[str, Any]:
    """The adapter_config.json object of a PEFT adapter `folder`; ValueError starting with `where` (the
    request, flag or module the folder came from) when the folder, the file or its JSON object is missing."""
    if not folder.is_dir():
        raise ValueError(f"{where}: adapter folder {str(folder)!r} does not exist")
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{where}: {str(folder)!r} has no {CONFIG_FILE} (not a PEFT adapter folder)")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: unreadable JSON: {e} ({path})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: expected a JSON object ({path})")
    return config


def _read_config(request: LoRARequest, folder: Path) -> dict[str, Any]:
    return read_adapter_config(folder, f"LoRA {request}")


def _check_config(request: LoRARequest, path: Path, config: dict[str, Any]) -> tuple[float, bool]:
    """(lora_alpha, use_rslora) after refusing every unsupported option."""
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _refuse(request, path, f"peft_type={peft_type!r} is not supported (only LORA)")
    refusals = (
        ("use_dora", "DoRA adapters are not supported"),
        ("lora_bias", "trained LoRA biases are not supported"),
        ("fan_in_fan_out", "fan_in_fan_out (Conv1D weights) is not supported"),
        ("modules_to_save", "modules_to_save (fully trained modules such as an embedding or LM head) "
                            "is not supported"),
        ("alpha_pattern", "per-module alphas (alpha_pattern) are not supported"),
        ("target_parameters", "target_parameters is not supported"),
    )
    for key, why in refusals:
        if config.get(key):
            raise _refuse(request, path, f"{key}={config[key]!r}: {why}")
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise _refuse(request, path, f"bias={bias!r}: trained biases are not supported (only 'none')")
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        unknown = sorted(str(t) for t in targets if str(t).rsplit(".", 1)[-1] not in LORA_MODULES)
        if unknown:
            what = "embedding or LM-head adapters are" if any(
                t.endswith(("embed_tokens", "lm_head")) for t in unknown) else "these modules are"
            raise _refuse(request, path, f"target_modules {unknown}: {what} not supported "
                                         f"(supported: {list(LORA_MODULES)})")
    alpha = config.get("lora_alpha", config.get("r", 8))
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise _refuse(request, path, f"lora_alpha={alpha!r} must be a positive number")
    return float(alpha), bool(config.get("use_rslora", False))


def _read_tensors(request: LoRARequest, folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        other = " (adapter_model.bin is not read: save with safe_serialization)" if (
            folder / "adapter_model.bin").is_file() else ""
        raise ValueError(f"LoRA {request}: {folder} has no {WEIGHTS_FILE}{other}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return path, load_file(os.fspath(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise _refuse(request, path, f"unreadable safetensors: {e}") from None


def load_adapter(request: LoRARequest, config: ModelConfig, max_lora_rank: int) -> LoraAdapter:
    """Read and check `request`'s folder against the model `config`; ValueError naming the option or
    tensor and the file for anything unsupported, missing or misshaped."""
    folder = Path(request.lora_path)
    adapter_config = _read_config(request, folder)
    alpha, rslora = _check_config(request, folder / CONFIG_FILE, adapter_config)
    path, tensors = _read_tensors(request, folder)
    shapes = module_shapes(config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if "lora_magnitude_vector" in key:
            raise _refuse(request, path, f"tensor {key!r}: DoRA adapters are not supported")
        if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
            raise _refuse(request, path, f"tensor {key!r}: embedding or LM-head adapters are not supported")
        m = _KEY.match(key)
        if m is None or m.group(3) not in LORA_MODULES:
            raise _refuse(request, path, f"tensor {key!r} is not a LoRA A/B of a decoder projection "
                                         f"(supported: {list(LORA_MODULES)})")
        layer, block, module, half = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if (block == "mlp") != (module in MLP_MODULES):
            raise _refuse(request, path, f"tensor {key!r}: {module} is not under {block}")
        if layer >= config.num_hidden_layers:
            raise _refuse(request, path, f"tensor {key!r}: layer {layer} is not present "
                                         f"(the model has {config.num_hidden_layers} layers)")
        if module in MLP_MODULES and config.is_sparse_layer(layer):
            raise _refuse(request, path, f"tensor {key!r}: layer {layer}'s MLP is a mixture of experts; "
                                         "adapters on expert projections are not supported")
        if tensor.dim() != 2:
            raise _refuse(request, path, f"tensor {key!r} has shape {tuple(tensor.shape)}, expected 2 dimensions")
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise _refuse(request, path, "no LoRA tensors")
    adapter = LoraAdapter(request, rank=0)
    for (layer, module), pair in sorted(halves.items()):
        name = f"layer {layer} {module}"
        if set(pair) != {"A", "B"}:
            missing = "B" if "A" in pair else "A"
            raise _refuse(request, path, f"{name} has no lora_{missing} tensor")
        a, b = pair["A"], pair["B"]
        out, inp = shapes[module]
        r = a.shape[0]
        if tuple(a.shape) != (r, inp) or tuple(b.shape) != (out, r):
            raise _refuse(request, path, f"{name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                                         f"the model's [{out}, {inp}] projection (expected [r, {inp}] and [{out}, r])")
        if not 1 <= r <= max_lora_rank:
            raise _refuse(request, path, f"{name} has rank {r}, above max_lora_rank={max_lora_rank}")
        scale = alpha / (math.sqrt(r) if rslora else r)
        adapter.modules[(layer, module)] = (a, b, scale)
        adapter.rank = max(adapter.rank, r)
    return adapter


def write_dummy_adapter(path: str | os.PathLike, config: ModelConfig, rank: int, *,
                        targets: tuple[str, ...] = LORA_MODULES, seed: int = 0,
                        dtype: torch.dtype = torch.bfloat16, scale: float = 0.01) -> str:
    """Write a random PEFT adapter folder for `config`'s model (every dense decoder layer, `targets`, rank
    `rank`, lora_alpha = 2 * rank): benchmarks and tests run the real loading path without a trained
    adapter. A and B are scaled so that the adapter changes each projection's output by about `scale`
    times a unit-variance input's norm."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    shapes = module_shapes(config)
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config.num_hidden_layers):
        for module in targets:
            if module in MLP_MODULES and config.is_sparse_layer(layer):
                continue
            out, inp = shapes[module]
            block = "mlp" if module in MLP_MODULES else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, inp, generator=g) / inp**0.5).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out, rank, generator=g) * scale / rank**0.5).to(dtype)
    save_file(tensors, os.fspath(folder / WEIGHTS_FILE))
    (folder / CONFIG_FILE).write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets), "bias": "none",
        "use_rslora": False, "use_dora": False, "modules_to_save": None}, indent=2))
    return os.fspath(folder)
