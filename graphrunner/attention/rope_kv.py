"""Rotary embedding fused with the KV-cache write: one kernel per layer instead of five.

Before attention, a decoder layer rotates q and k by each token's position (Neox
style), makes v contiguous and writes k/v into the paged cache. Compiled as separate
ops that is five graph nodes per layer (the cos/sin gather, the q rotation, the k
rotation, the v copy, the KV write); at batch 1 each node costs more in launch and
drain than in memory traffic. `rope_write_kv_triton` does all of it in one
program per token: it gathers the token's cos/sin row, rotates every q head into a
fresh contiguous `q_rot`, and stores the rotated k and the (strided) v at the token's
cache slot, skipping slot -1 (padding) exactly as `write_kv` does.

Numerics: cos/sin are rounded to the activation dtype first (as Hugging Face does);
each rotated element is computed in fp32 and rounded once. That is what inductor's
fused rotary kernel computes too, so graphs with and without the fusion agree.

`rope_then_attend` is what the attention op calls: the fused kernel when the backend
writes through `write_kv` and the tensors are on CUDA, else the plain torch rotation
followed by the backend's own `forward` (CPU, prefill context parallelism whose k/v
are all-gathered before the write, decode context parallelism's own write).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from graphrunner.attention.base import AttentionMetadata
from graphrunner.attention.kv_write import check_kv_args, write_kv_torch
from graphrunner.kernels import HAS_TRITON, use_triton
from graphrunner.kernels.pdl import pdl_launch

# GRAPHRUNNER_ATTN_ROPE=0 keeps decode batches on the separate rotary + KV-write kernel (read once).
ATTN_ROPE = os.environ.get("GRAPHRUNNER_ATTN_ROPE", "1") != "0"

if HAS_TRITON:
    import triton
    import triton.language as tl

    from graphrunner.kernels.pdl import pdl_wait

    @triton.jit
    def _rope_write_kv_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, slot_ptr, q_out_ptr, cache_ptr,
        block_size,
        stride_qt, stride_qh, stride_qd,
        stride_kt, stride_kh, stride_kd,
        stride_vt, stride_vh, stride_vd,
        stride_cs,
        stride_c_kv, stride_c_blk, stride_c_off, stride_c_h, stride_c_d,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HALF: tl.constexpr,  # head_dim // 2
        H_PAD: tl.constexpr,
        HKV_PAD: tl.constexpr,
        HALF_PAD: tl.constexpr,
        GDC: tl.constexpr,  # launched with PDL (graphrunner.kernels.pdl): wait before the first access
    ):
        t = tl.program_id(0).to(tl.int64)
        pdl_wait(GDC)
        pos = tl.load(pos_ptr + t)
        j = tl.arange(0, HALF_PAD)
        j_ok = j < HALF
        ty = q_out_ptr.dtype.element_ty
        # cos | sin halves of the position's row, rounded to the activation dtype (as HF).
        cos = tl.load(cos_sin_ptr + pos * stride_cs + j, mask=j_ok).to(ty).to(tl.float32)[None, :]
        sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + j, mask=j_ok).to(ty).to(tl.float32)[None, :]

        h = tl.arange(0, H_PAD)[:, None]
        mask = (h < NUM_HEADS) & j_ok[None, :]
        src = q_ptr + t * stride_qt + h * stride_qh + j[None, :] * stride_qd
        x1 = tl.load(src, mask=mask).to(tl.float32)
        x2 = tl.load(src + HALF * stride_qd, mask=mask).to(tl.float32)
        dst = q_out_ptr + (t * NUM_HEADS + h) * (2 * HALF) + j[None, :]  # q_rot is contiguous [T, H, D]
        tl.store(dst, (x1 * cos - x2 * sin).to(ty), mask=mask)
        tl.store(dst + HALF, (x2 * cos + x1 * sin).to(ty), mask=mask)

        slot = tl.load(slot_ptr + t)  # int64; -1 = do not write
        hk = tl.arange(0, HKV_PAD)[:, None]
        kv_mask = (hk < NUM_KV_HEADS) & j_ok[None, :] & (slot >= 0)
        ksrc = k_ptr + t * stride_kt + hk * stride_kh + j[None, :] * stride_kd
        k1 = tl.load(ksrc, mask=kv_mask).to(tl.float32)
        k2 = tl.load(ksrc + HALF * stride_kd, mask=kv_mask).to(tl.float32)
        vsrc = v_ptr + t * stride_vt + hk * stride_vh + j[None, :] * stride_vd
        v1 = tl.load(vsrc, mask=kv_mask)
        v2 = tl.load(vsrc + HALF * stride_vd, mask=kv_mask)
        cty = cache_ptr.dtype.element_ty
        kdst = (cache_ptr + (slot // block_size) * stride_c_blk + (slot % block_size) * stride_c_off
                + hk * stride_c_h + j[None, :] * stride_c_d)
        tl.store(kdst, (k1 * cos - k2 * sin).to(ty).to(cty), mask=kv_mask)
        tl.store(kdst + HALF * stride_c_d, (k2 * cos + k1 * sin).to(ty).to(cty), mask=kv_mask)
        tl.store(kdst + stride_c_kv, v1.to(cty), mask=kv_mask)
        tl.store(kdst + stride_c_kv + HALF * stride_c_d, v2.to(cty), mask=kv_mask)


def check_rope_args(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Host-side checks (metadata only, safe during capture)."""
    if q.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} must be [T, num_heads, head_dim] like k {tuple(k.shape)}")
    if q.shape[2] % 2:
        raise ValueError(f"head_dim={q.shape[2]} must be even for rotary embeddings")
    if positions.shape != (q.shape[0],):
        raise ValueError(f"positions has shape {tuple(positions.shape)}, expected [{q.shape[0]}]")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != q.shape[2] or cos_sin.dtype != torch.float32:
        raise ValueError(
            f"cos_sin_cache is {cos_sin.dtype} {tuple(cos_sin.shape)}, expected float32 [max_positions, {q.shape[2]}]"
        )


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


