"""Image preprocessing from the checkpoint's own `preprocessor_config.json` (CLIP's pipeline).

convert to RGB -> resize (shortest edge, or height x width; PIL, the config's resample) -> center
crop -> rescale (1/255) -> normalize (mean / std) -> [channels, height, width] float32, the steps
and order of transformers' `CLIPImageProcessor`, which LLaVA checkpoints name. Nothing is
downloaded: a folder without the file uses CLIP's defaults at the vision tower's image size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

CONFIG_FILE = "preprocessor_config.json"
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageProcessor:
    """The preprocessing of one checkpoint (module docstring); `__call__` takes a PIL image, a
    [C, H, W] / [H, W, C] tensor or array (uint8, or float in [0, 1])."""

    shortest_edge: int | None
    resize_hw: tuple[int, int] | None
    crop_hw: tuple[int, int] | None
    resample: int = 3  # PIL.Image.BICUBIC
    rescale_factor: float | None = 1 / 255
    mean: tuple[float, ...] | None = _CLIP_MEAN
    std: tuple[float, ...] | None = _CLIP_STD

    @classmethod
    def from_folder(cls, folder: str | Path, image_size: int) -> ImageProcessor:
        path = Path(folder) / CONFIG_FILE
        if not path.is_file():
            return cls(shortest_edge=image_size, resize_hw=None, crop_hw=(image_size, image_size))
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{str(path)!r} is not valid JSON: {e.msg} at line {e.lineno}") from e
        size = raw.get("size") if raw.get("do_resize", True) else None
        shortest = resize_hw = None
        if isinstance(size, dict) and "shortest_edge" in size:
            shortest = int(size["shortest_edge"])
        elif isinstance(size, dict):
            resize_hw = (int(size["height"]), int(size["width"]))
        elif isinstance(size, int):
            shortest = size
        crop = raw.get("crop_size") if raw.get("do_center_crop", True) else None
        crop_hw = None
        if isinstance(crop, dict):
            crop_hw = (int(crop["height"]), int(crop["width"]))
        elif isinstance(crop, int):
            crop_hw = (crop, crop)
        return cls(shortest_edge=shortest, resize_hw=resize_hw, crop_hw=crop_hw, **value_options(raw))

    def __call__(self, image: Any) -> torch.Tensor:  # -> [3, H, W] float32
        pil = to_pil_image(image)
        if self.shortest_edge is not None:
            w, h = pil.size
            short, long = (w, h) if w <= h else (h, w)
            new_long = int(self.shortest_edge * long / short)
            size = (self.shortest_edge, new_long) if w <= h else (new_long, self.shortest_edge)
            pil = pil.resize(size, resample=self.resample)
        elif self.resize_hw is not None:
            pil = pil.resize((self.resize_hw[1], self.resize_hw[0]), resample=self.resample)
        pixels = np.asarray(pil, dtype=np.uint8)  # [H, W, 3]
        if self.crop_hw is not None:
            pixels = _center_crop(pixels, *self.crop_hw)
        values = rescale_normalize(pixels, self.rescale_factor, self.mean, self.std)
        return torch.from_numpy(np.ascontiguousarray(values.transpose(2, 0, 1)))


def value_options(raw: dict[str, Any]) -> dict[str, Any]:
    """The pixel-value steps of a preprocessor_config.json (resample, rescale, normalize), as the
    processors' fields; a step the config turns off is None."""
    normalize = raw.get("do_normalize", True)
    return dict(resample=int(raw.get("resample", 3)),
                rescale_factor=float(raw.get("rescale_factor", 1 / 255)) if raw.get("do_rescale", True) else None,
                mean=tuple(raw.get("image_mean", _CLIP_MEAN)) if normalize else None,
                std=tuple(raw.get("image_std", _CLIP_STD)) if normalize else None)


def rescale_normalize(pixels: np.ndarray, rescale_factor: float | None, mean: tuple[float, ...] | None,
                      std: tuple[float, ...] | None) -> np.ndarray:
    """uint8 [H, W, C] -> float32 values: times `rescale_factor`, then (x - mean) / std, each when set."""
    values = pixels.astype(np.float32)
    if rescale_factor is not None:
        values *= np.float32(rescale_factor)
    if mean is not None and std is not None:
        values -= np.asarray(mean, dtype=np.float32)
        values /= np.asarray(std, dtype=np.float32)
    return values


def to_pil_image(image: Any) -> Any:
    """A PIL RGB image from a PIL image, or a [C, H, W] / [H, W, C] tensor or array (uint8, or float
    in [0, 1]); TypeError / ValueError naming what was given otherwise."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu().numpy()
    if not isinstance(image, np.ndarray):
        raise TypeError(f"an image must be a PIL image, a tensor or an array, got {type(image).__name__}")
    if image.ndim != 3 or 3 not in (image.shape[0], image.shape[-1]):
        raise ValueError(f"an image tensor must be [3, H, W] or [H, W, 3], got shape {tuple(image.shape)}")
    if image.shape[0] == 3 and image.shape[-1] != 3:
        image = image.transpose(1, 2, 0)
    if image.dtype != np.uint8:
        image = (np.clip(image.astype(np.float32), 0.0, 1.0) * 255.0).round().astype(np.uint8)
    return Image.fromarray(np.ascontiguousarray(image), mode="RGB")


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' center crop: pad with zeros where the image is smaller, then cut the middle."""
    h, w = pixels.shape[:2]
    if h < height or w < width:
        top_pad, left_pad = max(0, (height - h) // 2), max(0, (width - w) // 2)
        padded = np.zeros((max(h, height), max(w, width), pixels.shape[2]), dtype=pixels.dtype)
        padded[top_pad : top_pad + h, left_pad : left_pad + w] = pixels
        pixels, h, w = padded, padded.shape[0], padded.shape[1]
    top, left = int((h - height) / 2), int((w - width) / 2)
    return pixels[top : top + height, left : left + width]
