"""The Triton kernels that write a step's new keys and values into the paged KV cache.

Slot s of the cache is `(block s // block_size, offset s % block_size)`; slot -1 marks
a token whose k/v must not be written (padding, docs/architecture.md §4). Both kernels are
graph-safe: no host sync, no value-dependent shapes, writes in place; their torch references
(`write_kv_torch`, `rope_write_kv_torch`) live in torch_ref.py.

- `write_kv_triton`: one program per token; a token with slot -1 stores nothing.
- `rope_write_kv_triton`: the rotary embedding fused with the write, one kernel per layer
  instead of five. Before attention a decoder layer rotates q and k by each token's position
  (Neox style), makes v contiguous and writes k/v into the cache; compiled as separate ops that
  is five graph nodes per layer (the cos/sin gather, the q rotation, the k rotation, the v copy,
  the KV write), and at batch 1 each costs more in launch and drain than in memory traffic.
  This kernel does all of it in one program per token: it gathers the token's cos/sin row,
  rotates every q head into a fresh contiguous `q_rot`, and stores the rotated k and the
  (strided) v at the token's slot, skipping slot -1 as `write_kv_triton` does. cos/sin are
  rounded to the activation dtype first (as Hugging Face does); each rotated element is
  computed in fp32 and rounded once, as inductor's fused rotary kernel computes it too.

An fp8 cache (dtype float8_e4m3fn) gets each key as `clamp(k / k_scale, -448, 448)` rounded to
e4m3, and each value likewise with `v_scale` (`kv_scale`: the layer's [2] fp32 tensor, read on
the device so a captured graph follows a rewritten scale); the division is IEEE-rounded
(`div_rn`) so that the kernels store exactly what `write_kv_torch` stores. On a GPU the cast is the
hardware's round-to-nearest-even; the interpreter's own fp32 -> fp8 cast rounds wrongly, so for CPU
tensors the kernels take the bits from `graphrunner.kernels.fp8_bits` (`fp8_mode` 2).

`write_kv` picks the Triton kernel for CUDA tensors when triton imports, else the torch path.
"""

from __future__ import annotations

import torch

from graphrunner.attention.torch_ref import (
    FP8_KV_MAX,
    check_kv_args,
    check_kv_scale,
    check_rope_args,
    is_fp8_cache,
    kv_scale_pair,
    write_kv_torch,
)
from graphrunner.kernels import HAS_TRITON
from graphrunner.kernels.pdl import pdl_launch


def fp8_mode(kv_cache: torch.Tensor) -> int:
    """The kernels' FP8 switch: 0 for a cache of the model's dtype, 1 for fp8 on a GPU (the hardware
    cast), 2 for fp8 in the interpreter (rounded to the e4m3 grid before its cast; module docstring)."""
    if not is_fp8_cache(kv_cache):
        return 0
    return 1 if kv_cache.is_cuda else 2


