"""The LoRA kernels: shrink (h = x A^T) and expand (out += h B^T) over token rows grouped by slot.

A projection with adapters adds, to each token row t whose request has an adapter in slot s,

    out[t, slice i] += (x[t] A[s, i]^T) B[s, slice i]^T          (the scaling is folded into B)

where a merged projection (q|k|v, gate|up) has one A per slice and its B rows are the slices of the
output. Two launches serve every slice of a projection at once, so a merged projection pays the
same two launches as a plain one:

- shrink: grid (row blocks, slices x K splits). Program (m, (i, c)) finds its slot s and rows from
  `starts` (row blocks are numbered slot after slot, cdiv(rows of s, BLOCK_M) each), multiplies those
  rows' c-th K chunk with A[s, i]'s (rank padded to BLOCK_R) and writes the partial h[c, i, rows] in fp32.
- expand: grid (row blocks, slices x N tiles). Program (m, (i, j)) sums the K splits of h[:, i, rows]
  in split order, casts them to B's dtype (as vLLM does), multiplies them with the j-th BLOCK_N tile of
  B[s]'s slice i and adds the product into out[rows, offset_i + tile] in fp32, rounding once.

Row blocks numbered across the slots, not a grid axis per slot: with one axis per slot, 32 slots
launched 32 times the programs and all but a thirty-second of them exited at once, which made the
expand of Llama-3.1-8B's gate|up at 2,048 tokens cost 444-475 us beside the 700 us base GEMM (H200).

The K splits are mostly for decode: a slot's few rows form one row block, so without them one program
per slice walked all of K (14336 columns of Llama-3.1-8B's down projection: 112 dependent steps of 128)
while the other SMs idled; with LoRA on, batch-1 decode of that model took 7.44 ms against 4.25 ms
without (H200, 8 adapters of rank 16). Up to 64 tokens the shrink splits K into chunks of
`_SPLIT_K_COLUMNS`; above, the row blocks fill the GPU and only a K wider than
`_PREFILL_SPLIT_K_COLUMNS` is split. Partials summed in a fixed
order keep the result deterministic (no atomics).

Rows without an adapter are in no slot's range, so no program reads them: their output is the base
projection's, bit for bit. Programs past the last row block exit before any load. Every token is in
at most one range, so the read-modify-write of `out` has no races. The grids depend on the padded
token count and static sizes only (no host sync, no data-dependent shape): one CUDA-graph capture at
T replays correctly for any mix of adapters.

Layout: x [T, K]; A [L, S, R, K]; B [L, N, R] (slice i = rows [offset_i, offset_i + size_i));
slices [S, 2] int32 (offset, size); sorted_tokens [T] int32 token rows grouped by slot (any stride);
starts [L + 1] int32. `lora_reference` is the torch specification the kernels are tested against (and the
path on CPUs): it masks by the per-token slot instead of grouping rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphrunner.kernels import HAS_TRITON
from graphrunner.layers.gemv import gemv_extra_rows_triton

__all__ = ["LORA_DTYPES", "lora_expand", "lora_gemv_expand", "lora_k_splits", "lora_reference", "lora_shrink",
           "lora_shrink_expand", "lora_tiles"]

LORA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MIN_DOT = 16  # tl.dot needs every dimension >= 16
_SPLIT_K_COLUMNS = 512  # columns of K per shrink program at decode (four 128-column steps)
# The expand sums every split's partial for each of its output tiles: Llama-3.1-8B's down projection
# (K = 14336) in 28 splits took 9.8 us at one token and 13.2 us at 64, in 8 splits 9.1 and 10.5 us
# (shrink and expand, H200, rank 16).
_MAX_SPLITS = 8
# Above 64 tokens only a K as wide as Llama-3.1-8B's down projection (14336) is split, in 4: its shrink
# took 49-53 us at 2,048 tokens whole and 21-23 us in 4, while a split of K = 4096 saved the shrink 1-5 us
# and cost the expand, which sums the partials, up to 16 us (H200, rank 16).
_PREFILL_SPLIT_K_COLUMNS = 4096


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _row_blocks(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Programs along the rows: enough for any split of T rows over L slots (each slot's last block
    may be partial: at most cdiv(T, BLOCK_M) + L - 1 blocks in all)."""
    return _cdiv(num_tokens, block_m) + min(num_slots, num_tokens) - 1


