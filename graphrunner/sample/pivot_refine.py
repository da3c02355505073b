"""Tier 1's pivot counts and their refinement, tier 2, for pivot_select.py (Triton).

Tier 1 counts, per row, the tokens s = x / T >= each of P pivots and their mass exp(s - M)
(`_pivot_kernel`, one read of the row); `_windows` turns those counts into the windows between
two pivots that hold the k-th largest value (A) and the top-p threshold ([c, hi)); pivot_select's
compaction keeps the windows' tokens as candidates and its select finishes the row. On nearly
flat rows (random weights: at T 0.8, 95% of the mass sits in ~124,000 of 151,936 tokens) such a
window holds more tokens than the candidates' capacity. Tier 2 narrows it, at most
REFINE_PASSES times, for those rows only (the programs of other rows return at once):
  `_refine_kernel` (R): the windows of the last counts. A row whose candidates fit keeps its
    pivots (tier-1 rows stay 1, refined rows are flagged 2); else its next pivots are the
    windows' bounds (so the next windows nest in these) and points spread evenly between them
    in each window that holds more than half the capacity (a +inf bound is the row max, -inf
    the smallest finite s), sorted descending; min-p's pivot and the -inf totals keep their
    slots (flag 4: pending).
  `_pivot_kernel` (R x S): the counts at the new pivots, pending rows only (one read).
A pass cuts a window into 13 (6 each when both windows need it): two passes take a flat row's
~76,000-token window to ~1,000 tokens. Compaction and select then finish the row as in tier 1;
rows still over capacity are flagged 3 (the fallback). Every kernel reads the pivots from one
[R, P] buffer (the same float32 everywhere) and counts are exact integers, so the candidates of
a window are counted before the compaction, which reads only rows that fit.
Closed windows (tier 2 only): a window whose bounds are adjacent floats holds one value and
cannot be split. By the tie rule the k-th value is that value (A), and so is the top-p
threshold when the k-th value is not above the window ([c, hi)): the window is closed, without
candidates, its count and mass taken at its lower pivot, and a closed [c, hi) is drawn by the
compaction (all kept). Tier-1 rows keep open windows, so their seeded draws are unchanged.
"""

from __future__ import annotations

from graphrunner.kernels import HAS_TRITON, split_pad

__all__ = ["NUM_PIVOTS", "REFINE_PASSES", "TIER_FALLBACK", "TIER_GUESS", "TIER_PIVOTS", "TIER_REFINE",
           "count_and_refine"]

NUM_PIVOTS = 16  # min-p column + 14 ladder steps + the -inf totals: a [16, BLOCK] compare per step
REFINE_PASSES = 2  # counts after tier 1's: flat rows (a random-weight model's) need two
TIER_GUESS, TIER_PIVOTS, TIER_REFINE, TIER_FALLBACK = 0, 1, 2, 3  # pivot_sample_triton's [R] tiers
_PENDING = 4  # a row whose next count narrows its windows (never returned)
_PIVOT_WARPS = 4  # the pivot kernel's tile is [P, tokens per warp x warps]
_PIVOT_TOKENS_PER_WARP = 128  # 4 tokens x P pivots per thread

