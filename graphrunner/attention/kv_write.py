"""Write a step's new keys and values into the paged KV cache.

Slot s of the cache is `(block s // block_size, offset s % block_size)`; slot -1 marks
a token whose k/v must not be written (padding, docs/architecture.md §4). Both implementations
below are graph-safe: no host sync, no value-dependent shapes, writes in place.

- `write_kv_triton`: one program per token; a token with slot -1 stores nothing.
- `write_kv_torch`: one `index_put_` per cache half. A tensor op cannot "skip" an
  element, and sending skipped tokens to a fixed slot (say 0) would overwrite the
  k/v of whichever live request owns that slot. Instead every skipped token is
  redirected to the slot *and the values* of one live token of the batch, so that
  slot receives several writes of identical data and the result does not depend on
  their order. When no token of the batch is live, every token rewrites slot 0 with
  the cache's own current content, which changes nothing.

`write_kv` picks Triton for CUDA tensors when triton imports, else the torch path.
"""

from __future__ import annotations

import torch

from graphrunner.kernels import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _write_kv_kernel(
        k_ptr,
        v_ptr,
        cache_ptr,
        slot_ptr,
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
        ty = cache_ptr.dtype.element_ty
        tl.store(dst, k.to(ty), mask=mask)
        tl.store(dst + stride_c_kv, v.to(ty), mask=mask)


def check_kv_args(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Host-side shape checks (metadata only, safe during capture)."""
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [T, num_kv_heads, head_dim]")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache has shape {tuple(kv_cache.shape)}, expected [2, num_blocks, block_size, num_kv_heads, head_dim]"
        )
    if tuple(kv_cache.shape[3:]) != tuple(k.shape[1:]):
        raise ValueError(
            f"k/v heads x dim {tuple(k.shape[1:])} do not match kv_cache heads x dim {tuple(kv_cache.shape[3:])}"
        )
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping has shape {tuple(slot_mapping.shape)}, expected [{k.shape[0]}]")
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping has dtype {slot_mapping.dtype}, expected torch.int64")


def write_kv_torch(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    """Torch reference of `write_kv`: graph-safe, see the module docstring for how -1 is skipped."""
    check_kv_args(k, v, kv_cache, slot_mapping)
    if k.shape[0] == 0:
        return
    block_size = kv_cache.shape[2]
    live = slot_mapping >= 0  # [T] bool
    any_live = live.any()  # 0-d bool, stays on the device
    first = live.to(torch.int32).argmax().reshape(1)  # [1]: first live token (0 when none)
    # Redirect target for skipped tokens: the first live token's slot, else slot 0.
    fallback_slot = torch.where(
        any_live, slot_mapping.index_select(0, first), torch.zeros_like(first, dtype=torch.int64)
    )
    slots = torch.where(live, slot_mapping, fallback_slot)  # [T], all valid
    blk, off = slots // block_size, slots % block_size
    live3 = live.view(-1, 1, 1)
    for half, new in ((kv_cache[0], k), (kv_cache[1], v)):
        new = new.to(half.dtype)
        # Value for redirected tokens: the first live token's own row, else slot 0's current content.
        fallback = torch.where(any_live, new.index_select(0, first), half[0, 0].unsqueeze(0))  # [1, Hkv, D]
        values = torch.where(live3, new, fallback)  # [T, Hkv, D]
        half.index_put_((blk, off), values)


def write_kv_triton(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    """Triton implementation of `write_kv` (also runs on CPU tensors under TRITON_INTERPRET=1)."""
    if not HAS_TRITON:
        raise RuntimeError("write_kv_triton needs triton, which failed to import; use write_kv_torch")
    check_kv_args(k, v, kv_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        kv_cache.shape[2],
        *k.stride(),
        *v.stride(),
        *kv_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        H_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim),
    )


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    """Write token t's k/v at cache slot `slot_mapping[t]`, skipping slot -1, in place.

    Uses the Triton kernel for CUDA tensors when triton imports, else `write_kv_torch`.
    Slots of live tokens must be distinct (two live tokens writing one slot is a
    scheduler bug; which one wins is unspecified).
    """
    if HAS_TRITON and kv_cache.is_cuda:
        write_kv_triton(k, v, kv_cache, slot_mapping)
    else:
        write_kv_torch(k, v, kv_cache, slot_mapping)