if HAS_TRITON:
    import triton
    import triton.language as tl

    from graphrunner.kernels.fp8_bits import e4m3_bits
    from graphrunner.kernels.pdl import pdl_wait

    _FP8_MAX_C: tl.constexpr = tl.constexpr(FP8_KV_MAX)

    @triton.jit
    def quantize_fp8_kv(x, scale, ty, MODE: tl.constexpr):
        """fp32 `x / scale` (IEEE-rounded), clamped to +-448, cast to the fp8 cache dtype `ty`
        (`MODE` 2: its bits from `e4m3_bits`, for the interpreter; module docstring)."""
        q = tl.math.div_rn(x.to(tl.float32), scale)
        q = tl.minimum(tl.maximum(q, -_FP8_MAX_C), _FP8_MAX_C)
        if MODE == 2:
            out = e4m3_bits(q).to(tl.float8e4nv, bitcast=True).to(ty)
        else:
            out = q.to(ty)
        return out

    @triton.jit
    def store_kv(dst, stride_c_kv, k, v, scale_ptr, mask, FP8: tl.constexpr):
        """Key at `dst`, value at `dst + stride_c_kv`, in the cache's dtype: quantized with the layer's
        (k_scale, v_scale) at `scale_ptr` for an fp8 cache, rounded otherwise."""
        ty = dst.dtype.element_ty
        if FP8:
            tl.store(dst, quantize_fp8_kv(k, tl.load(scale_ptr), ty, FP8), mask=mask)
            tl.store(dst + stride_c_kv, quantize_fp8_kv(v, tl.load(scale_ptr + 1), ty, FP8), mask=mask)
        else:
            tl.store(dst, k.to(ty), mask=mask)
            tl.store(dst + stride_c_kv, v.to(ty), mask=mask)

    @triton.jit
    def _write_kv_kernel(
        k_ptr,
        v_ptr,
        cache_ptr,
        slot_ptr,
        scale_ptr,  # [2] fp32 (k_scale, v_scale): read under FP8 only
        block_size,
        stride_kt,
        stride_kh,
        stride_kd,
        stride_vt,
        stride_vh,
        stride_vd,
        stride_c_kv,
        stride_c_blk,
        stride_c_off,
        stride_c_h,
        stride_c_d,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        H_PAD: tl.constexpr,
        D_PAD: tl.constexpr,
        FP8: tl.constexpr,  # fp8_mode: the cache stores quantized e4m3 (module docstring)
    ):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t)  # int64
        live = slot >= 0
        blk = slot // block_size
        off = slot % block_size
        h = tl.arange(0, H_PAD)[:, None]
        d = tl.arange(0, D_PAD)[None, :]
        mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM) & live
        t64 = t.to(tl.int64)
        k = tl.load(k_ptr + t64 * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
        v = tl.load(v_ptr + t64 * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
        dst = cache_ptr + blk * stride_c_blk + off * stride_c_off + h * stride_c_h + d * stride_c_d
        store_kv(dst, stride_c_kv, k, v, scale_ptr, mask, FP8)

    @triton.jit
    def _rope_write_kv_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, slot_ptr, q_out_ptr, cache_ptr,
        scale_ptr,  # [2] fp32 (k_scale, v_scale): read under FP8 only
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
        FP8: tl.constexpr,  # fp8_mode: the cache stores quantized e4m3 (module docstring)
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
        kdst = (cache_ptr + (slot // block_size) * stride_c_blk + (slot % block_size) * stride_c_off
                + hk * stride_c_h + j[None, :] * stride_c_d)
        # The rotated key is rounded to the activation dtype first, as the torch rotation returns it.
        k_lo = (k1 * cos - k2 * sin).to(ty)
        k_hi = (k2 * cos + k1 * sin).to(ty)
        store_kv(kdst, stride_c_kv, k_lo, v1, scale_ptr, kv_mask, FP8)
        store_kv(kdst + HALF * stride_c_d, stride_c_kv, k_hi, v2, scale_ptr, kv_mask, FP8)


def write_kv_triton(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    kv_scale: torch.Tensor | None = None,  # [2] fp32 (k_scale, v_scale) of an fp8 cache; None: 1.0
) -> None:
    """Triton implementation of `write_kv` (also runs on CPU tensors under TRITON_INTERPRET=1)."""
    if not HAS_TRITON:
        raise RuntimeError("write_kv_triton needs triton, which failed to import; use write_kv_torch")
    check_kv_args(k, v, kv_cache, slot_mapping)
    check_kv_scale(kv_cache, kv_scale)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    fp8 = fp8_mode(kv_cache)
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        kv_scale_pair(kv_scale, kv_cache.device) if fp8 else slot_mapping,  # unread without FP8
        kv_cache.shape[2],
        *k.stride(),
        *v.stride(),
        *kv_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        H_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim),
        FP8=fp8,
    )


def rope_write_kv_triton(
    q: torch.Tensor,  # [T, H, D], any strides
    k: torch.Tensor,  # [T, Hkv, D], any strides
    v: torch.Tensor,  # [T, Hkv, D], any strides
    positions: torch.Tensor,  # [T] int64
    cos_sin: torch.Tensor,  # [max_positions, D] float32
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    pdl_rows: int = 0,  # launches of at most this many tokens use PDL (graphrunner.kernels.pdl)
    kv_scale: torch.Tensor | None = None,  # [2] fp32 (k_scale, v_scale) of an fp8 cache; None: 1.0
) -> torch.Tensor:  # q_rot [T, H, D] contiguous
    """Rotate q and k by `positions`, write rotated k and v at `slot_mapping`; return rotated q.

    One launch of T programs; runs on CPU tensors under TRITON_INTERPRET=1.
    """
    if not HAS_TRITON:
        raise RuntimeError("rope_write_kv_triton needs triton, which failed to import; use rope_write_kv_torch")
    check_rope_args(q, k, positions, cos_sin)
    check_kv_args(k, v, kv_cache, slot_mapping)
    check_kv_scale(kv_cache, kv_scale)
    num_tokens, num_heads, head_dim = q.shape
    q_rot = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_rot
    num_kv_heads = k.shape[1]
    launch = pdl_launch(num_tokens, pdl_rows)
    fp8 = fp8_mode(kv_cache)
    _rope_write_kv_kernel[(num_tokens,)](
        q, k, v, positions, cos_sin, slot_mapping, q_rot, kv_cache,
        kv_scale_pair(kv_scale, kv_cache.device) if fp8 else cos_sin,  # unread without FP8
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
        FP8=fp8,
        **launch,
    )
    return q_rot


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    kv_scale: torch.Tensor | None = None,  # [2] fp32 (k_scale, v_scale) of an fp8 cache; None: 1.0
) -> None:
    """Write token t's k/v at cache slot `slot_mapping[t]`, skipping slot -1, in place
    (quantized by `kv_scale` into an fp8 cache).

    Uses the Triton kernel for CUDA tensors when triton imports, else `write_kv_torch`.
    Slots of live tokens must be distinct (two live tokens writing one slot is a
    scheduler bug; which one wins is unspecified).
    """
    if HAS_TRITON and kv_cache.is_cuda:
        write_kv_triton(k, v, kv_cache, slot_mapping, kv_scale)
    else:
        write_kv_torch(k, v, kv_cache, slot_mapping, kv_scale)


__all__ = ["rope_write_kv_triton", "write_kv", "write_kv_triton"]
