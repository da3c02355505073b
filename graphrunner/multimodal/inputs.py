"""InputProcessor: the engine's side of prompt embeddings and images (vLLM's input processing).

    {"prompt_embeds": tensor [L, hidden]}                       -> L placeholder ids + the embeddings
    {"prompt": text, "multi_modal_data": {"image": img | [img, ...]}}
    {"prompt_token_ids": ids, "multi_modal_data": {"image": ...}}

Each image must have one image placeholder token in the prompt (LLaVA's `<image>`, Qwen2.5-VL's
`<|image_pad|>`: the config's `image_token_id`); the processor expands it to the image's placeholder
count (LLaVA: `num_image_tokens`; Qwen2.5-VL: its resized grid's patches / merge²; a prompt already
expanded is taken as it is), preprocesses the pixels with the checkpoint's processor config
and hashes them. A bad input raises ValueError naming the prompt, the value and the limit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from graphrunner.config import ModelConfig, Qwen2_5_VisionConfig
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
        self.image_processor: Any = None
        vision = model_config.vision
        if isinstance(vision, Qwen2_5_VisionConfig):
            from graphrunner.multimodal.qwen2_vl_processor import Qwen2VLImageProcessor

            self.image_processor = Qwen2VLImageProcessor.from_folder(model, vision)
        elif vision is not None:
            from graphrunner.multimodal.processor import ImageProcessor

            self.image_processor = ImageProcessor.from_folder(model, vision.image_size)

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
        encoder_inputs = [self._encoder_input(image) for image in images]  # (data, tokens, hash) each
        ids, ranges = expand_placeholders(i, token_ids, vision.image_token_id, [n for _, n, _ in encoder_inputs],
                                          len(images))
        features = tuple(MultiModalFeatureSpec(data, "image", h, pos)
                         for (data, _, h), pos in zip(encoder_inputs, ranges, strict=True))
        return ids, RequestExtras(mm_features=features)

    def _encoder_input(self, image: Any) -> tuple[dict[str, torch.Tensor], int, str]:
        """(what the encoder reads, the image's placeholder count, its content hash)."""
        vision = self.model_config.vision
        assert vision is not None and self.image_processor is not None
        out = self.image_processor(image)
        if isinstance(out, torch.Tensor):  # CLIP: [3, S, S] pixels, a fixed count per image
            return {"pixel_values": out}, vision.num_image_tokens, content_hash(out)
        # Qwen2-VL: patches and their grid; two grids may hold the same patches, so both key the image.
        grid = out["image_grid_thw"]
        digest = hashlib.sha256((content_hash(out["pixel_values"]) + str(grid.tolist())).encode()).hexdigest()
        return out, self.image_processor.num_tokens(grid), digest


def expand_placeholders(i: int, token_ids: list[int], token: int, per_image: int | Sequence[int],
                        num_images: int) -> tuple[list[int], list[PlaceholderRange]]:
    """(token ids with each image placeholder expanded to its image's count of copies, each image's range).

    `per_image`: one count for every image (LLaVA) or each image's own (Qwen2-VL: its grid's). One
    placeholder per image is expanded; runs of exactly the image's count (an expanded prompt) are kept.
    ValueError naming the counts when images and placeholders do not match."""
    counts = [per_image] * num_images if isinstance(per_image, int) else list(per_image)
    positions = [p for p, t in enumerate(token_ids) if t == token]
    runs: list[tuple[int, int]] = []  # (start, length)
    for p in positions:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    expanded = len(runs) == len(counts) and all(length == n for (_, length), n in zip(runs, counts, strict=True))
    singles = all(length == 1 for _, length in runs)
    if len(runs) != num_images or not (expanded or singles):
        run = counts[0] if len(set(counts)) == 1 else f"its image's count {counts}"
        raise ValueError(f"prompt {i}: {num_images} image(s) given for {len(runs)} image placeholder(s) (token id "
                         f"{token}); each image needs one placeholder, or a run of {run}")
    out: list[int] = []
    ranges: list[PlaceholderRange] = []
    last = 0
    for (start, length), n in zip(runs, counts, strict=True):
        out.extend(token_ids[last:start])
        ranges.append(PlaceholderRange(len(out), n))
        out.extend([token] * n)
        last = start + length
    out.extend(token_ids[last:])
    return out, ranges
