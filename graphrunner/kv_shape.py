"""KVCacheShape: one rank's share of the paged KV cache of one model (no dependencies, so
that both the cache sizing in `graphrunner.kv_cache` and the draft model can use it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheShape:
    """One rank's share of the cache: its layers, its KV heads, the block geometry."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every local layer (K and V)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def allocate(self, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
        """One [2, num_blocks, block_size, kv_heads, head_dim] tensor per local layer."""
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(self.num_layers)]


__all__ = ["KVCacheShape"]
