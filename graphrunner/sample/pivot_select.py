"""Sort-free min-p / top-k / top-p sampling in three reads of the logits (Triton).

The exact threshold of filters.filter_threshold and the Gumbel-max token of
triton_sampling.gumbel_argmax, without a sort and without 32 serial passes over V:
every row is split over several programs, and each stage reads the logits once.
(Measured on an H100, 256 rows x 152k: 0.53 ms for temperature + top-k + top-p + min-p,
against 5.1 ms for the one-program-per-row bisection and 5.5 ms for the sort; see
docs/bench/sampler_pivot_h100.md for the numbers and where the time goes.)

1. stats   (R x S programs): per V-tile max of s = x / T (NaN skipped) with its first
   id, the first NaN id (so greedy rows get torch.argmax), sum and count of finite s.
2. pivots  (R x S): counts and masses exp(s - M) at P per-row pivots: column 0 is the
   min-p threshold, columns 1..P-2 a ladder `M - spread * j / (P-2)` (spread = M minus
   the mean of s, so the ladder follows the row's own scale, whatever T is), column
   P-1 is -inf (the totals).
3. compact (R x S): from those counts every program derives the same windows
   (`_windows`): A, the ladder bracket holding the k-th largest value; [c, hi), the
   brackets that can hold the final threshold. Tokens in A or [c, hi) are appended
   (value, id) to a per-row candidate buffer of `capacity` entries; tokens >= hi are
   kept for sure, so the program draws among them itself (best s + gumbel, first id).
4. select  (R programs): sums masses in 2**-40 fixed point (integer sums do not depend
   on the racy order of the candidates: seeded draws are deterministic), finds the
   k-th value, the base b = max(min-p, top-k), its mass Z' and the top-p threshold by
   binary lifting over int32 order keys restricted to the candidates, then takes the
   best of the kept candidates and of the compaction's draws (rng.py's noise, bit for bit).

Tie rule, shared with filters.py and the sort reference of the tests: every token tied
with the last kept value is kept (the kept set is `s >= threshold`).

Exactness. Counts are integers and the pivots are compared in the same float32 in every
kernel, so the windows always hold the k-th value and every kept token; min-p and top-k
thresholds are bit-identical to filters.py. Top-p masses are float32 / fixed-point sums
in another order than torch's: the boundary can move only across tokens whose prefix
mass is within rounding (~1e-6 relative) of top_p * Z' (the same caveat as
triton_sampling). The pivot masses are float32 sums over tiles whose number depends on
R, so in such a rounding tie a seeded row's top-p boundary can also depend on the batch
size (as torch's own reductions can); min-p, top-k and the noise never do.

Rows the fast path does not serve: more candidates than `capacity` (brackets wider than
the ladder resolves: flat rows with top_p near 1, k beyond the mean), or a non-finite
max or spread (a row of only -inf, +inf logits). Their flag is 2 and the previous
kernels of triton_sampling finish them (one-program bisection, then the Gumbel pass),
launched for every row but returning at once for unflagged ones; so their outcome is
unchanged (an all -inf row draws token 0) but such a row costs ~3 ms. NaN entries are
skipped, as in triton_sampling.

Everything is sized by R, V and `capacity` and never syncs with the host: graph-safe.
"""

from __future__ import annotations

import torch

from graphrunner.kernels import HAS_TRITON, check_tensor

__all__ = ["DEFAULT_CAPACITY", "NUM_PIVOTS", "pivot_sample_triton"]

NUM_PIVOTS = 16  # min-p column + 14 ladder steps + the -inf totals: a [16, BLOCK] compare per step
DEFAULT_CAPACITY = 8192  # candidates per row (64 KiB of value, id); 4096 overflows at top_p 0.95
_BLOCK = 1024  # vocab entries per loop step of the streaming kernels (2048: +5%, 4096: +30% at 256 rows)
_PIVOT_WARPS = 4  # the pivot kernel's tile is [P, tokens per warp x warps]
_PIVOT_TOKENS_PER_WARP = 128  # 4 tokens x P pivots per thread
_PROGRAMS_PER_SM = 4  # streaming programs per SM (the fastest of 4, 8, 16 on an H100)
_NUM_WARPS = 8

