"""Sort-free min-p / top-k / top-p sampling in two reads of the logits for most rows (Triton).

The exact threshold of filters.filter_threshold and the Gumbel-max token of
triton_sampling.gumbel_argmax, without a sort: rows are split over R x S programs.
Tier 0, the guess (every row):
1. stats (R x S): max of s = x / T (NaN skipped) and its first id, the first NaN id
   (greedy rows: torch.argmax), sum and count of finite x, and bucket maxima (the maxima
   of disjoint token groups: k of them >= t prove k tokens >= t). On x, divided at the end.
   Min-p rows ("one-pass" rows) also append their tier-0 candidates here: every finite token with
   s >= M' + log(min_p), M' the running max (<= M), a superset of the tokens min-p keeps.
2. plan (R): g <= the final threshold: t_min_p (one-pass rows stop here), raised to the k-th
   largest bucket max for top-k; top-p-only rows aim g at a mass share of the bucket maxima
   (a guess, checked).
3. guess (R x S), rows other than one-pass rows: tokens with x >= bound(g) (so s >= g, no
   division) are appended (x, id) to the row's candidates; top-p-only rows also sum
   exp(s - M); no-filter rows draw. A batch of min-p rows reads the logits once in tier 0.
4. select (R): exact thresholds from the candidates by binary lifting over int32 order
   keys, masses in 2**-40 fixed point (integer sums: the racy candidate order cannot
   change a seeded draw), and the draw (rng.py's noise, bit for bit). It serves a row only
   if provably exact: <= GUESS_CAPACITY candidates, >= k of them (or g = t_min_p), their
   mass >= top_p * Z', threshold >= g; else flag 1. It writes every row's flag: no memset.
Tier -1 (pivot_reject.py; `reject`), rows flagged 1 only (other programs return at once): the
unfiltered Gumbel-max draw (pass A), proven kept (pass B) or not; an accepted row takes it (flag
-1, threshold NaN), bit for bit the token the tiers below would draw; the others stay flagged 1.
Tier 1, the pivots (rows still flagged 1; other programs return at once): counts and masses at
P pivots (min-p, a ladder `M - spread * j / (P-2)` with spread = M - mean, -inf) give
windows holding the k-th value and the final threshold; the compaction appends those
tokens and draws among the tokens above them (kept for sure); select finishes as above.
Tier 2, the refinement (pivot_refine.py): rows whose windows hold more than `capacity`
tokens (flat rows) count again at pivots spread inside those windows, up to twice, before
the compaction; they never pay tier 1's compaction.
Tier 3: still more candidates than `capacity`, or a non-finite max or spread (a row of only
-inf, +inf logits): triton_sampling's kernels (one-program bisection, then the Gumbel pass;
~3 ms) finish them.
Tie rule, shared with filters.py and the sort reference of the tests: every token tied
with the last kept value is kept (the kept set is `s >= threshold`). Exactness: counts
are integers, bounds and pivots are compared in the same float32 in every kernel, so
min-p and top-k are bit-identical to filters.py. Top-p masses are float32 / fixed-point
sums in another order than torch's: the boundary can move only across tokens whose prefix
mass is within rounding (~1e-6 relative) of top_p * Z', and the float32 sums over tiles
depend on S, so in such a tie a seeded row's top-p boundary can depend on the batch size.
NaN entries are skipped. Sized by R, V and `capacity`, no host sync: graph-safe.
Flags ([R] int32, returned as the tiers): -1 and 0-3 as above; 4 marks a row pending refinement.
One scratch buffer is zero-filled (one memset node): the candidate counts, before the stats pass.
"""

from __future__ import annotations

import torch

from graphrunner.kernels import HAS_TRITON, check_tensor, split_pad
from graphrunner.sample import triton_sampling as ts
from graphrunner.sample.pivot_refine import NUM_PIVOTS, TIER_FALLBACK, TIER_REFINE, count_and_refine
from graphrunner.sample.pivot_reject import serve_draws

__all__ = ["DEFAULT_CAPACITY", "GUESS_CAPACITY", "NUM_PIVOTS", "pivot_sample_triton"]

