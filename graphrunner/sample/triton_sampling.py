"""Fused Triton kernels for the random-sampling tail: per-row filter threshold, then Gumbel-max.

The Sampler's Triton path is pivot_select.py (rows split over many programs, 6-10x faster
at 256 rows than these); these kernels are its exact fallback for the rows it cannot serve
(`flags`) and the home of the shared Triton helpers (hash, order keys, IEEE-rounded
scaling).

The torch path of `Sampler._sample_random` makes many full [R, V] passes (int64 hash
noise, 32-step bisections per filter, divides, masked fills). Here the same result
comes from two row-parallel kernels, one program per row, each looping over V:

1. `sampling_threshold`: the one threshold `t[r]` of min-p -> top-k -> top-p on the
   temperature-scaled logits (the max of the three, see filters.filter_threshold). The
   bisections run over the row (which sits in L2), with the same int32 order keys and
   the same 32 fixed steps as filters.py.
2. `gumbel_argmax`: in ONE pass, `argmax(x / T masked to >= t, + gumbel(key, v))` with
   exactly the noise of rng.py (hash32 of `key ^ (v * GOLDEN)`, 24-bit uniform,
   -log(-log u)). Greedy rows (T == 0) get the argmax of x, unfiltered and noise-free.

Exactness against the torch reference (same device): the division is IEEE
(`div_rn`), the hash is bit-exact integer arithmetic and the order keys are exact, so
min-p and top-k thresholds are identical, and so is the token for a given threshold
unless two noisy scores tie within an ulp of `log` (probability ~0). The top-p mass is
an fp32 sum (in another order than torch's, with `exp` that may differ by an ulp), so
the top-p boundary can move by the few tokens whose probability is below the sums'
rounding (~1e-5 of the mass at V = 152k; torch on CPU and CUDA differ the same way);
a token changes only if such a boundary token is the one drawn. At small V (tests)
the thresholds are identical.
NaN logits are not supported (torch.argmax picks a NaN, these kernels skip it).

Every function writes a preallocated output and never synchronizes with the host, so
both the Triton and the torch implementations are graph-safe. `HAS_TRITON` decides
once at import whether the Triton kernels exist (graphrunner.kernels).
"""

from __future__ import annotations

import torch

from graphrunner.kernels import HAS_TRITON, check_tensor, sm_count, split_pad, use_triton
from graphrunner.sample import rng
from graphrunner.sample.filters import filter_threshold

__all__ = [
    "gumbel_argmax",
    "gumbel_argmax_torch",
    "gumbel_argmax_triton",
    "sampling_threshold",
    "sampling_threshold_torch",
    "sampling_threshold_triton",
]

_BLOCK = 2048  # vocab entries per loop iteration (fp32: 8 KiB per chunk)
_NUM_WARPS = 8
_OUT_DTYPES = (torch.int32, torch.int64)


# --------------------------------------------------------------------------- torch references


def gumbel_argmax_torch(
    x: torch.Tensor,  # [R, V] float logits (processed, unscaled)
    temperature: torch.Tensor,  # [R] float32, 0 = greedy
    keys: torch.Tensor,  # [R] int64 in [0, 2**32): rng.row_keys
    threshold: torch.Tensor,  # [R] float32, -inf = no filter
    out: torch.Tensor,  # [R] int32 | int64, written in place
) -> None:
    """Torch reference of `gumbel_argmax` (several [R, V] passes)."""
    is_greedy = temperature == 0.0  # [R]
    scaled = x.float() / torch.where(is_greedy, 1.0, temperature)[:, None]  # [R, V]
    thr = torch.where(is_greedy, float("-inf"), threshold)  # greedy rows are never filtered
    scaled = scaled.masked_fill(scaled < thr[:, None], float("-inf"))
    noise = torch.where(is_greedy[:, None], 0.0, rng.gumbel(keys, x.shape[-1]))  # [R, V]
    out.copy_((scaled + noise).argmax(dim=-1))