def rope_write_kv_torch(q, k, v, positions, cos_sin, kv_cache, slot_mapping) -> torch.Tensor:
    """Torch reference of `rope_write_kv_triton` (same arguments, same result)."""
    check_rope_args(q, k, positions, cos_sin)
    write_kv_torch(rotate_torch(positions, k, cos_sin), v, kv_cache, slot_mapping)
    return rotate_torch(positions, q, cos_sin)


def rope_write_kv_triton(
    q: torch.Tensor,  # [T, H, D], any strides
    k: torch.Tensor,  # [T, Hkv, D], any strides
    v: torch.Tensor,  # [T, Hkv, D], any strides
    positions: torch.Tensor,  # [T] int64
    cos_sin: torch.Tensor,  # [max_positions, D] float32
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> torch.Tensor:  # q_rot [T, H, D] contiguous
    """Rotate q and k by `positions`, write rotated k and v at `slot_mapping`; return rotated q.

    One launch of T programs; runs on CPU tensors under TRITON_INTERPRET=1.
    """
    if not HAS_TRITON:
        raise RuntimeError("rope_write_kv_triton needs triton, which failed to import; use rope_write_kv_torch")
    check_rope_args(q, k, positions, cos_sin)
    check_kv_args(k, v, kv_cache, slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    q_rot = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_rot
    num_kv_heads = k.shape[1]
    launch = pdl_launch(q.device, num_tokens)  # {} unless PDL is on (graphrunner.kernels.pdl)
    _rope_write_kv_kernel[(num_tokens,)](
        q, k, v, positions, cos_sin, slot_mapping, q_rot, kv_cache,
        kv_cache.shape[2],
        *q.stride(), *k.stride(), *v.stride(),
        cos_sin.stride(0),
        *kv_cache.stride(),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=head_dim // 2,
        H_PAD=triton.next_power_of_2(num_heads),
        HKV_PAD=triton.next_power_of_2(num_kv_heads),
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
        GDC=bool(launch),
        **launch,
    )
    return q_rot


def rope_then_attend(
    backend: Any,
    q: torch.Tensor,  # [T, H, D], not yet rotated
    k: torch.Tensor,  # [T, Hkv, D], not yet rotated
    v: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin: torch.Tensor,  # [max_positions, D] float32
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D], written in place if given
) -> torch.Tensor:  # [T, H, D]
    """Rotary embedding, KV write and attention of one layer, fused where the backend allows.

    The fused kernel replaces the backend's own write when the backend declares
    `writes_kv_plainly` (it writes k/v at `metadata.slot_mapping` and nothing else), no
    k/v all-gather is pending (`metadata.kv_gather`), and the tensors are on CUDA. A
    decode-shaped batch (no more tokens than requests) on a backend with `attend_rope`
    goes further: its attention launch rotates and writes too (triton_attn.RopeKV), one
    kernel less per layer.
    """
    if getattr(backend, "writes_kv_plainly", False) and metadata.kv_gather is None and use_triton(q):
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D], contiguous like q_rot
        if ATTN_ROPE and hasattr(backend, "attend_rope") and q.shape[0] <= metadata.num_reqs:
            # A decode batch: the attention launch rotates and writes itself (one kernel less).
            return backend.attend_rope(q, k, v, positions, cos_sin, kv_cache, metadata, scale, out)
        slots = metadata.slot_mapping[: metadata.num_tokens]
        q_rot = rope_write_kv_triton(q, k, v, positions, cos_sin, kv_cache, slots)
        return backend.attend(q_rot, kv_cache, metadata, scale, out)
    q, k = rotate_torch(positions, q, cos_sin), rotate_torch(positions, k, cos_sin)
    return backend.forward(q, k, v.contiguous(), kv_cache, metadata, scale, out=out)


__all__ = ["check_rope_args", "rope_then_attend", "rope_write_kv_torch", "rope_write_kv_triton", "rotate_torch"]