DEFAULT_CAPACITY = 8192  # candidates per row (64 KiB of value, id); 4096 overflows at top_p 0.95
GUESS_CAPACITY = 1024  # candidates the guess tier's select reads: a [1024] tile, ~8x cheaper than 8192
_GUESS_BUCKETS = 1024  # bucket maxima per row (about: a power of two per program)
_GUESS_SLACK = 0.25  # top-p-only guess: the bucket maxima's mass share 1 - (1 - top_p) * slack
_BLOCK = 1024  # vocab entries per loop step of the streaming kernels (H100, 256 rows: 2048 +4%, 4096 +11%)
_PROGRAMS_PER_SM = 2  # streaming programs per SM (H100, 256 rows, guess tier: 2 180 us, 4 213, 8 183)
_NUM_WARPS = 8
_SEGMENT = 8  # one-pass stats: tiles per bound update (the first segment is read twice)
# Stats-pass tiles loaded together per loop step (1, 2 or 4). H100, 256 rows: 2 takes the pass from
# 96.6 to 83.5 us, 4 gains nothing over 1.
_STATS_UNROLL = 2

if HAS_TRITON:
    import triton
    import triton.language as tl

    # Shared with the fused kernels, so the noise and the keys are the same code.
    from graphrunner.sample.pivot_refine import _finishes, _pivot_sums, _row_pivots, _windows
    from graphrunner.sample.pivot_stats import _one_pass, _stats_kernel
    from graphrunner.sample.triton_sampling import (
        _append,
        _at,
        _bisect_keys,
        _draw,
        _greedy,
        _gumbel_score,
        _key_to_float,
        _lane_best,
        _lift,
        _ordered_key,
        _row_params,
        _scaled,
        _store_best,
        _x_bound,
    )

    _NEG_INF = tl.constexpr(float("-inf"))
    _FIXED = tl.constexpr(float(2**40))  # fixed-point unit of the select kernel's masses
    _POS_INF = tl.constexpr(float("inf"))
    _SLACK = tl.constexpr(_GUESS_SLACK)
    _REFINED = tl.constexpr(TIER_REFINE)
    _FALLBACK = tl.constexpr(TIER_FALLBACK)

    @triton.jit
    def _plan_kernel(max_ptr, sum_ptr, num_ptr, log_min_p_ptr, bmax_ptr, top_k_ptr, top_p_ptr, plan_ptr, piv_ptr,
                     vocab_size, num_splits, nb, USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr,
                     USE_MIN_P: tl.constexpr, ONE_PASS: tl.constexpr, S_PAD: tl.constexpr, P: tl.constexpr,
                     BUCKETS: tl.constexpr):
        # Program row: plan[row] = (g, mode). Kept tokens have s >= t_min_p and >= the k-th largest
        # bucket max (proven bounds: mode 1); top-p-only rows guess g from the buckets' mass (mode 2:
        # the guess pass sums the total mass too); mode 3: no filter, draw all; 0: tier 1 serves it.
        # Also stores tier 1's pivots, which every later kernel reads (the same float32 everywhere).
        # One-pass rows (min-p on) take g = t_min_p: the stats pass appended every token above it.
        row = tl.program_id(0)
        m, ok, piv = _row_pivots(row, max_ptr, sum_ptr, num_ptr, log_min_p_ptr, num_splits, USE_MIN_P, S_PAD, P)
        tl.store(piv_ptr + row * P + tl.arange(0, P), piv)
        k, k_on, top_p, p_on = _row_params(row, top_k_ptr, top_p_ptr, vocab_size, USE_TOP_K, USE_TOP_P)
        t_min_p = _at(tl.arange(0, P), 0, piv)
        j = tl.arange(0, BUCKETS)
        on = j < num_splits * nb
        bm = tl.load(bmax_ptr + row * num_splits * nb + j, mask=on, other=_NEG_INF)  # [S * NB] bucket maxima
        key = _ordered_key(bm).to(tl.int64)
        low = _ordered_key(tl.maximum(t_min_p, _NEG_INF)).to(tl.int64)  # g >= t_min_p anyway
        top = _ordered_key(tl.where(ok, m, 0.0)).to(tl.int64) + 1
        g = t_min_p
        one_pass = _one_pass(row, log_min_p_ptr, ONE_PASS)  # g = t_min_p: its candidates hold s >= t_min_p
        if USE_TOP_K:  # a lower bound of the k-th bucket max (exact to ~2**-20 of the key range)
            if k_on & ~one_pass:  # (a branch, not a where: one-pass rows skip the bisection)
                g = tl.maximum(g, _key_to_float(_bisect_keys(key, on.to(tl.int32), low, top, k, 20)))
        use_p = p_on & (g == _NEG_INF)
        if USE_TOP_P:
            if use_p:
                e = tl.where(bm > _NEG_INF, tl.exp(bm - tl.where(ok, m, 0.0)), 0.0)  # [S * NB]
                share = 1.0 - (1.0 - top_p) * _SLACK
                g = _key_to_float(_bisect_keys(key, e, low, top, share * tl.sum(e, 0), 20))
        no_filter = ~k_on & ~p_on & (t_min_p == _NEG_INF)
        mode = tl.where(no_filter, 3, tl.where(g == _NEG_INF, 0, tl.where(use_p, 2, 1)))
        mode = tl.where(ok, mode, 0)
        tl.store(plan_ptr + 2 * row, tl.where(mode == 3, _NEG_INF, g))
        tl.store(plan_ptr + 2 * row + 1, mode.to(tl.float32))

    @triton.jit(do_not_specialize=["vocab_size", "chunk", "num_splits"])
    def _guess_kernel(x_ptr, x_stride, temp_ptr, keys_ptr, max_ptr, sum_ptr, num_ptr, log_min_p_ptr, plan_ptr, n_ptr,
                      cand_x_ptr, cand_v_ptr, best_ptr, best_idx_ptr, part_z_ptr, vocab_size, chunk, num_splits,
                      capacity, USE_MIN_P: tl.constexpr, ONE_PASS: tl.constexpr, S_PAD: tl.constexpr,
                      P: tl.constexpr, BLOCK: tl.constexpr):
        # Program (row, split), tier 0: appends its tokens with s >= g (as x >= bound(g): no division)
        # as (raw x, id); mode 2 also sums exp(s - M), mode 3 draws over all (best s + gumbel, first id).
        row, split = tl.program_id(0), tl.program_id(1)
        mode = tl.load(plan_ptr + 2 * row + 1).to(tl.int32)
        # One-pass rows have their candidates (the stats pass): this pass skips them (mode 1 there).
        live = (mode > 0) & ~_one_pass(row, log_min_p_ptr, ONE_PASS)
        lo = split * chunk
        hi = lo
        m = tl.zeros([], tl.float32)
        t = tl.full([], 1.0, tl.float32)
        x0 = tl.full([], _POS_INF, tl.float32)  # mode 3: no candidates
        if live:
            m, ok, _ = _row_pivots(row, max_ptr, sum_ptr, num_ptr, log_min_p_ptr, num_splits, USE_MIN_P, S_PAD, P)
            m = tl.where(ok, m, 0.0)
            t = tl.load(temp_ptr + row)
            t = tl.where(t == 0.0, 1.0, t)
            x0 = tl.where(mode == 3, _POS_INF, _x_bound(tl.load(plan_ptr + 2 * row), t))
            hi = tl.minimum(lo + chunk, vocab_size)
        key = tl.load(keys_ptr + row).to(tl.uint32)
        base = x_ptr + row.to(tl.int64) * x_stride
        offs = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], _NEG_INF, tl.float32)
        best_idx = lo + offs
        total = tl.zeros([BLOCK], tl.float32)
        for start in range(lo, hi, BLOCK):
            v = start + offs
            x = tl.load(base + v, mask=v < hi, other=float("nan")).to(tl.float32)  # NaN: never taken
            _append(n_ptr, cand_x_ptr, cand_v_ptr, row, capacity, x, v, x >= x0)
            if mode >= 2:  # (uniform per row) s is needed for every token
                s = tl.math.div_rn(x, t)
                if mode == 2:
                    total += tl.where(s == s, tl.exp(s - m), 0.0)
                else:
                    val = tl.where(s == s, _gumbel_score(s, v, key), _NEG_INF)
                    best, best_idx = _lane_best(val, v, best, best_idx)
        _store_best(best_ptr, best_idx_ptr, row * num_splits + split, best, best_idx)
        tl.store(part_z_ptr + row * num_splits + split, tl.sum(total, 0))

    @triton.jit(do_not_specialize=["vocab_size", "chunk", "num_splits"])
    def _compact_kernel(x_ptr, x_stride, temp_ptr, keys_ptr, max_ptr, sum_ptr, num_ptr, log_min_p_ptr, top_k_ptr,
                        top_p_ptr, piv_ptr, cnt_ptr, mass_ptr, flag_ptr, n_ptr, cand_s_ptr, cand_v_ptr, best_ptr,
                        best_idx_ptr, vocab_size, chunk, num_splits, capacity, USE_TOP_K: tl.constexpr,
                        USE_TOP_P: tl.constexpr, USE_MIN_P: tl.constexpr, S_PAD: tl.constexpr, P: tl.constexpr,
                        BLOCK: tl.constexpr):
        # Program (row, split), tiers 1 and 2: appends its tokens in [c, hi) or A to the row's
        # candidates and draws among its tokens >= hi (all kept): that best score and id.
        row, split = tl.program_id(0), tl.program_id(1)
        flag = tl.load(flag_ptr + row)
        if _finishes(flag):
            m, ok, _ = _row_pivots(row, max_ptr, sum_ptr, num_ptr, log_min_p_ptr, num_splits, USE_MIN_P, S_PAD, P)
            k, k_on, top_p, p_on = _row_params(row, top_k_ptr, top_p_ptr, vocab_size, USE_TOP_K, USE_TOP_P)
            cnt, mass = _pivot_sums(row, cnt_ptr, mass_ptr, num_splits, S_PAD, P)
            piv = tl.load(piv_ptr + row * P + tl.arange(0, P))
            close = flag != 1  # tier 2 closes its single-valued windows
            c, hi_s, a_lo, a_hi, _, _, _, _, _ = _windows(piv, cnt, mass, k, k_on, top_p, p_on, close, m, P)
            t = tl.load(temp_ptr + row)
            t = tl.where(t == 0.0, 1.0, t)
            key = tl.load(keys_ptr + row).to(tl.uint32)
            base = x_ptr + row.to(tl.int64) * x_stride
            offs = tl.arange(0, BLOCK)
            lo = split * chunk
            hi = tl.where(ok, tl.minimum(lo + chunk, vocab_size), lo)
            best = tl.full([BLOCK], _NEG_INF, tl.float32)
            best_idx = lo + offs
            for start in range(lo, hi, BLOCK):
                v = start + offs
                s = _scaled(base, v, hi, t)
                take = (v < hi) & (((s >= c) & (s < hi_s)) | ((s >= a_lo) & (s < a_hi)))
                _append(n_ptr, cand_s_ptr, cand_v_ptr, row, capacity, s, v, take)
                sure = (v < hi) & (s >= hi_s)
                if tl.max(sure.to(tl.int32), 0) > 0:  # the Gumbel noise only where a kept-for-sure token is
                    val = tl.where(sure, _gumbel_score(s, v, key), _NEG_INF)
                    best, best_idx = _lane_best(val, v, best, best_idx)
            _store_best(best_ptr, best_idx_ptr, row * num_splits + split, best, best_idx)

    @triton.jit
    def _select_windows(row, m, piv, s, e, plan_ptr, part_z_ptr, cnt_ptr, mass_ptr, num_splits, k, k_on, top_p, p_on,
                        flag, TIER: tl.constexpr, S_PAD: tl.constexpr, P: tl.constexpr):
        # -> (c, hi, a_lo, a_hi, a_on, cnt_above, fixed-point masses above A, of s >= t_min_p, above
        # hi, mode). Tier 0: A = [g, +inf), every token >= g is a candidate, none above; mass(s >=
        # t_min_p) is the candidates' (g = t_min_p) or the guess pass's total (mode 2: t_min_p = -inf).
        if TIER == 0:
            c = tl.load(plan_ptr + 2 * row)
            mode = tl.load(plan_ptr + 2 * row + 1).to(tl.int32)
            j = tl.arange(0, S_PAD)
            total = tl.sum(tl.load(part_z_ptr + row * num_splits + j, mask=j < num_splits, other=0.0), 0)
            # (one-pass rows also hold candidates below t_min_p, appended under a lower running max)
            t_min_p = _at(tl.arange(0, P), 0, piv)
            min_p_fx = tl.where(mode == 2, (total * _FIXED).to(tl.int64), tl.sum(tl.where(s >= t_min_p, e, 0), 0))
            above_fx, hi_fx, a_on, cnt_above = tl.zeros([], tl.int64), tl.zeros([], tl.int64), k_on, 0
            hi, a_lo = tl.where(mode == 3, _NEG_INF, _POS_INF), tl.where(k_on, c, _POS_INF)
            a_hi = tl.full([], _POS_INF, tl.float32)
        else:
            cnt, mass = _pivot_sums(row, cnt_ptr, mass_ptr, num_splits, S_PAD, P)
            c, hi, a_lo, a_hi, a_on, cnt_above, mass_above, mass_min_p, mass_hi = _windows(
                piv, cnt, mass, k, k_on, top_p, p_on, flag != 1, m, P)
            above_fx, min_p_fx = (mass_above * _FIXED).to(tl.int64), (mass_min_p * _FIXED).to(tl.int64)
            hi_fx, mode = (mass_hi * _FIXED).to(tl.int64), 1
        return c, hi, a_lo, a_hi, a_on, cnt_above, above_fx, min_p_fx, hi_fx, mode

    @triton.jit
    def _select_kernel(temp_ptr, keys_ptr, arg_ptr, nan_ptr, max_ptr, sum_ptr, num_ptr, log_min_p_ptr, top_k_ptr,
                       top_p_ptr, piv_ptr, cnt_ptr, mass_ptr, plan_ptr, part_z_ptr, n_ptr, cand_s_ptr, cand_v_ptr,
                       best_ptr, best_idx_ptr, thr_ptr, tok_ptr, flag_ptr, vocab_size, num_splits, capacity,
                       TIER: tl.constexpr, USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr, USE_MIN_P: tl.constexpr,
                       S_PAD: tl.constexpr, P: tl.constexpr, CAP: tl.constexpr):
        # Program row: the exact threshold and token from the candidates (greedy rows: argmax). Tier 0 serves
        # every row it can prove (else flag 1, count reset); TIER 1 finishes tiers 1 and 2 (3: the fallback).
        row = tl.program_id(0)
        if TIER == 0:  # every row (tier 0 runs first): its _store_flag writes every row's flag, so no memset
            flag = tl.zeros([], tl.int32)
            active = flag == 0
        else:
            flag = tl.load(flag_ptr + row)
            active = _finishes(flag)
        if active:
            m, ok, piv = _row_pivots(row, max_ptr, sum_ptr, num_ptr, log_min_p_ptr, num_splits, USE_MIN_P, S_PAD, P)
            if TIER != 0:
                piv = tl.load(piv_ptr + row * P + tl.arange(0, P))
            k, k_on, top_p, p_on = _row_params(row, top_k_ptr, top_p_ptr, vocab_size, USE_TOP_K, USE_TOP_P)
            n = tl.load(n_ptr + row)
            i = tl.arange(0, CAP)
            s = tl.load(cand_s_ptr + row * capacity + i, mask=i < n, other=float("nan"))  # NaN fails every test
            if TIER == 0:  # tier 0 stores the raw logits: s = x / T here, for the candidates only
                t = tl.load(temp_ptr + row)
                s = tl.math.div_rn(s, tl.where(t == 0.0, 1.0, t))
            v = tl.load(cand_v_ptr + row * capacity + i, mask=i < n, other=0)
            key = _ordered_key(s).to(tl.int64)
            # Masses in 2**-40 fixed point: integer sums do not depend on the (racy) order in
            # which the compaction appended the candidates, so seeded draws are deterministic.
            e = (tl.where(s == s, tl.exp(s - tl.where(ok, m, 0.0)), 0.0) * _FIXED).to(tl.int64)
            c, hi, a_lo, a_hi, a_on, cnt_above, above_fx, min_p_fx, hi_fx, mode = _select_windows(
                row, m, piv, s, e, plan_ptr, part_z_ptr, cnt_ptr, mass_ptr, num_splits, k, k_on, top_p, p_on, flag,
                TIER, S_PAD, P)
            top = _ordered_key(tl.where(ok, m, 0.0)).to(tl.int64) + 1  # every candidate's key is below
            # k-th largest: count(s >= t) = cnt_above + count of A-candidates in [t, a_hi).
            in_a = (s >= a_lo) & (s < a_hi)
            kth = _key_to_float(_lift(key, in_a.to(tl.int32), _ordered_key(a_lo).to(tl.int64),
                                      tl.minimum(_ordered_key(a_hi).to(tl.int64), top), k - cnt_above))
            t_min_p = _at(tl.arange(0, P), 0, piv)
            kth = tl.where(a_on, kth, _NEG_INF)
            z = tl.where(kth > t_min_p, above_fx + tl.sum(tl.where(in_a & (s >= kth), e, 0), 0), min_p_fx)
            # top-p in [c, hi): mass(s >= t) = mass(s >= hi) + the candidates' mass in [t, hi).
            need = (top_p * z.to(tl.float32)).to(tl.int64) - hi_fx
            w = tl.where((s >= c) & (s < hi), e, 0)
            c_key = _ordered_key(c).to(tl.int64)
            t_p = _key_to_float(_lift(key, w, c_key, tl.where(p_on, tl.minimum(_ordered_key(hi).to(tl.int64), top),
                                                              c_key), need))
            thr = tl.where(p_on, tl.maximum(tl.maximum(t_min_p, kth), t_p), tl.maximum(t_min_p, kth))
            tok = _draw(s, v, thr, hi, tl.load(keys_ptr + row).to(tl.uint32), best_ptr, best_idx_ptr, row,
                        num_splits, S_PAD)
            greedy = tl.load(temp_ptr + row) == 0.0
            tl.store(thr_ptr + row, thr)
            tl.store(tok_ptr + row, tl.where(greedy, _greedy(row, max_ptr, arg_ptr, nan_ptr, num_splits, S_PAD), tok))
            _store_flag(row, flag_ptr, n_ptr, flag, ok, n, mode, thr, c, a_on, k, t_min_p, p_on, tl.sum(w, 0), need,
                        TIER, CAP)

    @triton.jit
    def _store_flag(row, flag_ptr, n_ptr, flag, ok, n, mode, thr, c, a_on, k, t_min_p, p_on, w_sum, need,
                    TIER: tl.constexpr, CAP: tl.constexpr):
        # The row's tier after select: tier 0 keeps it (flag 0) only if proven, else hands it to the pivots.
        if TIER == 0:
            # Proven only if every kept token was a candidate and each threshold came from them.
            fine = (mode > 0) & (n <= CAP) & (thr >= c) & (~a_on | (n >= k) | (c <= t_min_p))
            fine = fine & (~p_on | (w_sum >= need))
            tl.store(flag_ptr + row, tl.where(fine, 0, 1))
            tl.store(n_ptr + row, 0, mask=~fine)  # the pivot tier appends from 0
        else:
            tl.store(flag_ptr + row, tl.where(~ok | (n > CAP), _FALLBACK, tl.where(flag == 1, 1, _REFINED)))