def sampling_threshold_torch(
    x: torch.Tensor,  # [R, V] float logits (processed, unscaled)
    temperature: torch.Tensor,  # [R] float32, 0 = greedy (scaled by 1)
    top_k: torch.Tensor,  # [R] int32, 0 = off
    top_p: torch.Tensor,  # [R] float32, 1 = off
    min_p: torch.Tensor,  # [R] float32, 0 = off
    use_top_k: bool,
    use_top_p: bool,
    use_min_p: bool,
    out: torch.Tensor,  # [R] float32, written in place
) -> None:
    """Torch reference of `sampling_threshold`: filters.filter_threshold on x / T."""
    scaled = x.float() / torch.where(temperature == 0.0, 1.0, temperature)[:, None]  # [R, V]
    out.copy_(filter_threshold(scaled, top_k, top_p, min_p, use_top_k, use_top_p, use_min_p))


# --------------------------------------------------------------------------- Triton kernels

if HAS_TRITON:
    import triton
    import triton.language as tl

    # Same constants as rng.py; in uint32 arithmetic a product wraps mod 2**32, which is
    # exactly rng.py's `(a * b) & MASK32` on int64.
    _MIX = tl.constexpr(0x45D9F3B)
    _GOLDEN = tl.constexpr(0x1E3779B9)
    _SIGN_FREE = tl.constexpr(0x7FFFFFFF)

    @triton.jit
    def _hash32(x):
        # x: uint32 tensor -> uint32, rng.hash32 bit for bit (shifts of unsigned are logical).
        x = x ^ (x >> 16)
        x = x * _MIX
        x = x ^ (x >> 16)
        x = x * _MIX
        return x ^ (x >> 16)

    @triton.jit
    def _ordered_key(s):
        # float32 -> int32 key with the same order (filters.ordered_key).
        bits = s.to(tl.int32, bitcast=True)
        return tl.where(bits < 0, bits ^ _SIGN_FREE, bits)

    @triton.jit
    def _key_to_float(key):
        # int64 scalar key in int32 range -> float32 (filters.key_to_float).
        bits = tl.where(key < 0, key ^ _SIGN_FREE, key).to(tl.int32)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _scaled(base, v, vocab_size, t):
        # x / T for the chunk v, IEEE-rounded like torch's division; -inf past the row end.
        x = tl.load(base + v, mask=v < vocab_size, other=float("-inf")).to(tl.float32)
        return tl.math.div_rn(x, t)

    @triton.jit
    def _gumbel_score(s, v, key):
        # s + gumbel(key, v): rng.gumbel bit for bit (hash32 of key ^ v * GOLDEN, 24-bit uniform).
        bits = _hash32(key ^ (v.to(tl.uint32) * _GOLDEN))
        u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        return s + -tl.log(-tl.log(u))

    @triton.jit
    def _lift(keys, weight, start, limit, need):
        # Largest int64 key t in [start, limit) with sum(weight[keys >= t]) >= need (start if none):
        # binary lifting over 32 bits of offset. Steps that would leave [start, limit) skip
        # their reduction, so a narrow range costs few steps.
        lo = start
        for i in range(32):
            cand = lo + (tl.full([], 1, tl.int64) << (31 - i))
            if cand < limit:
                got = tl.sum(tl.where(keys >= cand, weight, 0).to(weight.dtype), 0)
                lo = tl.where(got >= need, cand, lo)
        return lo

    @triton.jit
    def _bisect_keys(keys, weight, lo, hi, need, STEPS: tl.constexpr):
        # STEPS halvings of the int64 key range [lo, hi): a key t with sum(weight[keys >= t]) >= need
        # (lo if none) that is <= the largest such key: a lower bound, exact once STEPS covers the range.
        for _ in range(STEPS):
            mid = lo + (hi - lo) // 2
            ok = tl.sum(tl.where(keys >= mid, weight, 0).to(weight.dtype), 0) >= need
            lo, hi = tl.where(ok, mid, lo), tl.where(ok, hi, mid)
        return lo

    @triton.jit
    def _x_bound(g, t):
        # The smallest float32 x with div_rn(x, t) >= g (t > 0): division is monotone, so for every
        # non-NaN x, `x >= bound` is exactly `x / t >= g` and a streaming pass needs no division.
        lo = _ordered_key(tl.full([], float("-inf"), tl.float32)).to(tl.int64)
        limit = _ordered_key(tl.full([], float("inf"), tl.float32)).to(tl.int64) + 1
        below = tl.math.div_rn(_key_to_float(lo), t) < g
        for i in range(32):  # largest key whose quotient is still below g
            cand = lo + (tl.full([], 1, tl.int64) << (31 - i))
            if cand < limit:
                lo = tl.where(tl.math.div_rn(_key_to_float(cand), t) < g, cand, lo)
        return tl.where(below, _key_to_float(tl.minimum(lo + 1, limit - 1)), float("-inf"))

    # Row helpers of pivot_select (here, beside the hash and the keys, to share them).

    @triton.jit
    def _greedy(row, max_ptr, arg_ptr, nan_ptr, num_splits, S_PAD: tl.constexpr):
        # torch.argmax of the row: its first NaN, else the first id of its max (0 if all -inf).
        j = tl.arange(0, S_PAD)
        on = j < num_splits
        peak = tl.load(max_ptr + row * num_splits + j, mask=on, other=float("-inf"))
        arg = tl.load(arg_ptr + row * num_splits + j, mask=on, other=2147483647)
        first_nan = tl.min(tl.load(nan_ptr + row * num_splits + j, mask=on, other=2147483647), 0)
        first_max = tl.min(tl.where(peak == tl.max(peak, 0), arg, 2147483647), 0)
        return tl.where(first_nan < 2147483647, first_nan, first_max)


    @triton.jit
    def _at(p, j, vals):
        # vals[j] for a scalar j (0 when j is outside [0, P)).
        return tl.sum(tl.where(p == j, vals, 0).to(vals.dtype), 0)


    @triton.jit
    def _row_params(row, top_k_ptr, top_p_ptr, vocab_size, USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr):
        # -> (k, k_on, top_p, p_on) with the off conventions of filters.py.
        k = tl.load(top_k_ptr + row)
        k_on = (k > 0) & (k < vocab_size) & USE_TOP_K
        top_p = tl.load(top_p_ptr + row)
        p_on = (top_p < 1.0) & USE_TOP_P
        return k, k_on, top_p, p_on


    @triton.jit
    def _append(n_ptr, cand_s_ptr, cand_v_ptr, row, capacity, s, v, take):
        # A slot per candidate, in any order (relaxed: only the slot numbers must be unique).
        at = tl.atomic_add(n_ptr + row + v * 0, 1, mask=take, sem="relaxed")
        tl.store(cand_s_ptr + row * capacity + at, s, mask=take & (at < capacity))
        tl.store(cand_v_ptr + row * capacity + at, v, mask=take & (at < capacity))


    @triton.jit
    def _draw(s, v, thr, hi, key, best_ptr, best_idx_ptr, row, num_splits, S_PAD: tl.constexpr):
        # argmax of s + gumbel over the kept candidates below hi and the compaction's draws
        # above it; the first id on ties, as torch.argmax.
        val = tl.where((s >= thr) & (s < hi), _gumbel_score(s, v, key), float("-inf"))
        j = tl.arange(0, S_PAD)
        part = tl.load(best_ptr + row * num_splits + j, mask=j < num_splits, other=float("-inf"))
        part_idx = tl.load(best_idx_ptr + row * num_splits + j, mask=j < num_splits, other=2147483647)
        best = tl.maximum(tl.max(val, 0), tl.max(part, 0))
        tok = tl.minimum(tl.min(tl.where((val == best) & (s >= thr) & (s < hi), v, 2147483647), 0),
                         tl.min(tl.where(part == best, part_idx, 2147483647), 0))
        return tl.where(tok == 2147483647, 0, tok)  # nothing kept (min_p > 1): token 0, like argmax

    @triton.jit
    def _lane_best(val, v, best, best_idx):  # per lane: the larger score and its id (a tie keeps the first id)
        better = val > best
        return tl.where(better, val, best), tl.where(better, v, best_idx)

    @triton.jit
    def _store_best(best_ptr, best_idx_ptr, at, best, best_idx):  # the best score, the smallest id reaching it
        peak = tl.max(best, 0)
        tl.store(best_ptr + at, peak)
        tl.store(best_idx_ptr + at, tl.min(tl.where(best == peak, best_idx, 2147483647), 0))

    @triton.jit
    def _pick_kernel(val_ptr, idx_ptr, flag_ptr, temp_ptr, fast_ptr, out_ptr, num_splits, MIN_FLAG: tl.constexpr,
                     S_PAD: tl.constexpr):
        # Row: the first id of the best split's draw for flagged sampled rows, else fast[row].
        row = tl.program_id(0)
        j = tl.arange(0, S_PAD)
        val = tl.load(val_ptr + row * num_splits + j, mask=j < num_splits, other=float("-inf"))
        idx = tl.load(idx_ptr + row * num_splits + j, mask=j < num_splits, other=2147483647)
        drawn = tl.min(tl.where(val == tl.max(val, 0), idx, 2147483647), 0)  # splits ascend: first id of the max
        flagged = (tl.load(flag_ptr + row) >= MIN_FLAG) & (tl.load(temp_ptr + row) != 0.0)
        tl.store(out_ptr + row, tl.where(flagged, drawn, tl.load(fast_ptr + row)))

    @triton.jit(do_not_specialize=["vocab_size", "chunk"])
    def _gumbel_argmax_kernel(
        x_ptr, x_stride, temp_ptr, keys_ptr, thr_ptr, val_ptr, idx_ptr, flag_ptr, vocab_size, chunk,
        BLOCK: tl.constexpr, MIN_FLAG: tl.constexpr,
    ):
        # Program (row, split) scans tokens [split * chunk, (split + 1) * chunk) of its row
        # and writes that span's best value and first index to val/idx[row, split]. With
        # MIN_FLAG > 0 only rows whose flag >= MIN_FLAG scan (the others write -inf, lo).
        row = tl.program_id(0)
        split = tl.program_id(1)
        num_splits = tl.num_programs(1)
        temp = tl.load(temp_ptr + row)
        greedy = temp == 0.0
        t = tl.where(greedy, 1.0, temp)
        thr = tl.where(greedy, float("-inf"), tl.load(thr_ptr + row))
        noise_scale = tl.where(greedy, 0.0, 1.0)  # greedy rows: argmax of x itself
        key = tl.load(keys_ptr + row).to(tl.uint32)
        base = x_ptr + row.to(tl.int64) * x_stride
        offs = tl.arange(0, BLOCK)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, vocab_size)
        if MIN_FLAG > 0:
            hi = tl.where(tl.load(flag_ptr + row) >= MIN_FLAG, hi, lo)
        # Per-lane running max; strict > keeps the first index of a tie within a lane.
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_idx = lo + offs
        for start in range(lo, hi, BLOCK):
            v = start + offs
            s = _scaled(base, v, hi, t)
            s = tl.where(s < thr, float("-inf"), s)
            bits = _hash32(key ^ (v.to(tl.uint32) * _GOLDEN))
            # rng.uniform bit for bit: 23 random bits + 0.5 are exact in float32, u in (0, 1).
            u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
            g = -tl.log(-tl.log(u))
            val = s + g * noise_scale
            better = val > best
            best = tl.where(better, val, best)
            best_idx = tl.where(better, v, best_idx)
        peak = tl.max(best, 0)
        # First index among the lanes holding the max (an all -inf row gives split 0's
        # first token, 0, like torch).
        idx = tl.min(tl.where(best == peak, best_idx, 2147483647), 0)
        tl.store(val_ptr + row * num_splits + split, peak)
        tl.store(idx_ptr + row * num_splits + split, idx)

    @triton.jit(do_not_specialize=["vocab_size"])
    def _threshold_kernel(
        x_ptr,
        x_stride,
        temp_ptr,
        top_k_ptr,
        top_p_ptr,
        log_min_p_ptr,
        out_ptr,
        flag_ptr,
        vocab_size,
        USE_TOP_K: tl.constexpr,
        USE_TOP_P: tl.constexpr,
        USE_MIN_P: tl.constexpr,
        BLOCK: tl.constexpr,
        MIN_FLAG: tl.constexpr,
    ):
        row = tl.program_id(0)
        # With MIN_FLAG > 0 only rows whose flag >= MIN_FLAG loop over V (pivot_select's fallback).
        active = tl.full([], 1, tl.int1)
        if MIN_FLAG > 0:
            active = tl.load(flag_ptr + row) >= MIN_FLAG
        n = vocab_size
        if active:  # (unflagged rows skip even the empty bisection steps: ~15 us at 256 rows)
            temp = tl.load(temp_ptr + row)
            t = tl.where(temp == 0.0, 1.0, temp)
            base = x_ptr + row.to(tl.int64) * x_stride
            offs = tl.arange(0, BLOCK)
            neg_inf = float("-inf")

            # min-p: max(x) + log(min_p) (log taken on the host side of the kernel, in torch).
            thr_min_p = tl.full([], neg_inf, tl.float32)
            if USE_MIN_P:
                peak = tl.full([BLOCK], neg_inf, tl.float32)
                for start in range(0, n, BLOCK):
                    peak = tl.maximum(peak, _scaled(base, start + offs, vocab_size, t))
                thr_min_p = tl.max(peak, 0) + tl.load(log_min_p_ptr + row)

            # top-k over what min-p kept: the largest key with count(keys >= key) >= k.
            thr_top_k = tl.full([], neg_inf, tl.float32)
            if USE_TOP_K:
                k = tl.load(top_k_ptr + row).to(tl.int64)
                on = (k > 0) & (k < vocab_size)
                k = tl.minimum(tl.maximum(k, 1), vocab_size)
                lo = tl.full([], -2147483648, tl.int64)
                for i in range(32):
                    cand = lo + (tl.full([], 1, tl.int64) << (31 - i))
                    count = tl.zeros([BLOCK], tl.int32)
                    for start in range(0, n, BLOCK):
                        v = start + offs
                        s = _scaled(base, v, vocab_size, t)
                        s = tl.where(s < thr_min_p, neg_inf, s)
                        count += ((_ordered_key(s) >= cand) & (v < vocab_size)).to(tl.int32)
                    lo = tl.where(tl.sum(count, 0).to(tl.int64) >= k, cand, lo)
                thr_top_k = tl.where(on, _key_to_float(lo), neg_inf)

            # top-p over what min-p and top-k kept: the largest key whose kept mass >= top_p * total.
            thr_top_p = tl.full([], neg_inf, tl.float32)
            if USE_TOP_P:
                top_p = tl.load(top_p_ptr + row)
                peak = tl.full([BLOCK], neg_inf, tl.float32)
                for start in range(0, n, BLOCK):
                    s = _scaled(base, start + offs, vocab_size, t)
                    s = tl.where((s < thr_min_p) | (s < thr_top_k), neg_inf, s)
                    peak = tl.maximum(peak, s)
                p_max = tl.max(peak, 0)
                # An all -inf row (never a real row) must not turn NaN; +inf is not finite either.
                p_max = tl.where((p_max > neg_inf) & (p_max < float("inf")), p_max, 0.0)
                mass = tl.zeros([BLOCK], tl.float32)
                for start in range(0, n, BLOCK):
                    s = _scaled(base, start + offs, vocab_size, t)
                    s = tl.where((s < thr_min_p) | (s < thr_top_k), neg_inf, s)
                    mass += tl.exp(s - p_max)
                need = top_p * tl.sum(mass, 0)
                lo = tl.full([], -2147483648, tl.int64)
                for i in range(32):
                    cand = lo + (tl.full([], 1, tl.int64) << (31 - i))
                    mass = tl.zeros([BLOCK], tl.float32)
                    for start in range(0, n, BLOCK):
                        s = _scaled(base, start + offs, vocab_size, t)
                        s = tl.where((s < thr_min_p) | (s < thr_top_k), neg_inf, s)
                        mass += tl.where(_ordered_key(s) >= cand, tl.exp(s - p_max), 0.0)
                    lo = tl.where(tl.sum(mass, 0) >= need, cand, lo)
                thr_top_p = tl.where(top_p < 1.0, _key_to_float(lo), neg_inf)

            tl.store(out_ptr + row, tl.maximum(tl.maximum(thr_min_p, thr_top_k), thr_top_p), mask=active)


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not importable; use the torch reference implementation")