def lora_k_splits(num_tokens: int, in_features: int) -> int:
    """K chunks of the shrink (module docstring): one per `_SPLIT_K_COLUMNS` up to 64 tokens, else one
    per `_PREFILL_SPLIT_K_COLUMNS`."""
    columns = _SPLIT_K_COLUMNS if num_tokens <= 64 else _PREFILL_SPLIT_K_COLUMNS
    return max(1, min(_MAX_SPLITS, _cdiv(in_features, columns)))


def lora_tiles(num_tokens: int, rank: int, in_features: int, max_slice: int,
               element_size: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_R, BLOCK_K, BLOCK_N) for T tokens, padded rank R, input width K, widest slice.

    BLOCK_M 16 up to 512 tokens, else 64. A row block holds one slot's rows only, so at decode (a few
    rows per slot) a 64-row block is mostly masked: 32 slots over 256 tokens took 199 us of shrinks and
    expands per Llama-3.1-8B layer at 64 rows against 98 us at 16 (base projections 192 us); at 2,048
    tokens 64 rows read each A and B tile fewer times (258 against 293 us, H200, rank 16).
    BLOCK_R is the rank rounded up to a power of two (the whole rank in one tile; R <= 256),
    BLOCK_K 128 (long contiguous reads of x and A rows) and BLOCK_N 128 (the expand of gate|up at 256
    tokens over 8 slots: 37 us against 44 us at 64 and 73 us at 256, H200), both cut to the shapes; fp32
    operands take half of each (at 64 rows the full tiles spill registers on sm_90 in ptxas)."""
    wide = 1 if element_size <= 2 else 2
    block_m = 16 if num_tokens <= 512 else 64
    block_r = max(_MIN_DOT, _next_pow2(rank))
    block_k = max(_MIN_DOT, min(128 // wide, _next_pow2(in_features)))
    block_n = max(_MIN_DOT, min(128 // wide, _next_pow2(max_slice)))
    return block_m, block_r, block_k, block_n


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _row_block(starts_ptr, pid, L, BLOCK_M: tl.constexpr, BLOCK_L: tl.constexpr):
        """(slot, first sorted row, end of the slot's rows) of row block `pid`: the slots' blocks are
        numbered one after the other (slot 0's cdiv(count, BLOCK_M), then slot 1's, ...); past the
        last block, first >= end."""
        offs = tl.arange(0, BLOCK_L)
        lo = tl.load(starts_ptr + offs, mask=offs < L, other=0)
        hi = tl.load(starts_ptr + offs + 1, mask=offs < L, other=0)
        blocks = (hi - lo + BLOCK_M - 1) // BLOCK_M
        ends = tl.cumsum(blocks, 0)  # block number at which each slot's blocks end
        slot = tl.sum((ends <= pid).to(tl.int32), 0)
        mine = offs == slot
        base = tl.sum(tl.where(mine, ends - blocks, 0), 0)
        first = tl.sum(tl.where(mine, lo, 0), 0) + (pid - base) * BLOCK_M
        end = tl.sum(tl.where(mine, hi, 0), 0)
        return slot, first, end

    @triton.jit
    def _shrink_kernel(x_ptr, a_ptr, h_ptr, sorted_ptr, starts_ptr, K, R, L, k_chunk, stride_sorted,
                       stride_xm, stride_as, stride_ai, stride_ar, stride_hc, stride_hi, stride_hm,
                       SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_L: tl.constexpr, IEEE: tl.constexpr):
        i = tl.program_id(1) // SPLITS
        c = tl.program_id(1) % SPLITS
        slot, first, end = _row_block(starts_ptr, tl.program_id(0), L, BLOCK_M, BLOCK_L)
        if first < end:
            offs_m = first + tl.arange(0, BLOCK_M)
            mask_m = offs_m < end
            rows = tl.load(sorted_ptr + offs_m * stride_sorted, mask=mask_m, other=0).to(tl.int64)
            offs_r = tl.arange(0, BLOCK_R)
            mask_r = offs_r < R
            a_base = a_ptr + slot.to(tl.int64) * stride_as + i * stride_ai
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            k_end = tl.minimum(K, (c + 1) * k_chunk)
            for k0 in range(c * k_chunk, k_end, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < k_end
                x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                            mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                a = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None],
                            mask=mask_r[None, :] & mask_k[:, None], other=0.0)  # [BLOCK_K, BLOCK_R]
                if IEEE:  # fp32 models: full precision, as torch's fp32 matmul (no TF32)
                    acc += tl.dot(x, a, input_precision="ieee")
                else:
                    acc += tl.dot(x, a)
            tl.store(h_ptr + c * stride_hc + i * stride_hi + rows[:, None] * stride_hm + offs_r[None, :], acc,
                     mask=mask_m[:, None] & mask_r[None, :])

    @triton.jit
    def _expand_kernel(h_ptr, b_ptr, out_ptr, sorted_ptr, starts_ptr, slices_ptr, R, L, tiles_per_slice,
                       stride_sorted, stride_hs, stride_hc, stride_hi, stride_hm, stride_bs, stride_bn, stride_om,
                       SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_L: tl.constexpr, IEEE: tl.constexpr):
        pid_n = tl.program_id(1)
        i = pid_n // tiles_per_slice
        j = pid_n % tiles_per_slice
        slot, first, end = _row_block(starts_ptr, tl.program_id(0), L, BLOCK_M, BLOCK_L)
        offset = tl.load(slices_ptr + 2 * i)
        size = tl.load(slices_ptr + 2 * i + 1)
        if (first < end) & (j * BLOCK_N < size):
            offs_m = first + tl.arange(0, BLOCK_M)
            mask_m = offs_m < end
            rows = tl.load(sorted_ptr + offs_m * stride_sorted, mask=mask_m, other=0).to(tl.int64)
            offs_r = tl.arange(0, BLOCK_R)
            mask_r = offs_r < R
            offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < size
            h_ptrs = h_ptr + slot.to(tl.int64) * stride_hs + i * stride_hi + rows[:, None] * stride_hm + offs_r[None, :]
            h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for c in tl.static_range(SPLITS):  # the shrink's K partials, in split order
                h += tl.load(h_ptrs + c * stride_hc, mask=mask_m[:, None] & mask_r[None, :], other=0.0)
            b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + (offset + offs_n)[None, :] * stride_bn
                        + offs_r[:, None], mask=mask_r[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
            if IEEE:
                delta = tl.dot(h.to(b.dtype), b, input_precision="ieee")
            else:
                delta = tl.dot(h.to(b.dtype), b)
            out_ptrs = out_ptr + rows[:, None] * stride_om + (offset + offs_n)[None, :]
            mask = mask_m[:, None] & mask_n[None, :]
            y = tl.load(out_ptrs, mask=mask, other=0.0)
            tl.store(out_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def _check(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    if x.dim() != 2 or out.dim() != 2 or a.dim() != 4 or b.dim() != 3:
        raise ValueError(f"expected x [T, K], out [T, N], A [L, S, R, K], B [L, N, R]; got {tuple(x.shape)}, "
                         f"{tuple(out.shape)}, {tuple(a.shape)}, {tuple(b.shape)}")
    if x.shape[1] != a.shape[3] or out.shape[1] != b.shape[1] or a.shape[2] != b.shape[2]:
        raise ValueError(f"shapes do not chain: x {tuple(x.shape)}, out {tuple(out.shape)}, A {tuple(a.shape)}, "
                         f"B {tuple(b.shape)}")
    for name, t in (("x", x), ("out", out), ("A", a), ("B", b)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")


def lora_shrink(x: torch.Tensor, a: torch.Tensor, sorted_tokens: torch.Tensor, starts: torch.Tensor,
                h: torch.Tensor) -> None:
    """h[c, i, t] = x[t, chunk c] A[s, i, :, chunk c]^T for every token row t of slot s's range (fp32 h
    [C, S, T, R], C = `lora_k_splits(T, K)`: summed over c, x[t] A[s, i]^T); other rows of h are left
    as they were."""
    T, K = x.shape
    L, S, R, _ = a.shape
    splits = h.shape[0]
    block_m, block_r, block_k, _ = lora_tiles(T, R, K, 1, x.element_size())
    k_chunk = _cdiv(_cdiv(K, splits), block_k) * block_k  # whole BLOCK_K steps per chunk
    _shrink_kernel[(_row_blocks(T, L, block_m), S * splits)](
        x, a, h, sorted_tokens, starts, K, R, L, k_chunk, sorted_tokens.stride(0), x.stride(0), a.stride(0),
        a.stride(1), a.stride(2), h.stride(0), h.stride(1), h.stride(2), SPLITS=splits, BLOCK_M=block_m,
        BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_L=_next_pow2(L), IEEE=x.dtype == torch.float32)


def lora_expand(h: torch.Tensor, b: torch.Tensor, out: torch.Tensor, sorted_tokens: torch.Tensor,
                starts: torch.Tensor, slices: torch.Tensor, max_slice: int, slot_stride: int = 0) -> None:
    """out[t, slice i] += (sum over c of h[c, i, t]) B[s, slice i]^T for every token row t of slot s's range;
    with `slot_stride`, slot s reads its h that many elements further (h of every slot, `lora_gemv_expand`)."""
    C, S, T, R = h.shape
    L = b.shape[0]
    block_m, block_r, _, block_n = lora_tiles(T, R, 1, max_slice, b.element_size())
    tiles = _cdiv(max_slice, block_n)
    _expand_kernel[(_row_blocks(T, L, block_m), S * tiles)](
        h, b, out, sorted_tokens, starts, slices, R, L, tiles, sorted_tokens.stride(0), slot_stride, h.stride(0),
        h.stride(1), h.stride(2), b.stride(0), b.stride(1), out.stride(0), SPLITS=C, BLOCK_M=block_m,
        BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_L=_next_pow2(L), IEEE=b.dtype == torch.float32)


def lora_shrink_expand(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       sorted_tokens: torch.Tensor, starts: torch.Tensor, slices: torch.Tensor,
                       max_slice: int) -> None:
    """out += LoRA(x), in place: the shrink and the expand (module docstring), two launches."""
    _check(x, out, a, b)
    S, R = a.shape[1], a.shape[2]
    splits = lora_k_splits(x.shape[0], x.shape[1])
    h = torch.empty(splits, S, x.shape[0], R, dtype=torch.float32, device=x.device)
    lora_shrink(x, a, sorted_tokens, starts, h)
    lora_expand(h, b, out, sorted_tokens, starts, slices, max_slice)


def lora_gemv_expand(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor,
                     b: torch.Tensor, sorted_tokens: torch.Tensor, starts: torch.Tensor, slices: torch.Tensor,
                     max_slice: int, tile: tuple[int, int, int], pdl_rows: int = 0) -> torch.Tensor:
    """x [1, K] W^T (+ bias) with the row's adapter added, in two launches: the single-row GEMV reads
    every slot's A after W's rows (`gemv_extra_rows_triton`), so h of every slot comes out of the
    projection's own launch, and the expand adds the row's slot's h B^T (a shrink launch fewer than
    `lora_shrink_expand` after the projection)."""
    L, S, R, K = a.shape
    out, h = gemv_extra_rows_triton(x, weight, bias, a.reshape(L * S * R, K), tile, pdl_rows=pdl_rows)
    # h [1, L*S*R] as the expand's [C=1, S, T=1, R], slot s at s*S*R
    lora_expand(h.as_strided((1, S, 1, R), (L * S * R, R, L * S * R, 1)), b, out, sorted_tokens, starts, slices,
                max_slice, slot_stride=S * R)
    return out


def lora_reference(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   token_slot: torch.Tensor, slices: Sequence[tuple[int, int]]) -> None:
    """The specification, in torch: out[t] += LoRA of slot token_slot[t] (-1: nothing), in place.

    Per slot, every row is multiplied and the rows of other slots are masked out: graph-safe (no
    data-dependent shapes), at L times the arithmetic, which only a CPU pays. Rounds as the kernels
    do: h in fp32, cast to B's dtype, the delta added to `out` in fp32 and rounded once."""
    _check(x, out, a, b)
    L, S, R, K = a.shape
    acc = out.float()
    for s in range(L):
        h = (x.float() @ a[s].reshape(S * R, K).float().t()).to(b.dtype).float()  # [T, S * R]
        parts = [h[:, i * R:(i + 1) * R] @ b[s, off:off + size].float().t() for i, (off, size) in enumerate(slices)]
        delta = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        acc = torch.where((token_slot == s).unsqueeze(1), acc + delta, acc)
    out.copy_(acc.to(out.dtype))