if HAS_TRITON:
    import triton
    import triton.language as tl

    # Shared with the fused kernels, so the noise and the keys are the same code.
    from graphrunner.sample.triton_sampling import _GOLDEN, _hash32, _key_to_float, _ordered_key, _scaled

    _NEG_INF = tl.constexpr(float("-inf"))
    _FIXED = tl.constexpr(float(2**40))  # fixed-point unit of the select kernel's masses
    _POS_INF = tl.constexpr(float("inf"))

    @triton.jit(do_not_specialize=["vocab_size", "chunk"])
    def _stats_kernel(x_ptr, x_stride, temp_ptr, max_ptr, arg_ptr, nan_ptr, sum_ptr, num_ptr, vocab_size, chunk,
                      BLOCK: tl.constexpr):
        # Program (row, split), over its tile: max of s (NaN skipped) and its first id, the
        # first NaN id (greedy rows take it, as torch.argmax), sum and count of finite s.
        row, split = tl.program_id(0), tl.program_id(1)
        out = row * tl.num_programs(1) + split
        temp = tl.load(temp_ptr + row)
        t = tl.where(temp == 0.0, 1.0, temp)
        base = x_ptr + row.to(tl.int64) * x_stride
        offs = tl.arange(0, BLOCK)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, vocab_size)
        peak = tl.full([BLOCK], _NEG_INF, tl.float32)
        arg = lo + offs
        first_nan = tl.full([BLOCK], 2147483647, tl.int32)
        total = tl.zeros([BLOCK], tl.float32)
        count = tl.zeros([BLOCK], tl.int32)
        for start in range(lo, hi, BLOCK):
            v = start + offs
            s = _scaled(base, v, hi, t)
            better = s > peak  # strict: the first id of a tie within a lane
            peak = tl.where(better, s, peak)
            arg = tl.where(better, v, arg)
            first_nan = tl.minimum(first_nan, tl.where((s != s) & (v < hi), v, 2147483647))
            finite = (s > _NEG_INF) & (s < _POS_INF)
            total += tl.where(finite, s, 0.0)
            count += finite.to(tl.int32)
        best = tl.max(peak, 0)
        tl.store(max_ptr + out, best)
        tl.store(arg_ptr + out, tl.min(tl.where(peak == best, arg, 2147483647), 0))
        tl.store(nan_ptr + out, tl.min(first_nan, 0))
        tl.store(sum_ptr + out, tl.sum(total, 0))
        tl.store(num_ptr + out, tl.sum(count, 0))

    @triton.jit
    def _greedy(row, max_ptr, arg_ptr, nan_ptr, num_splits, S_PAD: tl.constexpr):
        # torch.argmax of the row: its first NaN, else the first id of its max (0 if all -inf).
        j = tl.arange(0, S_PAD)
        on = j < num_splits
        peak = tl.load(max_ptr + row * num_splits + j, mask=on, other=_NEG_INF)
        arg = tl.load(arg_ptr + row * num_splits + j, mask=on, other=2147483647)
        first_nan = tl.min(tl.load(nan_ptr + row * num_splits + j, mask=on, other=2147483647), 0)
        first_max = tl.min(tl.where(peak == tl.max(peak, 0), arg, 2147483647), 0)
        return tl.where(first_nan < 2147483647, first_nan, first_max)

    @triton.jit
    def _row_pivots(row, max_ptr, sum_ptr, num_ptr, log_min_p_ptr, num_splits,
                    USE_MIN_P: tl.constexpr, S_PAD: tl.constexpr, P: tl.constexpr):
        # -> (M, ok, pivots [P]): the same float32 values in every kernel that calls it.
        j = tl.arange(0, S_PAD)
        on = j < num_splits
        m = tl.max(tl.load(max_ptr + row * num_splits + j, mask=on, other=_NEG_INF), 0)
        total = tl.sum(tl.load(sum_ptr + row * num_splits + j, mask=on, other=0.0), 0)
        count = tl.sum(tl.load(num_ptr + row * num_splits + j, mask=on, other=0), 0)
        spread = m - total / tl.maximum(count, 1).to(tl.float32)
        ok = (m > _NEG_INF) & (m < _POS_INF) & (spread >= 0.0) & (spread < _POS_INF)
        t_min_p = tl.full([], _NEG_INF, tl.float32)
        if USE_MIN_P:
            t_min_p = m + tl.load(log_min_p_ptr + row)
        p = tl.arange(0, P)
        ladder = m - spread * (p.to(tl.float32) / (P - 2))
        piv = tl.where(p == 0, t_min_p, tl.where(p == P - 1, _NEG_INF, ladder))
        return m, ok, piv

    @triton.jit(do_not_specialize=["vocab_size", "chunk", "num_splits"])
    def _pivot_kernel(x_ptr, x_stride, temp_ptr, max_ptr, sum_ptr, num_ptr, log_min_p_ptr, cnt_ptr, mass_ptr,
                      vocab_size, chunk, num_splits, USE_MIN_P: tl.constexpr, S_PAD: tl.constexpr,
                      P: tl.constexpr, BLOCK: tl.constexpr):
        # Program (row, split): per pivot, how many s >= pivot in its tile and their exp(s - M).
        # The tile is [P, BLOCK] with BLOCK = 4 x 32 x num_warps: each thread keeps all P
        # pivots of its own tokens, so s is never broadcast across threads.
        row, split = tl.program_id(0), tl.program_id(1)
        m, ok, piv = _row_pivots(row, max_ptr, sum_ptr, num_ptr, log_min_p_ptr, num_splits, USE_MIN_P, S_PAD, P)
        m = tl.where(ok, m, 0.0)
        temp = tl.load(temp_ptr + row)
        t = tl.where(temp == 0.0, 1.0, temp)
        base = x_ptr + row.to(tl.int64) * x_stride
        offs = tl.arange(0, BLOCK)
        lo = split * chunk
        hi = tl.where(ok, tl.minimum(lo + chunk, vocab_size), lo)  # rows left to the fallback: no work
        cnt = tl.zeros([P, BLOCK], tl.float32)  # float: exact below 2**24 per lane, one FADD
        mass = tl.zeros([P, BLOCK], tl.float32)
        for start in range(lo, hi, BLOCK):
            v = start + offs
            # NaN past the end (and NaN logits) fail every comparison: no separate mask.
            x = tl.load(base + v, mask=v < hi, other=float("nan")).to(tl.float32)
            s = tl.math.div_rn(x, t)
            e = tl.where(s == s, tl.exp(s - m), 0.0)  # 0 * NaN would poison the sums
            ge = tl.where(s[None, :] >= piv[:, None], 1.0, 0.0)  # [P, BLOCK]
            cnt += ge
            mass += ge * e[None, :]
        out = (row * num_splits + split) * P + tl.arange(0, P)
        tl.store(cnt_ptr + out, tl.sum(cnt, 1).to(tl.int32))
        tl.store(mass_ptr + out, tl.sum(mass, 1))

    @triton.jit
    def _at(p, j, vals):
        # vals[j] for a scalar j (0 when j is outside [0, P)).
        return tl.sum(tl.where(p == j, vals, 0).to(vals.dtype), 0)

    @triton.jit
    def _windows(row, piv, cnt_ptr, mass_ptr, num_splits, k, k_on, top_p, p_on, S_PAD: tl.constexpr, P: tl.constexpr):
        # One row's windows from the pivot counts (module docstring); every kernel gets the same.
        # -> (c, hi, a_lo, a_hi, a_on, cnt_above, mass_above, mass_min_p, mass_hi)
        sj = tl.arange(0, S_PAD)[:, None]
        p = tl.arange(0, P)
        on = sj < num_splits
        cnt = tl.sum(tl.load(cnt_ptr + (row * num_splits + sj) * P + p[None, :], mask=on, other=0), 0)  # [P]
        mass = tl.sum(tl.load(mass_ptr + (row * num_splits + sj) * P + p[None, :], mask=on, other=0.0), 0)
        ladder = (p >= 1) & (p <= P - 1)
        t_min_p = _at(p, 0, piv)
        mass_min_p = _at(p, 0, mass)
        # A: the ladder bracket [piv[jk], piv[jk - 1]) that holds the k-th largest value.
        jk = tl.min(tl.where(ladder & (cnt >= k), p, P), 0)
        a_on = k_on & (jk < P)
        a_lo = _at(p, jk, piv)
        a_hi = tl.where(jk >= 2, _at(p, jk - 1, piv), _POS_INF)
        cnt_above = tl.where(jk >= 2, _at(p, jk - 1, cnt), 0)
        mass_above = tl.where(jk >= 2, _at(p, jk - 1, mass), 0.0)
        a_on = a_on & (a_hi > t_min_p)  # else the k-th value is below t_min_p: A is not needed
        base = tl.where(a_on, tl.maximum(t_min_p, a_lo), t_min_p)  # <= b = max(t_min_p, k-th)
        # Z' = mass(s >= b) lies in [z_lo, z_hi]; so top-p's threshold lies in [piv[jp], piv[jq - 1]).
        z_hi = tl.where(a_on & (a_lo > t_min_p), _at(p, jk, mass), mass_min_p)
        z_lo = tl.where(a_on, tl.minimum(mass_min_p, mass_above), mass_min_p)
        jp = tl.min(tl.where(ladder & (mass >= top_p * z_hi), p, P - 1), 0)
        jq = tl.min(tl.where(ladder & (mass >= top_p * z_lo), p, P - 1), 0)
        # Tokens >= hi are kept for sure: the compaction draws among them itself.
        lowest_ge = tl.min(tl.where(ladder & (p < P - 1) & (piv >= t_min_p), piv, _POS_INF), 0)
        hi = tl.where(p_on, tl.where(jq >= 2, _at(p, jq - 1, piv), _POS_INF), tl.where(a_on, a_hi, lowest_ge))
        mass_hi = tl.where(p_on & (jq >= 2), _at(p, jq - 1, mass), 0.0)
        c = tl.where(p_on, tl.maximum(base, _at(p, jp, piv)), base)
        no_filter = ~k_on & ~p_on & (t_min_p == _NEG_INF)
        c = tl.where(no_filter, _NEG_INF, c)
        hi = tl.where(no_filter, _NEG_INF, hi)  # every token is kept: all drawn in the compaction
        a_lo = tl.where(a_on, a_lo, _POS_INF)
        a_hi = tl.where(a_on, a_hi, _POS_INF)
        return c, hi, a_lo, a_hi, a_on, cnt_above, mass_above, mass_min_p, mass_hi

    @triton.jit
    def _gumbel_score(s, v, key):
        # s + gumbel(key, v): rng.gumbel bit for bit (as in gumbel_argmax).
        bits = _hash32(key ^ (v.to(tl.uint32) * _GOLDEN))
        u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        return s + -tl.log(-tl.log(u))

    @triton.jit(do_not_specialize=["vocab_size", "chunk", "num_splits"])
    def _compact_kernel(x_ptr, x_stride, temp_ptr, keys_ptr, max_ptr, sum_ptr, num_ptr, log_min_p_ptr, top_k_ptr,
                        top_p_ptr, cnt_ptr, mass_ptr, n_ptr, cand_s_ptr, cand_v_ptr, best_ptr, best_idx_ptr,
                        vocab_size, chunk, num_splits, capacity, USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr,
                        USE_MIN_P: tl.constexpr, S_PAD: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr):
        # Program (row, split): appends its tokens in [c, hi) or A to the row's candidates and
        # draws among its tokens >= hi (all kept), writing that best score and id.
        row, split = tl.program_id(0), tl.program_id(1)
        m, ok, piv = _row_pivots(row, max_ptr, sum_ptr, num_ptr, log_min_p_ptr, num_splits, USE_MIN_P, S_PAD, P)
        k, k_on, top_p, p_on = _row_params(row, top_k_ptr, top_p_ptr, vocab_size, USE_TOP_K, USE_TOP_P)
        c, hi_s, a_lo, a_hi, _, _, _, _, _ = _windows(row, piv, cnt_ptr, mass_ptr, num_splits, k, k_on, top_p, p_on,
                                                      S_PAD, P)
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
            sure = (v < hi) & (s >= hi_s)
            at = tl.atomic_add(n_ptr + row + v * 0, 1, mask=take)  # a slot per candidate, in any order
            tl.store(cand_s_ptr + row * capacity + at, s, mask=take & (at < capacity))
            tl.store(cand_v_ptr + row * capacity + at, v, mask=take & (at < capacity))
            if tl.max(sure.to(tl.int32), 0) > 0:  # the Gumbel noise only where a kept-for-sure token is
                val = tl.where(sure, _gumbel_score(s, v, key), _NEG_INF)
                better = val > best  # strict: the first id of a tie within a lane
                best = tl.where(better, val, best)
                best_idx = tl.where(better, v, best_idx)
        peak = tl.max(best, 0)
        tl.store(best_ptr + row * num_splits + split, peak)
        tl.store(best_idx_ptr + row * num_splits + split, tl.min(tl.where(best == peak, best_idx, 2147483647), 0))

    @triton.jit
    def _row_params(row, top_k_ptr, top_p_ptr, vocab_size, USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr):
        # -> (k, k_on, top_p, p_on) with the off conventions of filters.py.
        k = tl.load(top_k_ptr + row)
        k_on = (k > 0) & (k < vocab_size) & USE_TOP_K
        top_p = tl.load(top_p_ptr + row)
        p_on = (top_p < 1.0) & USE_TOP_P
        return k, k_on, top_p, p_on

    @triton.jit
    def _lift(keys, weight, start, limit, need):
        # Largest int64 key t in [start, limit) with sum(weight[keys >= t]) >= need (start if none).
        # Steps that would leave [start, limit) skip their reduction.
        lo = start
        for i in range(32):
            cand = lo + (tl.full([], 1, tl.int64) << (31 - i))
            if cand < limit:
                got = tl.sum(tl.where(keys >= cand, weight, 0).to(weight.dtype), 0)
                lo = tl.where(got >= need, cand, lo)
        return lo

    @triton.jit
    def _select_kernel(temp_ptr, keys_ptr, arg_ptr, nan_ptr, max_ptr, sum_ptr, num_ptr, log_min_p_ptr, top_k_ptr,
                       top_p_ptr, cnt_ptr, mass_ptr, n_ptr, cand_s_ptr, cand_v_ptr, best_ptr, best_idx_ptr, thr_ptr,
                       tok_ptr, flag_ptr, vocab_size, num_splits, USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr,
                       USE_MIN_P: tl.constexpr, S_PAD: tl.constexpr, P: tl.constexpr, CAP: tl.constexpr):
        # Program row: the exact threshold and token from the candidates (greedy rows: argmax);
        # flag 2 = the fallback draws it (unless greedy).
        row = tl.program_id(0)
        m, ok, piv = _row_pivots(row, max_ptr, sum_ptr, num_ptr, log_min_p_ptr, num_splits, USE_MIN_P, S_PAD, P)
        k, k_on, top_p, p_on = _row_params(row, top_k_ptr, top_p_ptr, vocab_size, USE_TOP_K, USE_TOP_P)
        c, hi, a_lo, a_hi, a_on, cnt_above, mass_above, mass_min_p, mass_hi = _windows(
            row, piv, cnt_ptr, mass_ptr, num_splits, k, k_on, top_p, p_on, S_PAD, P)
        n = tl.load(n_ptr + row)
        i = tl.arange(0, CAP)
        s = tl.load(cand_s_ptr + row * CAP + i, mask=i < n, other=float("nan"))  # NaN fails every test
        v = tl.load(cand_v_ptr + row * CAP + i, mask=i < n, other=0)
        key = _ordered_key(s).to(tl.int64)
        # Masses in 2**-40 fixed point: integer sums do not depend on the (racy) order in
        # which the compaction appended the candidates, so seeded draws are deterministic.
        e = (tl.where(s == s, tl.exp(s - tl.where(ok, m, 0.0)), 0.0) * _FIXED).to(tl.int64)
        # k-th largest: count(s >= t) = cnt_above + count of A-candidates in [t, a_hi).
        in_a = (s >= a_lo) & (s < a_hi)
        kth = _key_to_float(_lift(key, in_a.to(tl.int32), _ordered_key(a_lo).to(tl.int64),
                                  _ordered_key(a_hi).to(tl.int64), k - cnt_above))
        t_min_p = tl.max(tl.where(tl.arange(0, P) == 0, piv, _NEG_INF), 0)
        kth = tl.where(a_on, kth, _NEG_INF)
        z = tl.where(kth > t_min_p, (mass_above * _FIXED).to(tl.int64) + tl.sum(tl.where(in_a & (s >= kth), e, 0), 0),
                     (mass_min_p * _FIXED).to(tl.int64))
        # top-p in [c, hi): mass(s >= t) = mass(s >= hi) + the candidates' mass in [t, hi).
        need = (top_p * z.to(tl.float32)).to(tl.int64) - (mass_hi * _FIXED).to(tl.int64)
        in_b = (s >= c) & (s < hi)
        c_key = _ordered_key(c).to(tl.int64)
        t_p = _key_to_float(_lift(key, tl.where(in_b, e, 0), c_key,
                                  tl.where(p_on, _ordered_key(hi).to(tl.int64), c_key), need))
        thr = tl.where(p_on, tl.maximum(tl.maximum(t_min_p, kth), t_p), tl.maximum(t_min_p, kth))
        tok = _draw(s, v, thr, hi, tl.load(keys_ptr + row).to(tl.uint32), best_ptr, best_idx_ptr, row, num_splits,
                    S_PAD)
        bisect = ~ok | (n > CAP)
        greedy = tl.load(temp_ptr + row) == 0.0
        tl.store(thr_ptr + row, thr)
        tl.store(tok_ptr + row, tl.where(greedy, _greedy(row, max_ptr, arg_ptr, nan_ptr, num_splits, S_PAD), tok))
        tl.store(flag_ptr + row, tl.where(bisect, 2, 0))

    @triton.jit
    def _draw(s, v, thr, hi, key, best_ptr, best_idx_ptr, row, num_splits, S_PAD: tl.constexpr):
        # argmax of s + gumbel over the kept candidates below hi and the compaction's draws
        # above it; the first id on ties, as torch.argmax.
        val = tl.where((s >= thr) & (s < hi), _gumbel_score(s, v, key), _NEG_INF)
        j = tl.arange(0, S_PAD)
        part = tl.load(best_ptr + row * num_splits + j, mask=j < num_splits, other=_NEG_INF)
        part_idx = tl.load(best_idx_ptr + row * num_splits + j, mask=j < num_splits, other=2147483647)
        best = tl.maximum(tl.max(val, 0), tl.max(part, 0))
        tok = tl.minimum(tl.min(tl.where((val == best) & (s >= thr) & (s < hi), v, 2147483647), 0),
                         tl.min(tl.where(part == best, part_idx, 2147483647), 0))
        return tl.where(tok == 2147483647, 0, tok)  # nothing kept (min_p > 1): token 0, like argmax


