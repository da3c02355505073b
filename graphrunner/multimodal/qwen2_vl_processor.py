"""Qwen2-VL / Qwen2.5-VL image preprocessing from the checkpoint's own `preprocessor_config.json`.

convert to RGB -> resize to the nearest size whose sides are multiples of patch_size x merge_size and
whose area lies in [min_pixels, max_pixels], keeping the aspect ratio (`smart_resize`; PIL, the
config's resample) -> rescale (1/255) -> normalize (mean / std) -> patches: the steps and order of
transformers' `Qwen2VLImageProcessor`. Patches are rows of C x temporal_patch_size x patch_size² values
(a still image repeats its one frame temporal_patch_size times), laid out merge block by merge block,
row-major, so that the vision tower's merger finds each block's patches in consecutive rows. An image
of grid (1, h, w) patches takes h·w / merge² placeholder tokens. Nothing is downloaded: a folder
without the file uses Qwen2-VL's defaults.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from graphrunner.config import Qwen2_5_VisionConfig
from graphrunner.multimodal.processor import (
    _CLIP_MEAN,
    _CLIP_STD,
    CONFIG_FILE,
    rescale_normalize,
    to_pil_image,
    value_options,
)

_MAX_ASPECT_RATIO = 200
# Qwen2-VL's processor defaults: 56² to 28² · 1280 pixels per image (Qwen2.5-VL's folders raise the top).
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280


def image_pixel_limits(folder: str | Path) -> tuple[int, int]:
    """(min_pixels, max_pixels) of a folder's `preprocessor_config.json` (`size.shortest_edge` /
    `size.longest_edge`, or the older `min_pixels` / `max_pixels`); Qwen2-VL's defaults without one."""
    path = Path(folder) / "preprocessor_config.json"
    if not path.is_file():
        return DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e.msg} at line {e.lineno}") from e
    size = raw.get("size") if isinstance(raw.get("size"), dict) else {}
    low = raw.get("min_pixels", size.get("shortest_edge", DEFAULT_MIN_PIXELS))
    high = raw.get("max_pixels", size.get("longest_edge", DEFAULT_MAX_PIXELS))
    for key, value in (("min_pixels", low), ("max_pixels", high)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{str(path)!r}: {key}={value!r} must be an int >= 1")
    if low > high:
        raise ValueError(f"{str(path)!r}: min_pixels={low} exceeds max_pixels={high}")
    return low, high


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width), multiples of `factor`, area within [min_pixels, max_pixels], close to the input's
    aspect ratio (transformers' rule). ValueError for an image more than 200 times longer than wide."""
    if max(height, width) / min(height, width) > _MAX_ASPECT_RATIO:
        raise ValueError(f"an image of {width} x {height} pixels: its aspect ratio must be below {_MAX_ASPECT_RATIO}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor)
                                                                               * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True)
class Qwen2VLImageProcessor:
    """The preprocessing of one checkpoint (module docstring); `__call__` takes what LLaVA's processor
    takes and returns {"pixel_values": [t·h·w, C·T·P²] float32, "image_grid_thw": [3] int64}."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    resample: int = 3  # PIL.Image.BICUBIC
    rescale_factor: float | None = 1 / 255
    mean: tuple[float, ...] | None = _CLIP_MEAN
    std: tuple[float, ...] | None = _CLIP_STD

    @classmethod
    def from_folder(cls, folder: str | Path, vision: Qwen2_5_VisionConfig) -> Qwen2VLImageProcessor:
        low, high = image_pixel_limits(folder)
        geometry: dict[str, Any] = dict(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                        merge_size=vision.spatial_merge_size, min_pixels=low, max_pixels=high)
        path = Path(folder) / CONFIG_FILE
        if not path.is_file():
            return cls(**geometry)
        raw = json.loads(path.read_text())  # image_pixel_limits has parsed it already
        for key, ours in (("patch_size", vision.patch_size), ("temporal_patch_size", vision.temporal_patch_size),
                          ("merge_size", vision.spatial_merge_size)):
            if raw.get(key, ours) != ours:
                raise ValueError(f"{str(path)!r}: {key}={raw[key]!r} differs from the vision tower's {ours}")
        return cls(**geometry, **value_options(raw))

    def __call__(self, image: Any) -> dict[str, torch.Tensor]:
        pil = to_pil_image(image)
        w, h = pil.size
        cell = self.patch_size * self.merge_size
        rh, rw = smart_resize(h, w, cell, self.min_pixels, self.max_pixels)
        if (rh, rw) != (h, w):
            pil = pil.resize((rw, rh), resample=self.resample)
        values = rescale_normalize(np.asarray(pil, dtype=np.uint8), self.rescale_factor, self.mean, self.std)
        return {"pixel_values": torch.from_numpy(self.patchify(values.transpose(2, 0, 1))),
                "image_grid_thw": torch.tensor([1, rh // self.patch_size, rw // self.patch_size])}

    def patchify(self, chw: np.ndarray) -> np.ndarray:
        """[C, H, W] -> [h·w, C·T·P²]: patches merge block by merge block (module docstring)."""
        c, height, width = chw.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = height // p, width // p
        x = chw.reshape(c, gh // m, m, p, gw // m, m, p)
        x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # [blocks_h, blocks_w, m, m, C, P, P]
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))  # the frame repeated T times
        return np.ascontiguousarray(x.reshape(gh * gw, c * t * p * p))

    def num_tokens(self, grid_thw: torch.Tensor) -> int:
        """Placeholder tokens of an image of grid (t, h, w) patches."""
        t, h, w = (int(g) for g in grid_thw.tolist())
        return t * h * w // self.merge_size ** 2
