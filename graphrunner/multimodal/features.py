"""What a request carries of its multimodal inputs (vLLM's `MultiModalFeatureSpec`): plain data.

A prompt with an image holds, at the image's place, a run of placeholder tokens (`mm_position`);
the runner replaces their embeddings with the image's encoder output (`data` is what the encoder
reads: pixel values). `identifier` is the input's content hash: the runner's encoder cache and the
engine's prefix cache key the input by it, so one image in many requests is encoded once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PlaceholderRange:
    """The prompt positions [offset, offset + length) an input's embeddings fill (vLLM's name)."""

    offset: int
    length: int

    def __post_init__(self) -> None:
        for name in ("offset", "length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "offset" else 1):
                raise ValueError(f"PlaceholderRange.{name}={value!r} must be an int >= {0 if name == 'offset' else 1}")

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, eq=False)
class MultiModalFeatureSpec:
    """One multimodal input of a request: `data` (e.g. {"pixel_values": [3, H, W] tensor}), its
    `modality` ("image"), its content hash `identifier` and its placeholder positions."""

    data: Any
    modality: str
    identifier: str
    mm_position: PlaceholderRange