def _layout(x: torch.Tensor, block: int | None, splits: int | None) -> tuple[int, int, int]:
    """(block, chunk, splits): V is cut into `splits` chunks of whole blocks, one program each."""
    from graphrunner.sample.triton_sampling import _block, _target_programs

    num_rows, vocab_size = x.shape
    blk = _block(vocab_size, block if block is not None else _BLOCK)
    num_blocks = -(-vocab_size // blk)
    if splits is None:
        splits = -(-_PROGRAMS_PER_SM * _target_programs(x.device) // 2 // num_rows)
    splits = max(1, min(splits, num_blocks))
    chunk = -(-num_blocks // splits) * blk
    return blk, chunk, -(-vocab_size // chunk)


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
) -> torch.Tensor:  # [R] int32: 0 = served by the fast path, 2 = by the fallback kernels
    """Sample `argmax(x/T >= threshold ? x/T + gumbel : -inf)` with the filters' exact threshold.

    The same threshold as triton_sampling.sampling_threshold and the same token as
    gumbel_argmax with it (greedy rows: torch.argmax(x)), in three streaming passes plus
    one small per-row kernel (module docstring); rows it cannot serve go through those
    kernels, which skip the other rows. Returns which path served each row.
    `capacity` (a power of two), `block` and `splits` are exposed for tests.
    """
    from graphrunner.sample.triton_sampling import (
        _check_logits,
        _check_rows,
        _require_triton,
        gumbel_argmax_triton,
        sampling_threshold_triton,
    )

    _require_triton()
    capacity = DEFAULT_CAPACITY if capacity is None else capacity
    num_rows, vocab_size = _check_logits(x)
    _check_rows(num_rows, temperature=temperature, keys=keys, top_k=top_k, top_p=top_p, min_p=min_p, out=out,
                threshold=threshold)
    check_tensor("threshold", threshold, (num_rows,), (torch.float32,))
    check_tensor("out", out, (num_rows,), (torch.int32, torch.int64))
    if capacity < 16 or capacity & (capacity - 1):
        raise ValueError(f"capacity={capacity} must be a power of two >= 16")
    blk, chunk, num_splits = _layout(x, block, splits)
    flags = torch.empty(num_rows, dtype=torch.int32, device=x.device)  # [R]
    fast = torch.empty(num_rows, dtype=torch.int32, device=x.device)  # [R]
    _launch_fast_path(x, temperature, keys, top_k, top_p, min_p, (use_top_k, use_top_p, use_min_p), threshold, fast,
                      flags, blk, chunk, num_splits, capacity)
    # Fallback for flagged rows only (a few microseconds of empty programs when none is).
    sampling_threshold_triton(x, temperature, top_k, top_p, min_p, use_top_k, use_top_p, use_min_p, threshold,
                              block=block, flags=flags, min_flag=2)
    drawn = torch.empty(num_rows, dtype=torch.int64, device=x.device)  # [R]
    gumbel_argmax_triton(x, temperature, keys, threshold, drawn, block=block, flags=flags, min_flag=1)
    out.copy_(torch.where((flags > 0) & (temperature != 0.0), drawn, fast.long()))
    return flags


def _launch_fast_path(x, temperature, keys, top_k, top_p, min_p, use, threshold, fast, flags, blk, chunk, num_splits,
                      capacity) -> None:
    """The four kernels of the module docstring; their scratch buffers are sized by R, S, C only."""
    num_rows, vocab_size = x.shape
    dev, f32, i32 = x.device, torch.float32, torch.int32
    part_max = torch.empty(num_rows, num_splits, dtype=f32, device=dev)  # [R, S]
    part_arg = torch.empty(num_rows, num_splits, dtype=i32, device=dev)  # [R, S]: first id of the max
    part_nan = torch.empty(num_rows, num_splits, dtype=i32, device=dev)  # [R, S]: first NaN id
    part_sum = torch.empty(num_rows, num_splits, dtype=f32, device=dev)  # [R, S]
    part_num = torch.empty(num_rows, num_splits, dtype=i32, device=dev)  # [R, S]
    cnt = torch.empty(num_rows, num_splits, NUM_PIVOTS, dtype=i32, device=dev)  # [R, S, P]
    mass = torch.empty(num_rows, num_splits, NUM_PIVOTS, dtype=f32, device=dev)  # [R, S, P]
    num_cand = torch.zeros(num_rows, dtype=i32, device=dev)  # [R]: appended by atomics
    cand_s = torch.empty(num_rows, capacity, dtype=f32, device=dev)  # [R, C]
    cand_v = torch.empty(num_rows, capacity, dtype=i32, device=dev)  # [R, C]
    best = torch.empty(num_rows, num_splits, dtype=f32, device=dev)  # [R, S]: draws among sure tokens
    best_idx = torch.empty(num_rows, num_splits, dtype=i32, device=dev)  # [R, S]
    log_min_p = torch.log(min_p)  # [R]: in torch, bit-identical to filters.min_p_threshold
    row_args = (part_max, part_sum, part_num, log_min_p)
    flt = dict(USE_TOP_K=use[0], USE_TOP_P=use[1], USE_MIN_P=use[2])
    shape = dict(S_PAD=triton.next_power_of_2(num_splits), P=NUM_PIVOTS)
    grid = (num_rows, num_splits)
    _stats_kernel[grid](x, x.stride(0), temperature, part_max, part_arg, part_nan, part_sum, part_num, vocab_size,
                        chunk, BLOCK=blk, num_warps=_NUM_WARPS)
    _pivot_kernel[grid](x, x.stride(0), temperature, *row_args, cnt, mass, vocab_size, chunk, num_splits,
                        USE_MIN_P=use[2], BLOCK=min(blk, _PIVOT_TOKENS_PER_WARP * _PIVOT_WARPS), num_warps=_PIVOT_WARPS,
                        **shape)
    _compact_kernel[grid](x, x.stride(0), temperature, keys, *row_args, top_k, top_p, cnt, mass, num_cand, cand_s,
                          cand_v, best, best_idx, vocab_size, chunk, num_splits, capacity, BLOCK=blk,
                          num_warps=_NUM_WARPS, **flt, **shape)
    _select_kernel[(num_rows,)](temperature, keys, part_arg, part_nan, *row_args, top_k, top_p, cnt, mass, num_cand,
                                cand_s, cand_v, best, best_idx, threshold, fast, flags, vocab_size, num_splits,
                                CAP=capacity, num_warps=_NUM_WARPS, **flt, **shape)
