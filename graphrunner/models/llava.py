"""LLaVA: a CLIP vision tower and a two-layer projector in front of a Llama-family decoder.

The decoder is `LlamaForCausalLM` (same layers, graphs and sampler). Images never enter the
decoder's graphs: the runner encodes each scheduled image once (`encode_mm_inputs`, eager), keeps
the projected features in its encoder cache, and copies them into the persistent inputs_embeds at
the image's placeholder positions before each step (`graphrunner.multimodal.embeds`).

Checkpoints name tensors in either transformers layout: `language_model.model.*` /
`language_model.lm_head.*` with top-level `vision_tower.*` and `multi_modal_projector.*` (as
`save_pretrained` writes them), or `model.language_model.*`, `model.vision_tower.*`, ... .
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from graphrunner.attention.base import AttentionBackend
from graphrunner.config import KernelConfig, ModelConfig, VisionConfig
from graphrunner.distributed.comm import TPComm
from graphrunner.models.clip import CLIPVisionTower, activation
from graphrunner.models.llama import LlamaForCausalLM, _WeightTarget, names_in_every_layout, renamed_weights

# Checkpoint prefixes -> the names this model uses (first match wins).
_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def llava_model_config(raw: dict[str, Any], *, name: str, text_config: Callable[..., ModelConfig]) -> ModelConfig:
    """A LLaVA config.json as the decoder's `ModelConfig` with its `vision` part; `text_config`
    parses the decoder's dict (the loader's `model_config_from_dict`)."""
    text = dict(raw.get("text_config") or {})
    if not text.get("architectures"):
        model_type = text.get("model_type", "llama")
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"LLaVA text_config model_type={model_type!r}; supported: {sorted(_MODEL_TYPES)}")
        text["architectures"] = [_MODEL_TYPES[model_type]]
    for key in ("eos_token_id", "tie_word_embeddings"):
        if key not in text and key in raw:
            text[key] = raw[key]
    v = dict(raw.get("vision_config") or {})
    if v.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ValueError(f"LLaVA vision_config model_type={v.get('model_type')!r}; supported: ['clip_vision_model']")
    feature_layer = raw.get("vision_feature_layer", -2)
    if not isinstance(feature_layer, int):
        raise ValueError(f"vision_feature_layer={feature_layer!r}: graphrunner reads one layer (an int)")
    image_token = raw.get("image_token_id", raw.get("image_token_index", 32000))
    vision = VisionConfig(
        hidden_size=int(v.get("hidden_size", 1024)), intermediate_size=int(v.get("intermediate_size", 4096)),
        num_hidden_layers=int(v.get("num_hidden_layers", 24)),
        num_attention_heads=int(v.get("num_attention_heads", 16)),
        image_size=int(v.get("image_size", 336)), patch_size=int(v.get("patch_size", 14)),
        num_channels=int(v.get("num_channels", 3)), layer_norm_eps=float(v.get("layer_norm_eps", 1e-5)),
        hidden_act=str(v.get("hidden_act", "quick_gelu")), image_token_id=int(image_token),
        projector_hidden_act=str(raw.get("projector_hidden_act", "gelu")),
        projector_bias=bool(raw.get("multimodal_projector_bias", True)), vision_feature_layer=feature_layer,
        vision_feature_select_strategy=str(raw.get("vision_feature_select_strategy", "default")),
    )
    activation(vision.hidden_act), activation(vision.projector_hidden_act)  # unsupported ones fail at load
    decoder = text_config(text, name=name)
    return dataclasses.replace(decoder, architecture="LlavaForConditionalGeneration", vision=vision)


class LlavaMultiModalProjector(nn.Module):
    """linear_1 -> activation -> linear_2: vision features [.., D_vision] -> decoder embeddings [.., H]."""

    def __init__(self, vision: VisionConfig, hidden_size: int, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision.hidden_size, hidden_size, bias=vision.projector_bias, dtype=dtype,
                                  device=device)
        self.act = activation(vision.projector_hidden_act)
        self.linear_2 = nn.Linear(hidden_size, hidden_size, bias=vision.projector_bias, dtype=dtype, device=device)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """`LlamaForCausalLM` plus `encode_mm_inputs` (module docstring)."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, *, dtype: torch.dtype, device,
                 tp: TPComm | None = None, pp_rank: int = 0, pp_size: int = 1,
                 kernel: KernelConfig | None = None) -> None:
        if not isinstance(config.vision, VisionConfig):
            raise ValueError(f"{config.name!r}: LlavaForConditionalGeneration needs a CLIP vision config")
        super().__init__(config, attn_backend, dtype=dtype, device=device, tp=tp, pp_rank=pp_rank, pp_size=pp_size,
                         kernel=kernel)
        self.vision: VisionConfig = config.vision
        self.vision_tower = CLIPVisionTower(config.vision, dtype=dtype, device=device)
        self.multi_modal_projector = LlavaMultiModalProjector(config.vision, config.hidden_size, dtype=dtype,
                                                              device=device)

    @torch.no_grad()
    def encode_mm_inputs(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """One image batch -> each image's decoder embeddings [num_image_tokens, hidden]."""
        device = self.vision_tower.pre_layrnorm.weight.device
        pixels = torch.stack([x["pixel_values"] for x in inputs]).to(device)  # [N, C, S, S]
        features = self.vision_tower(pixels)  # [N, 1 + P, D]
        if self.vision.vision_feature_select_strategy == "default":
            features = features[:, 1:]  # the class token is not an image token
        return list(self.multi_modal_projector(features).unbind(0))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(renamed_weights(weights, _RENAMES))

    def _weight_targets(self) -> tuple[dict[str, _WeightTarget], dict[str, _WeightTarget]]:
        targets, alternates = super()._weight_targets()
        for prefix, module in (("vision_tower.", self.vision_tower), ("multi_modal_projector.",
                                                                       self.multi_modal_projector)):
            for n, p in module.named_parameters():
                targets[prefix + n] = _WeightTarget(tuple(p.shape), p.copy_)
        return targets, alternates

    def checkpoint_names(self) -> set[str]:
        """Every tensor name a LLaVA checkpoint may hold, in either layout."""
        targets, alternates = self._weight_targets()
        return names_in_every_layout(set(targets) | set(alternates), _RENAMES)