def _layout(x: torch.Tensor, block: int | None, splits: int | None) -> tuple[int, int, int]:
    """(block, chunk, splits): V is cut into `splits` chunks of whole blocks, one program each."""
    num_rows, vocab_size = x.shape
    blk = ts._block(vocab_size, block if block is not None else _BLOCK)
    num_blocks = -(-vocab_size // blk)
    if splits is None:
        splits = -(-_PROGRAMS_PER_SM * ts._target_programs(x.device) // 2 // num_rows)
    splits = max(1, min(splits, num_blocks))
    chunk = -(-num_blocks // splits) * blk
    return blk, chunk, -(-vocab_size // chunk)


def _buckets(blk: int, num_splits: int) -> int:
    """Bucket maxima per stats program: a power of two <= blk, about _GUESS_BUCKETS per row."""
    per_split = max(1, _GUESS_BUCKETS // num_splits)
    return min(blk, 1 << (per_split.bit_length() - 1))


def pivot_sample_triton(
    x: torch.Tensor,  # [R, V] float32 logits (processed, unscaled), unit stride
    temperature: torch.Tensor,  # [R] float32, 0 = greedy: the token is argmax(x) (torch.argmax's, NaN first)
    keys: torch.Tensor,  # [R] int64: rng.row_keys(seed, position)
    top_k: torch.Tensor,  # [R] int32, 0 = off
    top_p: torch.Tensor,  # [R] float32, 1 = off
    min_p: torch.Tensor,  # [R] float32, 0 = off
    use_top_k: bool,
    use_top_p: bool,
    use_min_p: bool,
    out: torch.Tensor,  # [R] int32 | int64: the sampled token, written in place
    threshold: torch.Tensor,  # [R] float32: the filter threshold on x / T, written in place
    *,
    capacity: int | None = None,
    block: int | None = None,
    splits: int | None = None,
    reject: bool = True,
    segment: int | None = None,
) -> torch.Tensor:  # [R] int32: which tier served the row: -1 reject, 0 guess, 1 pivots, 2 refined, 3 fallback
    """Sample `argmax(x/T >= threshold ? x/T + gumbel : -inf)` with the filters' exact threshold.

    The threshold of triton_sampling.sampling_threshold and the token of gumbel_argmax with
    it (greedy rows: torch.argmax(x)), tier by tier (module docstring). Returns the tiers.
    A row served by tier -1 (pivot_reject.py) gets the same token without its threshold: NaN there.
    `capacity` (a power of two), `block`, `splits`, `segment` (tiles per bound update of the one-pass
    stats, default _SEGMENT) and `reject` (False: tier -1 skipped, so that its rows reach tiers 1-3)
    are exposed for tests.
    """
    ts._require_triton()
    capacity = DEFAULT_CAPACITY if capacity is None else capacity
    num_rows, vocab_size = ts._check_logits(x)
    ts._check_rows(num_rows, temperature=temperature, keys=keys, top_k=top_k, top_p=top_p, min_p=min_p, out=out,
                threshold=threshold)
    check_tensor("threshold", threshold, (num_rows,), (torch.float32,))
    check_tensor("out", out, (num_rows,), (torch.int32, torch.int64))
    if capacity < 16 or capacity & (capacity - 1):
        raise ValueError(f"capacity={capacity} must be a power of two >= 16")
    blk, chunk, num_splits = _layout(x, block, splits)
    bufs = _scratch(num_rows, num_splits, _buckets(blk, num_splits), capacity, x.device)
    flags, fast = bufs["flags"], bufs["fast"]  # [R] each: written for every row by tier 0's select
    log_min_p = torch.log(min_p)  # [R]: in torch, bit-identical to filters.min_p_threshold
    _launch_tiers(x, temperature, keys, top_k, top_p, log_min_p, (use_top_k, use_top_p, use_min_p), threshold, bufs,
                  blk, chunk, num_splits, capacity, reject,
                  _SEGMENT if segment is None else segment)
    # Fallback for flagged rows only (a few microseconds of empty programs when none is).
    ts.sampling_threshold_triton(x, temperature, top_k, top_p, min_p, use_top_k, use_top_p, use_min_p, threshold,
                              block=block, flags=flags, min_flag=TIER_FALLBACK, log_min_p=log_min_p)
    # out: the fallback's draw for rows flagged 3 (not greedy), the tiers' token for the others.
    ts.gumbel_argmax_triton(x, temperature, keys, threshold, out, block=block, flags=flags, min_flag=TIER_FALLBACK,
                            fast=fast)
    return flags


def _scratch(num_rows: int, num_splits: int, nb: int, capacity: int, dev: torch.device) -> dict[str, torch.Tensor]:
    """The tiers' buffers, sized by R, S, C only; only num_cand is zero-filled (one memset node): each
    other is written before it is read, by a kernel that runs for every row or by the tier that reads it."""
    f32, i32 = torch.float32, torch.int32
    kinds = dict(max=f32, arg=i32, nan=i32, sum=f32, num=i32, low=f32, best=f32, best_idx=i32, z=f32, draw=f32,
                 draw_idx=i32)
    bufs = {name: torch.empty(num_rows, num_splits, dtype=dt, device=dev) for name, dt in kinds.items()}  # [R, S]
    return bufs | dict(
        bucket_max=torch.empty(num_rows, num_splits * nb, dtype=f32, device=dev),  # [R, S * NB]
        plan=torch.empty(num_rows, 2, dtype=f32, device=dev),  # [R, (g, mode)]
        piv=torch.empty(num_rows, NUM_PIVOTS, dtype=f32, device=dev),  # [R, P]: tier 1's, then tier 2's
        cnt=torch.empty(num_rows, num_splits, NUM_PIVOTS, dtype=i32, device=dev),  # [R, S, P]
        mass=torch.empty(num_rows, num_splits, NUM_PIVOTS, dtype=f32, device=dev),  # [R, S, P]
        reject_cnt=torch.empty(num_rows, num_splits, 2, dtype=i32, device=dev),  # [R, S, (>, min-p)]: tier -1
        reject_mass=torch.empty(num_rows, num_splits, 3, dtype=f32, device=dev),  # [R, S, (>, >=, min-p)]
        num_cand=torch.empty(num_rows, dtype=i32, device=dev),  # [R]: zeroed first, appended by atomics
        cand_s=torch.empty(num_rows, capacity, dtype=f32, device=dev),  # [R, C]: x in tier 0, x / T in tier 1
        cand_v=torch.empty(num_rows, capacity, dtype=i32, device=dev),  # [R, C]
        flags=torch.empty(num_rows, dtype=i32, device=dev),  # [R]: the tiers (module docstring)
        fast=torch.empty(num_rows, dtype=i32, device=dev),  # [R]: the tiers' token
    )


def _launch_tiers(x, temperature, keys, top_k, top_p, log_min_p, use, threshold, b, blk, chunk, num_splits, capacity,
                  reject, segment) -> None:
    """The kernels of the module docstring, in its order; b: the buffers of _scratch."""
    num_rows, vocab_size = x.shape
    nb = _buckets(blk, num_splits)
    flags, num_cand, cand_s, cand_v, piv, cnt, mass = (b[n] for n in ("flags", "num_cand", "cand_s", "cand_v", "piv",
                                                                      "cnt", "mass"))
    row_args = (b["max"], b["sum"], b["num"], log_min_p)
    flt = dict(USE_TOP_K=use[0], USE_TOP_P=use[1], USE_MIN_P=use[2])
    shape = dict(S_PAD=split_pad(num_splits), P=NUM_PIVOTS)
    grid = (num_rows, num_splits)
    draws = (b["best"], b["best_idx"])
    select = (temperature, keys, b["arg"], b["nan"], *row_args, top_k, top_p, piv, cnt, mass, b["plan"], b["z"],
              num_cand, cand_s, cand_v, *draws, threshold, b["fast"], flags, vocab_size, num_splits, capacity)
    # One pass for min-p rows where each program has >= 2 segments (few rows, many splits: a segment's
    # max over a short chunk is a loose bound, too many candidates; those rows take the guess pass).
    one_pass = use[2] and chunk // blk >= 2 * segment
    num_cand.zero_()  # [R]: the stats pass (one-pass rows) and the guess pass append to it
    _stats_kernel[grid](x, x.stride(0), temperature, log_min_p, num_cand, cand_s, cand_v, b["max"], b["arg"],
                        b["nan"], b["sum"], b["num"], b["low"], b["bucket_max"], vocab_size, chunk, capacity,
                        ONE_PASS=one_pass, SEGMENT=segment, BLOCK=blk, NB=nb, UNROLL=_STATS_UNROLL,
                        num_warps=_NUM_WARPS)
    _plan_kernel[(num_rows,)](*row_args, b["bucket_max"], top_k, top_p, b["plan"], piv, vocab_size,
                              num_splits, nb, BUCKETS=triton.next_power_of_2(num_splits * nb), ONE_PASS=one_pass,
                              num_warps=_NUM_WARPS, **flt, **shape)
    # Tier 0, the guess: every row but one-pass rows; its select writes every row's flag: 0 proven, else 1.
    _guess_kernel[grid](x, x.stride(0), temperature, keys, *row_args, b["plan"], num_cand, cand_s, cand_v, *draws,
                        b["z"], vocab_size, chunk, num_splits, capacity, USE_MIN_P=use[2], ONE_PASS=one_pass,
                        BLOCK=blk, num_warps=_NUM_WARPS, **shape)
    _select_kernel[(num_rows,)](*select, TIER=0, CAP=min(capacity, GUESS_CAPACITY), num_warps=_NUM_WARPS, **flt,
                                **shape)
    if reject:  # tier -1, rows flagged 1 only: those whose unfiltered draw is proven kept take it (flag -1)
        serve_draws(x, temperature, keys, row_args, b["nan"], b["plan"], top_k, top_p, flags, b["fast"], threshold,
                    (b["draw"], b["draw_idx"], b["reject_cnt"], b["reject_mass"]), chunk, num_splits, blk, flt)
    # Tiers 1 and 2, the pivots and their refinement: rows still flagged 1 only (other programs return at once).
    count_and_refine(x, temperature, row_args, b["low"], top_k, top_p, piv, cnt, mass, flags, chunk, num_splits,
                     capacity, blk, flt)
    _compact_kernel[grid](x, x.stride(0), temperature, keys, *row_args, top_k, top_p, piv, cnt, mass, flags, num_cand,
                          cand_s, cand_v, *draws, vocab_size, chunk, num_splits, capacity, BLOCK=blk,
                          num_warps=_NUM_WARPS, **flt, **shape)
    _select_kernel[(num_rows,)](*select, TIER=1, CAP=capacity, num_warps=_NUM_WARPS, **flt, **shape)
