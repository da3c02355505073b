"""KVCacheShape: one rank's share of the paged KV cache of one model (no dependencies, so
that both the cache sizing in `graphrunner.kv_cache` and the draft model can use it)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

KV_LAYOUTS = ("NHD", "HND")
# GRAPHRUNNER_KV_LAYOUT (read once at import): how each layer's cache is stored. Every layout is handed out
# as a [2, num_blocks, block_size, kv_heads, head_dim] tensor, and every kernel takes its strides, so only
# the memory order changes. "HND" (default): head-major, one KV head's tokens of a block are one contiguous
# run (the tensor is a permuted view). "NHD": token-major, a block's tokens each hold all their heads.
# On an H200, decode attention at 256 rows of qwen2.5-0.5b took 42.6 µs head-major against 43.7 token-major;
# batch 1 and 64 were equal. The whole qwen2.5-0.5b step at batch 256 on an H100, interleaved: 2.564 / 2.581 ms
# head-major against 2.601 / 2.651 token-major.
KV_LAYOUT = os.environ.get("GRAPHRUNNER_KV_LAYOUT", "HND").upper()


@dataclass(frozen=True)
class KVCacheShape:
    """One rank's share of the cache: its layers, its KV heads, the block geometry."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    layout: str | None = None  # one of KV_LAYOUTS; None: KV_LAYOUT at allocation

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every local layer (K and V)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def allocate(self, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
        """One [2, num_blocks, block_size, kv_heads, head_dim] tensor per local layer (zeros), stored in
        `layout`'s memory order."""
        layout = (self.layout or KV_LAYOUT).upper()
        if layout not in KV_LAYOUTS:
            raise ValueError(f"KV cache layout {layout!r} (GRAPHRUNNER_KV_LAYOUT) must be one of {KV_LAYOUTS}")
        if layout == "NHD":
            shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
            return [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(self.num_layers)]
        stored = (2, num_blocks, self.num_kv_heads, self.block_size, self.head_dim)
        return [torch.zeros(stored, dtype=self.dtype, device=device).permute(0, 1, 3, 2, 4)
                for _ in range(self.num_layers)]


__all__ = ["KV_LAYOUT", "KV_LAYOUTS", "KVCacheShape"]