if HAS_TRITON:
    import triton
    import triton.language as tl

    from graphrunner.sample.triton_sampling import _at, _ordered_key, _row_params

    _NEG_INF = tl.constexpr(float("-inf"))
    _POS_INF = tl.constexpr(float("inf"))
    _LOWEST = tl.constexpr(-3.4028234663852886e38)  # the lowest finite float32
    _TIER_PIVOTS = tl.constexpr(TIER_PIVOTS)
    _TIER_REFINE = tl.constexpr(TIER_REFINE)
    _STATE_PENDING = tl.constexpr(_PENDING)

    @triton.jit
    def _row_pivots(row, max_ptr, sum_ptr, num_ptr, log_min_p_ptr, num_splits, USE_MIN_P: tl.constexpr, S_PAD, P):
        # -> (M, ok, tier-1 pivots [P]): min-p's threshold, `M - spread * j / (P-2)`, -inf.
        # Computed once (pivot_select's plan kernel stores them); the others read that buffer.
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

    @triton.jit
    def _finishes(flag):
        # Rows the compaction and the tier-1 select finish: tier 1, refined (2) and pending (4).
        return (flag == _TIER_PIVOTS) | (flag == _TIER_REFINE) | (flag == _STATE_PENDING)

    @triton.jit
    def _pivot_sums(row, cnt_ptr, mass_ptr, num_splits, S_PAD: tl.constexpr, P: tl.constexpr):
        # -> (cnt [P] int32, mass [P] float32): the row's counts and masses at its pivots, over its splits.
        sj = tl.arange(0, S_PAD)[:, None]
        p = tl.arange(0, P)
        on = sj < num_splits
        cnt = tl.sum(tl.load(cnt_ptr + (row * num_splits + sj) * P + p[None, :], mask=on, other=0), 0)
        mass = tl.sum(tl.load(mass_ptr + (row * num_splits + sj) * P + p[None, :], mask=on, other=0.0), 0)
        return cnt, mass

    @triton.jit
    def _ge_at(piv, vals, bound):
        # vals at the pivot equal to `bound` (the count or mass of s >= bound); 0 above every pivot (+inf).
        return tl.max(tl.where(piv == bound, vals, 0).to(vals.dtype), 0)

    @triton.jit
    def _adjacent(lo, hi, m):
        # A window [lo, hi) that holds only tokens equal to lo: no float32 between lo and min(hi, the
        # float after the row max m).
        top = tl.minimum(_ordered_key(hi).to(tl.int64), _ordered_key(m).to(tl.int64) + 1)
        return top == _ordered_key(lo).to(tl.int64) + 1

    @triton.jit
    def _windows(piv, cnt, mass, k, k_on, top_p, p_on, close, m, P: tl.constexpr):
        # One row's windows from its pivot counts (module docstring); every kernel gets the same.
        # -> (c, hi, a_lo, a_hi, a_on, cnt_above, mass_above, mass_min_p, mass_hi)
        p = tl.arange(0, P)
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
        # Closed A: the k-th value is a_lo; its count and mass are the pivot's (select lifts to a_lo).
        shut = close & a_on & _adjacent(a_lo, a_hi, m)
        cnt_above = tl.where(shut, _at(p, jk, cnt), cnt_above)
        mass_above = tl.where(shut, _at(p, jk, mass), mass_above)
        a_hi = tl.where(shut, a_lo, a_hi)
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
        # Closed [c, hi): the threshold is c (every k-th value candidate is <= c): all drawn above c.
        shut = close & p_on & _adjacent(c, hi, m) & (~a_on | (a_hi <= c))
        mass_hi = tl.where(shut, _ge_at(piv, mass, c), mass_hi)
        hi = tl.where(shut, c, hi)
        no_filter = ~k_on & ~p_on & (t_min_p == _NEG_INF)
        c = tl.where(no_filter, _NEG_INF, c)
        hi = tl.where(no_filter, _NEG_INF, hi)  # every token is kept: all drawn in the compaction
        a_lo = tl.where(a_on, a_lo, _POS_INF)
        a_hi = tl.where(a_on, a_hi, _POS_INF)
        return c, hi, a_lo, a_hi, a_on, cnt_above, mass_above, mass_min_p, mass_hi

    @triton.jit(do_not_specialize=["vocab_size", "chunk", "num_splits"])
    def _pivot_kernel(x_ptr, x_stride, temp_ptr, max_ptr, sum_ptr, num_ptr, log_min_p_ptr, piv_ptr, flag_ptr,
                      cnt_ptr, mass_ptr, vocab_size, chunk, num_splits, ACTIVE: tl.constexpr, USE_MIN_P: tl.constexpr,
                      S_PAD: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr):
        # Program (row, split), rows flagged ACTIVE: per pivot, how many s >= pivot in its tile and their
        # exp(s - M). The tile is [P, BLOCK], BLOCK = 4 x 32 x num_warps: a thread keeps all P pivots.
        row, split = tl.program_id(0), tl.program_id(1)
        if tl.load(flag_ptr + row) == ACTIVE:
            m, ok, _ = _row_pivots(row, max_ptr, sum_ptr, num_ptr, log_min_p_ptr, num_splits, USE_MIN_P, S_PAD, P)
            piv = tl.load(piv_ptr + row * P + tl.arange(0, P))
            m = tl.where(ok, m, 0.0)
            t = tl.load(temp_ptr + row)
            t = tl.where(t == 0.0, 1.0, t)
            base, offs, lo = x_ptr + row.to(tl.int64) * x_stride, tl.arange(0, BLOCK), split * chunk
            hi = tl.where(ok, tl.minimum(lo + chunk, vocab_size), lo)
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
    def _candidates(piv, cnt, mass, k, k_on, top_p, p_on, close, m, P: tl.constexpr):
        # -> (n, n_p, n_a, c, hi, a_lo, a_hi): the compaction's candidate count (exact, from the counts),
        # those of [c, hi) and of A, and the windows.
        c, hi, a_lo, a_hi, _, _, _, _, _ = _windows(piv, cnt, mass, k, k_on, top_p, p_on, close, m, P)
        n_p = tl.where(c < hi, _ge_at(piv, cnt, c) - _ge_at(piv, cnt, hi), 0)
        n_a = tl.where(a_lo < a_hi, _ge_at(piv, cnt, a_lo) - _ge_at(piv, cnt, a_hi), 0)
        o_lo, o_hi = tl.maximum(c, a_lo), tl.minimum(hi, a_hi)
        n_o = tl.where(o_lo < o_hi, _ge_at(piv, cnt, o_lo) - _ge_at(piv, cnt, o_hi), 0)
        return n_p + n_a - n_o, n_p, n_a, c, hi, a_lo, a_hi

    @triton.jit
    def _next_pivots(piv, c, hi, a_lo, a_hi, n_p, n_a, m, low, half, P: tl.constexpr):
        # The windows' bounds and evenly spread points in those holding more than `half` candidates
        # ([c, hi) first, A after), sorted descending into slots 1..P-2; slot 0 (min-p) and P-1 (-inf) stay.
        p = tl.arange(0, P)
        span = P - 2
        on_p = (c < hi) & ~((c >= a_lo) & (hi <= a_hi))  # a [c, hi) inside A narrows with A
        need_p, need_a = on_p & (n_p > half), (a_lo < a_hi) & (n_a > half)
        num_a = tl.where(a_lo < a_hi, tl.where(need_a, tl.where(need_p, span // 2, tl.where(on_p, span - 2, span)),
                                              tl.where(on_p, 2, span)), 0)
        in_a = p - 1 >= span - num_a
        j = tl.where(in_a, p - 1 - (span - num_a), p - 1)
        steps = tl.maximum(tl.where(in_a, num_a, span - num_a) - 1, 1)
        top = tl.minimum(tl.where(in_a, a_hi, hi), m)  # +inf: the row max (nothing lies above it)
        bottom = tl.where(in_a, a_lo, c)
        lo = tl.minimum(tl.maximum(bottom, low), top)  # -inf: the smallest finite s
        lo = tl.where(lo > _NEG_INF, lo, top)
        frac = j.to(tl.float32) / steps.to(tl.float32)
        gap, half_gap = top - lo, top * 0.5 - lo * 0.5  # (the half never overflows)
        q = tl.where(gap < _POS_INF, lo + gap * frac, (lo + half_gap * frac) + half_gap * frac)
        q = tl.minimum(tl.maximum(q, lo), top)
        # The bounds themselves, exactly; below -inf, the lowest float: [-inf, -max) holds only -inf (closed).
        q = tl.where(j == 0, tl.where(bottom == _NEG_INF, _LOWEST, lo), tl.where(j >= steps, top, q))
        real = (p >= 1) & (p <= P - 2)
        # Rank of each point in descending order (ties by slot), then the point of each rank.
        first = (q[None, :] > q[:, None]) | ((q[None, :] == q[:, None]) & (p[None, :] < p[:, None]))  # [P, P]
        rank = tl.sum(tl.where(first & real[None, :], 1, 0), 1)  # [P]
        ladder = tl.max(tl.where((rank[None, :] == p[:, None] - 1) & real[None, :], q[None, :], _NEG_INF), 1)
        return tl.where(p == 0, _at(p, 0, piv), tl.where(p == P - 1, _NEG_INF, ladder))

    @triton.jit(do_not_specialize=["vocab_size", "num_splits"])
    def _refine_kernel(max_ptr, sum_ptr, num_ptr, low_ptr, log_min_p_ptr, top_k_ptr, top_p_ptr, piv_ptr, cnt_ptr,
                       mass_ptr, flag_ptr, vocab_size, num_splits, capacity, FROM: tl.constexpr,
                       USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr, USE_MIN_P: tl.constexpr, S_PAD: tl.constexpr,
                       P: tl.constexpr):
        # Program row, rows flagged FROM (1: after tier 1's counts; 4: after a refining count): keep
        # the pivots of a row whose candidates fit, else write its next pivots and flag it pending.
        row = tl.program_id(0)
        if tl.load(flag_ptr + row) == FROM:
            m, ok, _ = _row_pivots(row, max_ptr, sum_ptr, num_ptr, log_min_p_ptr, num_splits, USE_MIN_P, S_PAD, P)
            k, k_on, top_p, p_on = _row_params(row, top_k_ptr, top_p_ptr, vocab_size, USE_TOP_K, USE_TOP_P)
            p = tl.arange(0, P)
            piv = tl.load(piv_ptr + row * P + p)
            cnt, mass = _pivot_sums(row, cnt_ptr, mass_ptr, num_splits, S_PAD, P)
            stay = ~ok  # the tier-1 select sends it to the fallback
            if FROM == _TIER_PIVOTS:  # tier 1 serves the rows it fits, with open windows
                n_open, _, _, _, _, _, _ = _candidates(piv, cnt, mass, k, k_on, top_p, p_on, False, m, P)
                stay = stay | (n_open <= capacity)
            n, n_p, n_a, c, hi, a_lo, a_hi = _candidates(piv, cnt, mass, k, k_on, top_p, p_on, True, m, P)
            split = (n > capacity) & ~stay
            j = tl.arange(0, S_PAD)
            low = tl.min(tl.load(low_ptr + row * num_splits + j, mask=j < num_splits, other=_POS_INF), 0)
            nxt = _next_pivots(piv, c, hi, a_lo, a_hi, n_p, n_a, m, low, capacity // 2, P)
            tl.store(piv_ptr + row * P + p, nxt, mask=(p < P) & split)
            tl.store(flag_ptr + row, tl.where(stay, FROM, tl.where(split, _STATE_PENDING, _TIER_REFINE)))


def count_and_refine(x, temperature, row_args, low, top_k, top_p, piv, cnt, mass, flags, chunk, num_splits,
                     capacity, blk, flt) -> None:
    """Tier 1's counts (rows flagged 1), then up to REFINE_PASSES refining passes (module docstring).

    row_args: the stats' per-split max, sum, count and log(min_p); low: [R, S] smallest finite s;
    piv: [R, P] pivots (tier 1's, rewritten for refined rows); cnt, mass: [R, S, P]; flags: [R].
    """
    num_rows, vocab_size = x.shape
    shape = dict(S_PAD=split_pad(num_splits), P=NUM_PIVOTS)
    count_block = min(blk, _PIVOT_TOKENS_PER_WARP * _PIVOT_WARPS)

    def count(active: int) -> None:
        _pivot_kernel[(num_rows, num_splits)](x, x.stride(0), temperature, *row_args, piv, flags, cnt, mass,
                                              vocab_size, chunk, num_splits, ACTIVE=active, USE_MIN_P=flt["USE_MIN_P"],
                                              BLOCK=count_block, num_warps=_PIVOT_WARPS, **shape)

    count(TIER_PIVOTS)
    for step in range(REFINE_PASSES):
        _refine_kernel[(num_rows,)](*row_args[:3], low, row_args[3], top_k, top_p, piv, cnt, mass, flags, vocab_size,
                                    num_splits, capacity, FROM=TIER_PIVOTS if step == 0 else _PENDING, num_warps=4,
                                    **flt, **shape)
        count(_PENDING)