def _check_logits(x: torch.Tensor) -> tuple[int, int]:
    if x.dim() != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"logits have shape {tuple(x.shape)}, expected [R, V] with R, V >= 1")
    if x.stride(1) != 1:
        raise ValueError(f"logits must have unit stride in their last dim for the Triton kernel ({x.stride()})")
    if x.shape[1] >= 1 << 31:
        raise ValueError(f"vocab size {x.shape[1]} exceeds the kernels' int32 index limit {(1 << 31) - 1}")
    return x.shape[0], x.shape[1]


def _block(vocab_size: int, block: int | None) -> int:
    if block is None:
        return min(_BLOCK, triton.next_power_of_2(vocab_size))
    if block < 16 or block & (block - 1):
        raise ValueError(f"block={block} must be a power of two >= 16")
    return block


def _check_rows(num_rows: int, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if tuple(t.shape) != (num_rows,) or not t.is_contiguous():
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected contiguous [{num_rows}]")


def gumbel_argmax_triton(
    x: torch.Tensor,
    temperature: torch.Tensor,
    keys: torch.Tensor,
    threshold: torch.Tensor,
    out: torch.Tensor,
    *,
    block: int | None = None,
    splits: int | None = None,
    flags: torch.Tensor | None = None,
    min_flag: int = 1,
    fast: torch.Tensor | None = None,
) -> None:
    """Triton implementation of `gumbel_argmax` (one pass over x).

    Each row is split across `splits` programs (default: enough programs to fill the
    device, so a single row does not run on one SM), whose partial maxima a torch argmax
    over [R, splits] combines; it picks the lowest split on ties, so the result is still
    the row's first maximal index. `block` (a power of two) overrides the chunk size, so
    CPU tests can exercise the loop. Shapes depend only on R and V: graph-safe.
    With `flags` ([R] int32), only rows whose flag >= min_flag are sampled; `out` gets
    a meaningless in-range id for the others, or with `fast` ([R] int32) fast[r] for the
    others and for greedy rows, in one small kernel (pivot_select's fallback).
    """
    _require_triton()
    num_rows, vocab_size = _check_logits(x)
    _check_rows(num_rows, temperature=temperature, keys=keys, threshold=threshold, out=out)
    check_tensor("out", out, (num_rows,), _OUT_DTYPES)
    check_tensor("keys", keys, (num_rows,), (torch.int64,))
    blk = _block(vocab_size, block)
    num_blocks = -(-vocab_size // blk)
    if splits is None:
        splits = -(-_target_programs(x.device) // num_rows)
    splits = max(1, min(splits, num_blocks))
    chunk = -(-num_blocks // splits) * blk  # a whole number of blocks per split
    splits = -(-vocab_size // chunk)
    part_val = torch.empty(num_rows, splits, dtype=torch.float32, device=x.device)  # [R, S]
    part_idx = torch.empty(num_rows, splits, dtype=torch.int32, device=x.device)  # [R, S]
    _gumbel_argmax_kernel[(num_rows, splits)](
        x, x.stride(0), temperature, keys, threshold, part_val, part_idx, out if flags is None else flags,
        vocab_size, chunk, BLOCK=blk, MIN_FLAG=0 if flags is None else min_flag, num_warps=_NUM_WARPS,
    )
    if fast is not None and flags is not None:
        _pick_kernel[(num_rows,)](part_val, part_idx, flags, temperature, fast, out, splits, MIN_FLAG=min_flag,
                                  S_PAD=split_pad(splits))
        return
    best_split = part_val.argmax(dim=1, keepdim=True)  # [R, 1]: first split holding the max
    out.copy_(part_idx.gather(1, best_split).squeeze(1))


def _target_programs(device: torch.device) -> int:
    """Programs that keep the device busy: two per SM on CUDA; a few under the CPU interpreter."""
    return 2 * sm_count(device, cpu=2)


def sampling_threshold_triton(
    x: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    use_top_k: bool,
    use_top_p: bool,
    use_min_p: bool,
    out: torch.Tensor,
    *,
    block: int | None = None,
    flags: torch.Tensor | None = None,
    min_flag: int = 2,
    log_min_p: torch.Tensor | None = None,
) -> None:
    """Triton implementation of `sampling_threshold` (R programs; up to ~67 passes per row).

    With `flags` ([R] int32), only rows whose flag >= min_flag get a threshold; the
    others keep what `out` holds (pivot_select's exact fallback). `log_min_p`: torch.log(min_p)
    when the caller has it already (one launch less).
    """
    _require_triton()
    num_rows, vocab_size = _check_logits(x)
    _check_rows(num_rows, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, out=out)
    check_tensor("out", out, (num_rows,), (torch.float32,))
    if not (use_top_k or use_top_p or use_min_p):
        if flags is None:  # (with flags, the rows it would write already hold -inf)
            out.fill_(float("-inf"))  # a Python scalar: no host-to-device copy while capturing
        return
    # log in torch, so that min-p's threshold is bit-identical to filters.min_p_threshold.
    log_min_p = torch.log(min_p) if log_min_p is None else log_min_p  # [R]
    _threshold_kernel[(num_rows,)](
        x, x.stride(0), temperature, top_k, top_p, log_min_p, out, out if flags is None else flags, vocab_size,
        USE_TOP_K=use_top_k, USE_TOP_P=use_top_p, USE_MIN_P=use_min_p,
        BLOCK=_block(vocab_size, block), MIN_FLAG=0 if flags is None else min_flag, num_warps=_NUM_WARPS,
    )


# --------------------------------------------------------------------------- public API


def gumbel_argmax(
    x: torch.Tensor,  # [R, V] float logits (processed, unscaled)
    temperature: torch.Tensor,  # [R] float32, 0 = greedy
    keys: torch.Tensor,  # [R] int64: rng.row_keys(seed, position)
    threshold: torch.Tensor,  # [R] float32: keep x / T >= threshold; -inf = keep all
    out: torch.Tensor,  # [R] int32 | int64, written in place
) -> None:
    """Gumbel-max sample per row: argmax over v of `x/T` (where >= threshold) + gumbel(key, v).

    Greedy rows (T == 0) get argmax(x), ignoring threshold and noise. Ties go to the
    first index. Triton on CUDA (one pass over x), torch reference elsewhere.
    """
    if use_triton(x):
        gumbel_argmax_triton(x, temperature, keys, threshold, out)
    else:
        gumbel_argmax_torch(x, temperature, keys, threshold, out)


def sampling_threshold(
    x: torch.Tensor,  # [R, V] float logits (processed, unscaled)
    temperature: torch.Tensor,  # [R] float32, 0 = greedy (scaled by 1)
    top_k: torch.Tensor,  # [R] int32, 0 = off
    top_p: torch.Tensor,  # [R] float32, 1 = off
    min_p: torch.Tensor,  # [R] float32, 0 = off
    use_top_k: bool,
    use_top_p: bool,
    use_min_p: bool,
    out: torch.Tensor,  # [R] float32, written in place
) -> None:
    """Per-row threshold of min-p -> top-k -> top-p on x / T (filters.filter_threshold).

    Keeping `x / T >= out[r]` is exactly what filters.apply_filters keeps. Triton on
    CUDA, torch reference elsewhere. The `use_*` flags are static per graph.
    """
    if use_triton(x):
        sampling_threshold_triton(x, temperature, top_k, top_p, min_p, use_top_k, use_top_p, use_min_p, out)
    else:
        sampling_threshold_torch(x, temperature, top_k, top_p, min_p, use_top_k, use_top_p, use_min_p, out)
