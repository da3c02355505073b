"""Attention as one opaque custom op, so that torch.compile can split the model around it.

Under PIECEWISE graphs the model is compiled with `capture.piecewise`, which cuts the
FX graph at `graphrunner::unified_attention` and graphs the pieces in between. The op
itself runs eagerly between two pieces, with the real per-step metadata (real request
count, host-side bounds), which a captured graph could not carry.

The op takes only tensors and static numbers. Everything per-step (the metadata, the
KV caches, the backend) comes from a *forward context* set around the model call:

    with forward_context(batch.attn_metadata, kv_caches, backend):
        hidden = compiled_model(input_ids, positions, kv_caches, batch.attn_metadata)

Keeping the metadata out of the op's arguments keeps it out of the compiled graph: its
host ints (num_reqs, max_seq_len, ...) change every step and would otherwise become
guards and recompiles. `out` is allocated by the model just before the call (inside the
preceding compiled piece), so under CUDA graphs its address is the captured piece's
static output: the piece after the op reads the address the op wrote.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from graphrunner.attention.base import AttentionBackend, AttentionMetadata, rope_attention

OP_NAME = "graphrunner::unified_attention"


@dataclass(frozen=True)
class ForwardContext:
    """What the attention op needs for one model call, besides its tensor arguments."""

    metadata: AttentionMetadata
    kv_caches: Sequence[torch.Tensor]  # one per layer: [2, num_blocks, block_size, Hkv, D]
    backend: AttentionBackend


# Why this one piece of scoped state exists: a custom op called from compiled code can
# receive only tensors and plain numbers, so the per-step metadata, the KV caches and
# the backend reach it through this slot. It is set only inside `forward_context` (which
# refuses nesting and always clears it), and it is thread-local so that two runners
# stepping on two threads cannot see each other's batch.
_slot = threading.local()


@contextmanager
def forward_context(
    metadata: AttentionMetadata, kv_caches: Sequence[torch.Tensor], backend: AttentionBackend
) -> Iterator[ForwardContext]:
    """Make `metadata`, `kv_caches` and `backend` visible to the attention op for one call.

    Raises RuntimeError if a context is already active on this thread (a nested model
    call would silently attend with the outer batch's metadata).
    """
    if getattr(_slot, "context", None) is not None:
        raise RuntimeError("nested forward_context is not allowed: one model call at a time per thread")
    ctx = ForwardContext(metadata, kv_caches, backend)
    _slot.context = ctx
    try:
        yield ctx
    finally:
        _slot.context = None


def current_forward_context() -> ForwardContext:
    """The active context; RuntimeError naming the fix when there is none."""
    ctx = getattr(_slot, "context", None)
    if ctx is None:
        raise RuntimeError(
            f"{OP_NAME} called outside forward_context(metadata, kv_caches, backend); "
            "wrap the model call in graphrunner.attention.op.forward_context"
        )
    return ctx


@torch.library.custom_op(OP_NAME, mutates_args=("out",))
def unified_attention(
    q: torch.Tensor,  # [T, H, D], not yet rotated; any strides
    k: torch.Tensor,  # [T, Hkv, D], not yet rotated; any strides
    v: torch.Tensor,  # [T, Hkv, D], any strides
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, D] float32: the rotary table
    out: torch.Tensor,  # [T, H, D], written in place
    layer_index: int,
    scale: float,
    kv_scale: torch.Tensor | None = None,  # [2] fp32 (k_scale, v_scale): the layer's, read by an fp8 cache
) -> None:
    """Rotate q/k, write layer `layer_index`'s k/v into its cache and attend, into `out` (eager).

    The rotary embedding lives inside the op so that the backend can fuse it with the KV
    write and attention (`graphrunner.attention.base.rope_attention`). `kv_scale` is an argument
    (a persistent buffer of the layer, like the rotary table), not context: its address is what a
    captured graph reads.
    """
    ctx = current_forward_context()
    if not 0 <= layer_index < len(ctx.kv_caches):
        raise IndexError(f"layer_index={layer_index} is out of range for {len(ctx.kv_caches)} kv caches")
    # The KV cache is mutated too, but it is not an argument: compiled code never sees it.
    rope_attention(ctx.backend)(q, k, v, positions, cos_sin_cache, ctx.kv_caches[layer_index], ctx.metadata, scale,
                                out=out, kv_scale=kv_scale)


@unified_attention.register_fake
def _unified_attention_fake(q, k, v, positions, cos_sin_cache, out, layer_index, scale, kv_scale=None) -> None:
    # Nothing to describe: the op returns nothing and `out` keeps its shape and strides.
    return None


__all__ = ["OP_NAME", "ForwardContext", "current_forward_context", "forward_context", "unified_attention"]
