"""The one interface every attention backend implements, and the metadata they share.

A backend receives the projected q/k/v of a padded token batch, writes k/v into the
paged KV cache at `slot_mapping` (skipping slot -1), and attends each query token to
its request's cached context (causal within the request). Every field of
`AttentionMetadata` is a view of a persistent runner buffer, so the same metadata
object is valid inside a captured graph.

KV cache layout, per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 = keys, 1 = values), stored head-major (graphrunner.kv_shape); every kernel takes
the strides.

A layer calls its backend once, with q and k not yet rotated: `rope_attention(backend)`,
looked up when the layer is built, is the backend's own `rope_attend` (which may fold the
rotary embedding and the KV write into its kernels), or for a backend that implements only
`forward`, the torch rotation followed by `forward`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class AttentionMetadata:
    """Batch layout for attention. Padded requests have query length 0 and seq_len 0;
    padded tokens (index >= query_start_loc[num_reqs]) have slot -1."""

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, non-decreasing; tail = real token count
    seq_lens: torch.Tensor  # [num_reqs] int32: context + query length; 0 for padded requests
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32: physical block ids
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each token's k/v; -1 = skip
    num_reqs: int  # rows of the batch (padded count under FULL graphs)
    num_tokens: int  # tokens of the batch (padded count under graphs)
    max_query_len: int  # host-side upper bound on any query length in the batch
    max_seq_len: int  # host-side upper bound on any seq_len in the batch
    # Prefill context parallelism: k/v are all-gathered over the PCP group and written at
    # `kv_gather.slot_mapping` (graphrunner.distributed.pcp_step.KVAllGather); None otherwise.
    kv_gather: Any = None


class AttentionBackend(Protocol):
    """What the model calls once per layer."""

    name: str

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim], written in place if given
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; rows of padded tokens are unspecified
        """Write k/v into `kv_cache`, attend. A backend serving fp8 caches also takes `kv_scale=`, the
        layer's [2] fp32 (k_scale, v_scale) (graphrunner.attention.torch_ref, "fp8 KV cache")."""
        ...


# (q, k, v, positions, cos_sin, kv_cache, metadata, scale, out=None, kv_scale=None)
RopeAttend = Callable[..., torch.Tensor]


def rotate_torch(
    positions: torch.Tensor,  # [T] int64
    x: torch.Tensor,  # [T, heads, D]
    cos_sin: torch.Tensor,  # [max_positions, D] float32: cos | sin
) -> torch.Tensor:  # [T, heads, D], contiguous, x's dtype
    """Neox rotation of `x` by position, computed as the fused kernel does (fp32, one rounding)."""
    cos, sin = cos_sin.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
    cos, sin = cos.to(x.dtype).float(), sin.to(x.dtype).float()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope_attention(backend: Any) -> RopeAttend:
    """What a layer calls for the rotary embedding, the KV write and attention (module docstring).

    Arguments: q [T, H, D] and k [T, Hkv, D] not yet rotated, v [T, Hkv, D], positions [T] int64,
    cos_sin [max_positions, D] float32 (cos | sin), the layer's kv_cache, metadata, scale, an
    optional out [T, H, D] written in place and the layer's kv_scale ([2] fp32: k_scale, v_scale,
    read only by an fp8 cache); returns [T, H, D]."""
    rope_attend = getattr(backend, "rope_attend", None)
    if rope_attend is not None:
        return rope_attend
    def rotate_then_forward(q, k, v, positions, cos_sin, kv_cache, metadata, scale, out=None,
                            kv_scale=None) -> torch.Tensor:
        q, k = rotate_torch(positions, q, cos_sin), rotate_torch(positions, k, cos_sin)
        # Only an fp8 cache reads scales: a backend without fp8 support keeps its plain signature.
        extra = {"kv_scale": kv_scale} if kv_cache.dtype == torch.float8_e4m3fn else {}
        return backend.forward(q, k, v.contiguous(), kv_cache, metadata, scale, out=out, **extra)

    return rotate_then_forward
