"""Decode context parallelism in attention: each rank holds a shard of every sequence's KV.

A DCP group is D consecutive ranks of a TP group. They compute the same K/V heads (the
K/V projection is sharded over the T / D groups, `QKVLinear.kv_tp_size`), and each keeps
only its interleaved share of every sequence in its KV cache (graphrunner.kernels.dcp: run
`p // I` of positions goes to rank `(p // I) % D`), so the group holds D times the tokens of
one rank. Their query heads differ (TP shards them as usual). One layer's attention:

1. KV write: the step's slot mapping (`dcp_slot_mapping`) gives -1 to tokens another rank
   owns, so each rank writes only its share.
2. The D ranks' query heads are all-gathered: every rank attends all the group's heads
   ([T, D * H_local]) over its own keys, masking each key by its global position
   (`dcp=` of the paged backends), with the log-sum-exp of every row.
3. The partial outputs and LSEs are all-gathered (one collective, the LSE bit-cast into the
   output's dtype); each rank merges the D partial results of its own heads exactly
   (`merge_attention_states`) into `out`.

Everything is device work without host syncs, inside the attention op: it runs eagerly
between PIECEWISE pieces and is captured (NCCL included) in FULL graphs. Both gathers move
D times more than an all-to-all would; at decode sizes that is a few KiB per layer.
"""

from __future__ import annotations

from typing import Any

import torch

from graphrunner.attention.base import AttentionMetadata
from graphrunner.attention.kv_write import write_kv
from graphrunner.attention.merge import merge_attention_states


class DCPAttentionBackend:
    """Wraps a paged backend (its `attend` with `dcp=`) for one rank of a DCP group."""

    def __init__(self, inner: Any, group_name: str, size: int, rank: int, interleave: int) -> None:
        if size < 2 or not 0 <= rank < size:
            raise ValueError(f"DCP rank {rank} of size {size}: needs size >= 2 and 0 <= rank < size")
        self.inner = inner
        self.name = inner.name
        self.cudagraph_support = getattr(inner, "cudagraph_support", None)
        self.group_name, self.size, self.rank, self.interleave = group_name, size, rank, interleave

    @property
    def layout(self) -> tuple[int, int, int]:
        """(size, rank, interleave): the `dcp=` argument of the paged kernels."""
        return self.size, self.rank, self.interleave

    def forward(
        self,
        q: torch.Tensor,  # [T, H_local, D]
        k: torch.Tensor,  # [T, Hkv, D]: the group's K/V heads, identical on its ranks
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]: this rank's share of the tokens
        metadata: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,  # [T, H_local, D]
        kv_scale: torch.Tensor | None = None,  # [2] fp32 (k_scale, v_scale) of an fp8 cache
    ) -> torch.Tensor:
        """Write this rank's share of k/v, attend the group's heads over it, merge this rank's heads."""
        T, H, Dh = q.shape
        D, r = self.size, self.rank
        write_kv(k, v, kv_cache, metadata.slot_mapping[: metadata.num_tokens], kv_scale)
        gather = torch.ops.graphrunner.tp_all_gather
        q_all = gather(q, D, self.group_name).permute(1, 0, 2, 3).reshape(T, D * H, Dh)  # the group's heads
        part = torch.empty_like(q_all)  # [T, D*H, Dh]
        lse = torch.empty(T, D * H, dtype=torch.float32, device=q.device)  # [T, D*H]
        self.inner.attend(q_all, kv_cache, metadata, scale, part, lse, dcp=self.layout, kv_scale=kv_scale)
        # One collective for both: the fp32 LSE travels bit-cast to the output's dtype.
        packed = torch.cat([part.reshape(T, -1), lse.view(part.dtype).reshape(T, -1)], dim=1)
        got = gather(packed, D, self.group_name)  # [D, T, D*H*Dh + D*H*(4 / element size)]
        n_out = D * H * Dh
        outs = got[:, :, :n_out].reshape(D, T, D, H, Dh)[:, :, r]  # [D shards, T, H, Dh]: this rank's heads
        lses = got[:, :, n_out:].contiguous().view(torch.float32).reshape(D, T, D, H)[:, :, r]  # [D, T, H]
        if out is None:
            out = torch.empty_like(q)
        merge_attention_states(outs.contiguous(), lses.contiguous(), out)
        return out


def wrap_for_dcp(backend: Any, groups: Any) -> Any:
    """`backend` as this rank's DCP backend when its DCP group has > 1 rank; else unchanged."""
    dcp = groups.dcp
    if dcp is None or dcp.world_size == 1:
        return backend
    return DCPAttentionBackend(backend, dcp.device_group_name, dcp.world_size, dcp.rank_in_group,
                               groups.config.cp_kv_cache_interleave_size)


__all__ = ["DCPAttentionBackend", "wrap_for_dcp"]
