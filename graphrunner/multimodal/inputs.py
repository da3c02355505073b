"""InputProcessor: the engine's side of prompt embeddings and images (vLLM's input processing).

    {"prompt_embeds": tensor [L, hidden]}                       -> L placeholder ids + the embeddings
    {"prompt": text, "multi_modal_data": {"image": img | [img, ...]}}
    {"prompt_token_ids": ids, "multi_modal_data": {"image": ...}}

Each image must have one image placeholder token in the prompt (LLaVA's `<image>`, the config's
`image_token_id`); the processor expands it to the image's `num_image_tokens` placeholders (a prompt
already expanded is taken as it is), preprocesses the pixels with the checkpoint's processor config
and hashes them. A bad input raises ValueError naming the prompt, the value and the limit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

from graphrunner.config import ModelConfig
from graphrunner.engine.request import RequestExtras
from graphrunner.multimodal.features import MultiModalFeatureSpec, PlaceholderRange

# The id a prompt-embeddings prompt's positions hold (the runner reads their embeddings instead).
EMBEDS_PLACEHOLDER_ID = 0


def content_hash(tensor: torch.Tensor) -> str:
    """A hex digest of a tensor's shape, dtype and bytes: equal content, equal hash."""
    t = tensor.detach().cpu().contiguous()
    h = hashlib.sha256(f"{tuple(t.shape)}|{t.dtype}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class InputProcessor:
    """Turns prompt dicts with prompt embeddings or images into token ids and `RequestExtras`."""

    def __init__(self, model_config: ModelConfig, model: str) -> None:
        self.model_config = model_config
        self.image_processor = None
        if model_config.vision is not None:
            from graphrunner.multimodal.processor import ImageProcessor

            self.image_processor = ImageProcessor.from_folder(model, model_config.vision.image_size)

    def __call__(self, i: int, prompt: Mapping, token_ids: list[int]) -> tuple[list[int], RequestExtras]:
        if "prompt_embeds" in prompt:
            return self._prompt_embeds(i, prompt["prompt_embeds"])
        return self._images(i, prompt["multi_modal_data"], token_ids)

    def _prompt_embeds(self, i: int, embeds: Any) -> tuple[list[int], RequestExtras]:
        mc = self.model_config
        if not mc.enable_prompt_embeds:
            raise ValueError(f"prompt {i}: prompt_embeds needs LLM(..., enable_prompt_embeds=True)")
        if isinstance(embeds, torch.Tensor) and embeds.dim() == 3 and embeds.shape[0] == 1:
            embeds = embeds[0]
        if (not isinstance(embeds, torch.Tensor) or embeds.dim() != 2 or embeds.shape[1] != mc.hidden_size
                or embeds.shape[0] < 1 or not embeds.dtype.is_floating_point):
            got = f"shape {tuple(embeds.shape)} {embeds.dtype}" if isinstance(embeds, torch.Tensor) else \
                type(embeds).__name__
            raise ValueError(f"prompt {i}: prompt_embeds must be a float tensor [length >= 1, hidden_size="
                             f"{mc.hidden_size}], got {got}")
        embeds = embeds.detach().cpu().contiguous()
        extras = RequestExtras(prompt_embeds=embeds, embeds_hash=content_hash(embeds))
        return [EMBEDS_PLACEHOLDER_ID] * embeds.shape[0], extras

    def _images(self, i: int, data: Any, token_ids: list[int]) -> tuple[list[int], RequestExtras]:
        vision = self.model_config.vision
        if not isinstance(data, Mapping):
            raise ValueError(f"prompt {i}: multi_modal_data must be a dict such as {{'image': image}}, "
                             f"got {type(data).__name__}")
        unknown = sorted(set(data) - {"image"})
        if vision is None or self.image_processor is None:
            raise ValueError(f"prompt {i}: multi_modal_data {sorted(data)} given, but model "
                             f"{self.model_config.name!r} ({self.model_config.architecture}) is text-only")
        if unknown:
            raise ValueError(f"prompt {i}: multi_modal_data keys {unknown} are not supported; allowed: ['image']")
        images = data["image"]
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        token, n = vision.image_token_id, vision.num_image_tokens
        ids, ranges = expand_placeholders(i, token_ids, token, n, len(images))
        features = []
        for image, pos in zip(images, ranges, strict=True):
            pixels = self.image_processor(image)
            features.append(MultiModalFeatureSpec({"pixel_values": pixels}, "image", content_hash(pixels), pos))
        return ids, RequestExtras(mm_features=tuple(features))


def expand_placeholders(i: int, token_ids: list[int], token: int, per_image: int,
                        num_images: int) -> tuple[list[int], list[PlaceholderRange]]:
    """(token ids with each image placeholder expanded to `per_image` copies, each image's range).

    One placeholder per image is expanded; runs of exactly `per_image` placeholders (an expanded
    prompt) are kept. ValueError naming the counts when images and placeholders do not match."""
    positions = [p for p, t in enumerate(token_ids) if t == token]
    runs: list[tuple[int, int]] = []  # (start, length)
    for p in positions:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    expanded = all(length == per_image for _, length in runs)
    singles = all(length == 1 for _, length in runs)
    if len(runs) != num_images or not (expanded or singles):
        raise ValueError(f"prompt {i}: {num_images} image(s) given for {len(runs)} image placeholder(s) (token id "
                         f"{token}); each image needs one placeholder, or a run of {per_image}")
    out: list[int] = []
    ranges: list[PlaceholderRange] = []
    last = 0
    for start, length in runs:
        out.extend(token_ids[last:start])
        ranges.append(PlaceholderRange(len(out), per_image))
        out.extend([token] * per_image)
        last = start + length
    out.extend(token_ids[last:])
    return out, ranges
