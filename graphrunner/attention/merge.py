"""Exact merge of partial attention results computed over disjoint key shards.

Under decode context parallelism each rank attends over its shard of a request's keys
and gets, per query token and head, a normalized partial output `o_i` and the natural
log-sum-exp `lse_i` of its scaled scores (`out_lse` of the paged backends). Attention
over the union of the shards is then

    lse = logsumexp_i lse_i,    out = sum_i exp(lse_i - lse) * o_i

computed stably: the weights are taken relative to the largest `lse_i`. A shard that
saw no key has `lse_i = -inf` and weight 0, and its output row is never read (it may hold
anything); when every shard is empty the merged row is 0 with LSE -inf (never NaN).

Both implementations write into preallocated outputs and never synchronize with the
host, so either can run inside a captured CUDA graph: a Triton kernel for CUDA tensors
and a torch reference elsewhere (the tests' oracle).
"""

from __future__ import annotations

import torch

from graphrunner.kernels import HAS_TRITON, check_tensor, use_triton

_F32 = (torch.float32,)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def merge_attention_states(
    outputs: torch.Tensor,  # [N, T, H, D]: shard i's normalized attention output
    lses: torch.Tensor,  # [N, T, H] fp32: shard i's natural log-sum-exp (-inf: no key)
    out: torch.Tensor,  # [T, H, D], written in place
    out_lse: torch.Tensor | None = None,  # [T, H] fp32, written in place if given
) -> None:
    """`out = sum_i exp(lses[i] - lse) * outputs[i]` with `lse = logsumexp(lses, 0)` (graph-safe).

    Accumulates in fp32 whatever the dtype of `outputs` and `out`. Rows whose shards are
    all empty come out 0, with `out_lse` -inf.
    """
    if outputs.dim() != 4:
        raise ValueError(f"outputs has shape {tuple(outputs.shape)}, expected [num_shards, T, H, D]")
    num_shards, num_tokens, num_heads, head_dim = outputs.shape
    if num_shards < 1:
        raise ValueError("outputs has no shard to merge (num_shards=0)")
    check_tensor("outputs", outputs, (num_shards, num_tokens, num_heads, head_dim), _FLOATS)
    check_tensor("lses", lses, (num_shards, num_tokens, num_heads), _F32)
    check_tensor("out", out, (num_tokens, num_heads, head_dim), _FLOATS)
    if out_lse is not None:
        check_tensor("out_lse", out_lse, (num_tokens, num_heads), _F32)
    impl = merge_attention_states_triton if use_triton(out) else merge_attention_states_torch
    impl(outputs, lses, out, out_lse)


def merge_attention_states_torch(
    outputs: torch.Tensor,  # [N, T, H, D]
    lses: torch.Tensor,  # [N, T, H] fp32
    out: torch.Tensor,  # [T, H, D]
    out_lse: torch.Tensor | None = None,  # [T, H] fp32
) -> None:
    """Torch reference of `merge_attention_states`."""
    lse_max = lses.amax(dim=0)  # [T, H]
    # All shards empty: subtract 0 instead of -inf so that -inf - max stays -inf (weight 0), not NaN.
    shift = torch.where(lse_max == float("-inf"), torch.zeros_like(lse_max), lse_max)
    weights = torch.exp(lses - shift)  # [N, T, H]
    denom = weights.sum(dim=0)  # [T, H]
    seen = denom > 0
    weights = weights.unsqueeze(-1)  # [N, T, H, 1]
    # where, not a product alone: a weight-0 shard's row is unread, so garbage (NaN, inf) there stays out.
    merged = torch.where(weights > 0, weights * outputs.float(), 0.0).sum(dim=0)  # [T, H, D]
    out.copy_(merged / torch.where(seen, denom, torch.ones_like(denom)).unsqueeze(-1))
    if out_lse is not None:
        lse = shift + torch.log(torch.where(seen, denom, torch.ones_like(denom)))
        out_lse.copy_(torch.where(seen, lse, torch.full_like(lse, float("-inf"))))


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _merge_states_kernel(
        o_ptr,  # [N, T, H, D]
        lse_ptr,  # [N, T, H] fp32
        out_ptr,  # [T, H, D]
        out_lse_ptr,  # [T, H] fp32 (STORE_LSE only)
        stride_on,
        stride_ot,
        stride_oh,
        stride_od,
        stride_ln,
        stride_lt,
        stride_lh,
        stride_mt,
        stride_mh,
        stride_md,
        stride_mlt,
        stride_mlh,
        NUM_SHARDS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        STORE_LSE: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        lse_row = lse_ptr + t * stride_lt + h * stride_lh
        lse_max = tl.load(lse_row)
        for i in tl.static_range(1, NUM_SHARDS):
            lse_max = tl.maximum(lse_max, tl.load(lse_row + i * stride_ln))
        shift = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # all empty: keep weights 0, not NaN
        acc = tl.zeros([D_PAD], tl.float32)
        denom = tl.zeros([], tl.float32)
        for i in tl.static_range(NUM_SHARDS):
            w = tl.exp(tl.load(lse_row + i * stride_ln) - shift)
            o_row = o_ptr + i * stride_on + t * stride_ot + h * stride_oh
            d_read = tl.where(w > 0.0, HEAD_DIM, 0)  # weight 0: the row is not read
            o = tl.load(o_row + d * stride_od, mask=d < d_read, other=0.0)
            acc += w * o.to(tl.float32)
            denom += w
        safe = tl.where(denom > 0.0, denom, 1.0)
        merged = (acc / safe).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + t * stride_mt + h * stride_mh + d * stride_md, merged, mask=d_ok)
        if STORE_LSE:
            lse = tl.where(denom > 0.0, shift + tl.log(safe), float("-inf"))
            tl.store(out_lse_ptr + t * stride_mlt + h * stride_mlh, lse)


def merge_attention_states_triton(
    outputs: torch.Tensor,  # [N, T, H, D]
    lses: torch.Tensor,  # [N, T, H] fp32
    out: torch.Tensor,  # [T, H, D]
    out_lse: torch.Tensor | None = None,  # [T, H] fp32
) -> None:
    """Triton `merge_attention_states`: one program per (token, head). Works on CPU tensors
    under TRITON_INTERPRET=1."""
    if not HAS_TRITON:
        raise RuntimeError("merge_attention_states_triton needs triton, which failed to import")
    num_shards, num_tokens, num_heads, head_dim = outputs.shape
    if num_tokens == 0 or num_heads == 0:
        return
    lse_out = out_lse if out_lse is not None else lses  # unused by the kernel unless STORE_LSE
    _merge_states_kernel[(num_tokens, num_heads)](
        outputs,
        lses,
        out,
        lse_out,
        *outputs.stride(),
        *lses.stride(),
        *out.stride(),
        *(out_lse.stride() if out_lse is not None else (0, 0)),
        NUM_SHARDS=num_shards,
        HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim),
        STORE_LSE=out_lse is not None,
    )


__all__ = ["merge_attention_states", "merge_attention_states_torch", "merge_attention_states_triton"]
