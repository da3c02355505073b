"""Qwen2.5-VL: a windowed vision tower and patch merger in front of a Qwen2 decoder with M-RoPE.

The decoder is `LlamaForCausalLM` (Qwen2's flags: q/k/v bias; same layers, graphs and sampler) with
`rope_type: "mrope"`: the step hands it [T, 3] (temporal, height, width) positions
(`graphrunner.multimodal.mrope`), and its rotary gathers each token's cos | sin from the three. Images
never enter the decoder's graphs: the runner encodes each scheduled image once (`encode_mm_inputs`,
eager), keeps its embeddings in the encoder cache and copies them into the persistent inputs_embeds at
the image's placeholders before each step, as for LLaVA.

Checkpoints name tensors in either transformers layout: `model.language_model.*`, `model.visual.*`,
`lm_head.*` (transformers 5), or `model.*`, `visual.*`, `lm_head.*` (the Hub's Qwen2.5-VL folders).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from graphrunner.attention.base import AttentionBackend
from graphrunner.config import KernelConfig, ModelConfig, Qwen2_5_VisionConfig
from graphrunner.distributed.comm import TPComm
from graphrunner.layers.rotary import check_mrope_section
from graphrunner.models.llama import LlamaForCausalLM, _WeightTarget, names_in_every_layout, renamed_weights
from graphrunner.models.qwen2_5_vision import _ACTIVATIONS, Qwen2_5_VisionTower

ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
# Checkpoint prefixes -> the names this model uses (first match wins).
_RENAMES = (
    ("model.language_model.", "model."),
    ("model.visual.", "visual."),
)
_TEXT_DEFAULTS = {"max_position_embeddings": 128000, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0}
_VISION_DEFAULTS: dict[str, Any] = {
    "depth": 32, "hidden_size": 3584, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 3584,
    "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31], "in_channels": 3, "hidden_act": "silu",
}


def _bad(name: str, value: Any, rule: str) -> ValueError:
    return ValueError(f"config.json field {name}={value!r} must be {rule}")


def _int(raw: dict[str, Any], key: str, where: str, minimum: int, default: Any) -> int:
    value = raw.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(where + key, value, f"an int >= {minimum}")
    return value


def qwen2_5_vl_model_config(raw: dict[str, Any], *, name: str,
                            text_config: Callable[..., ModelConfig]) -> ModelConfig:
    """A Qwen2.5-VL config.json (text fields in `text_config` or, in the Hub's folders, at the top level)
    as the decoder's `ModelConfig` with its `vision` part; `text_config` parses a Qwen2 decoder's dict
    (the loader's `model_config_from_dict`). ValueError naming the field and its value when one is bad."""
    nested = raw.get("text_config")
    if nested is not None and not isinstance(nested, dict):
        raise _bad("text_config", nested, "an object")
    text = dict(nested if nested else {k: v for k, v in raw.items() if k not in ("vision_config", "architectures")})
    text["architectures"] = ["Qwen2ForCausalLM"]
    for key, value in _TEXT_DEFAULTS.items():
        text.setdefault(key, value)
    for key in ("eos_token_id", "tie_word_embeddings"):
        if key not in text and key in raw:
            text[key] = raw[key]
    if raw.get("tie_word_embeddings") is True:  # transformers ties when either level says so
        text["tie_word_embeddings"] = True
    # M-RoPE: the rope dict says "mrope" (older folders) or "default" (transformers 5) with an mrope_section.
    rope_key = "rope_parameters" if text.get("rope_parameters") else "rope_scaling"
    rope = text.get(rope_key) or {}
    if not isinstance(rope, dict):
        raise _bad(rope_key, rope, "an object")
    rope = dict(rope)
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type not in ("mrope", "default"):
        raise _bad(f"{rope_key}.rope_type", rope_type, "'mrope' or 'default' (Qwen2.5-VL's M-RoPE)")
    section = rope.pop("mrope_section", None)
    text[rope_key] = rope or None
    decoder = text_config(text, name=name)
    try:
        sections = check_mrope_section(section, decoder.head_dim)
    except ValueError:
        raise _bad(f"{rope_key}.mrope_section", section,
                   f"three ints >= 0 summing to head_dim / 2 = {decoder.head_dim // 2}") from None
    if decoder.rope_scaling is not None:
        raise _bad(rope_key, text[rope_key], "M-RoPE with default frequencies (no other scaling keys)")
    vision = _vision_config(raw, name)
    if vision.out_hidden_size != decoder.hidden_size:
        raise _bad("vision_config.out_hidden_size", vision.out_hidden_size,
                   f"the decoder's hidden_size={decoder.hidden_size}")
    return dataclasses.replace(decoder, architecture=ARCHITECTURE, vision=vision,
                               rope_scaling={"rope_type": "mrope", "mrope_section": list(sections)})


def _vision_config(raw: dict[str, Any], name: str) -> Qwen2_5_VisionConfig:
    v = raw.get("vision_config") or {}
    if not isinstance(v, dict):
        raise _bad("vision_config", v, "an object")
    w = "vision_config."
    fields: dict[str, Any] = {}
    for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "patch_size",
                "temporal_patch_size", "spatial_merge_size", "window_size"):
        fields[key] = _int(v, key, w, 1, _VISION_DEFAULTS[key])
    in_key = "in_channels" if "in_channels" in v else "in_chans"
    fields["in_channels"] = _int(v, in_key, w, 1, 3)
    act = v.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise _bad(w + "hidden_act", act, f"one of {list(_ACTIVATIONS)}")
    full = v.get("fullatt_block_indexes", _VISION_DEFAULTS["fullatt_block_indexes"])
    if not isinstance(full, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < fields["depth"]
                                             for i in full):
        raise _bad(w + "fullatt_block_indexes", full, f"a list of block indices in [0, depth={fields['depth']})")
    rope = v.get("rope_parameters") or {}
    theta = rope.get("rope_theta", 10000.0) if isinstance(rope, dict) else rope
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not (math.isfinite(theta) and theta > 0):
        raise _bad(w + "rope_parameters.rope_theta", theta, "a finite number > 0")
    head = fields["hidden_size"] // fields["num_heads"]
    if fields["hidden_size"] % fields["num_heads"] or head % 4:
        raise _bad(w + "num_heads", fields["num_heads"],
                   f"a divisor of hidden_size={fields['hidden_size']} leaving a head size divisible by 4")
    cell = fields["patch_size"] * fields["spatial_merge_size"]
    if fields["window_size"] < cell:
        raise _bad(w + "window_size", fields["window_size"], f">= patch_size * spatial_merge_size = {cell}")
    image_token = _int(raw, "image_token_id", "", 0, 151655)
    start_token = _int(raw, "vision_start_token_id", "", 0, 151652)
    from graphrunner.multimodal.qwen2_vl_processor import image_pixel_limits

    max_pixels = image_pixel_limits(name)[1]
    return Qwen2_5_VisionConfig(
        **fields, fullatt_block_indexes=tuple(full), hidden_act=str(act), rope_theta=float(theta),
        image_token_id=image_token, vision_start_token_id=start_token,
        max_image_tokens=max(1, max_pixels // cell ** 2),
    )


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    """`LlamaForCausalLM` with M-RoPE, plus the vision tower and `encode_mm_inputs` (module docstring)."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, *, dtype: torch.dtype, device,
                 tp: TPComm | None = None, pp_rank: int = 0, pp_size: int = 1,
                 kernel: KernelConfig | None = None) -> None:
        if not isinstance(config.vision, Qwen2_5_VisionConfig):
            raise ValueError(f"{config.name!r}: {ARCHITECTURE} needs a Qwen2.5-VL vision config")
        super().__init__(config, attn_backend, dtype=dtype, device=device, tp=tp, pp_rank=pp_rank, pp_size=pp_size,
                         kernel=kernel)
        self.visual = Qwen2_5_VisionTower(config.vision, dtype=dtype, device=device)

    @torch.no_grad()
    def encode_mm_inputs(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """One image batch ({"pixel_values": [N_i, C·T·P²], "image_grid_thw": [3]} each) -> each image's
        decoder embeddings [t·h·w / merge², hidden]."""
        device = self.visual.merger.ln_q.weight.device
        grids = [tuple(int(g) for g in x["image_grid_thw"].tolist()) for x in inputs]
        patches = torch.cat([x["pixel_values"] for x in inputs]).to(device)
        merge = self.visual.config.spatial_merge_size ** 2
        out = self.visual(patches, grids)
        return list(out.split([t * h * w // merge for t, h, w in grids]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(renamed_weights(weights, _RENAMES))

    def _weight_targets(self) -> tuple[dict[str, _WeightTarget], dict[str, _WeightTarget]]:
        targets, alternates = super()._weight_targets()
        for n, p in self.visual.named_parameters():
            targets["visual." + n] = _WeightTarget(tuple(p.shape), p.copy_)
        return targets, alternates

    def checkpoint_names(self) -> set[str]:
        """Every tensor name a Qwen2.5-VL checkpoint may hold, in either layout."""
        targets, alternates = self._weight_targets()
        return names_in_every_layout(set(targets) | set(alternates), _RENAMES)
