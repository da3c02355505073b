"""Tier -1 of pivot_select, the rejection (acceptance) tier: draw first, then prove the draw kept (Triton).

The filtered draw is `argmax over K of (s_i + g_i)`, K = {i : s_i >= thr} the kept set of
filters.filter_threshold (s = x / T, g = rng.py's Gumbel noise). Let i* be the Gumbel-max token
over ALL of the row's non-NaN tokens (the smallest id reaching the max, as every tier breaks ties).
If i* is in K, it is also the argmax over K: its score is the max over a superset of K, and no
smaller id of K reaches it (it would be a smaller id of the superset). So a row whose i* is proven
to lie in K is served by i* itself, bit for bit the token the later tiers would draw: the scores are
the same float32 operations (div_rn, then triton_sampling._gumbel_score) in every tier.

It runs after tier 0 (the guess), for the rows it turns down (flag 1) only: rows the guess
proves never pay it. Pass A (`_reject_draw_kernel`, R x S, one read with a hash and two logs a
token) gives i* per split, combined by the later kernels. Proof that s* = s_{i*} is kept, i.e.
s* >= each of the three thresholds, each computed on what the previous filters kept (filters.py):
  min-p: s* >= t_min_p = M + log(min_p): the same float32 add as filters.py and every tier.
  top-k: the k-th largest value is <= s* iff fewer than k tokens have s > s* (ties with the k-th
    value are kept). Tokens above s* >= t_min_p were all kept by min-p, so this counts s > s*.
  top-p: t_p is the largest t with mass(s >= t) >= top_p * Z_b (Z_b: the mass of s >= b =
    max(t_min_p, t_k)); s* < t_p iff the mass G of the tokens with s > s* reaches top_p * Z_b.
    Z_b = mass(s >= t_min_p) when top-k is off or keeps all of min-p's tokens (count(s >= t_min_p)
    <= k); else only Z_b >= mass(s >= s*) is known (s* >= t_k), a lower bound, which suffices.
    (Or Z_b >= mass(s >= t_min_p) - (count(s >= t_min_p) - k) * exp(s* - M): top-k drops at most
    that many tokens, each below s*; the larger bound is used.)
    The tiers sum these masses in float32 (per lane, then a tree) or 2**-40 fixed point, in other
    orders; sums of positive terms in such orders err by at most (V / 512 + 40) float32 roundings
    relative (~2e-5 at V = 152k), exp by a few ulp. So a row is accepted only if
    G + REJECT_MARGIN * need + REJECT_SLACK < need (need = top_p * Z): within rounding of the
    boundary the row goes to the exact tiers. REJECT_MARGIN (2**-12) covers V up to ~2M tokens;
    REJECT_SLACK covers the fixed point's truncation of 2**16 candidates (masses are in units of
    the max token's exp(0) = 1, so need >= top_p). The boundary rows it defers are ~2**-12 of all.
Pass B (`_reject_count_kernel`, R x S, one more read) counts and sums those for the rows still
live; `_reject_decide_kernel` (R) writes the token, the tier (-1) and a NaN threshold (not
computed) of each accepted row; the others keep flag 1 and the tiers 1-3 serve them unchanged
(tier -1 writes only its own scratch for them), so every token is the one those tiers give.

Gate: the three kernels run over all R rows (static shapes, in a CUDA graph); a program whose row
is not open (flag 1 from tier 0, and sampled: T > 0, greedy rows keep torch.argmax) returns after
loading the flag and T, and writes nothing. Pass B and the decision read an open row only if it is
live: a finite max and spread (pivot_select's `ok`), no NaN entry (the fallback would not skip it),
and s* survives every bound known after the plan: s* >= t_min_p, and s* >= the plan's proven lower
bound g of the threshold (mode 1: the k-th largest bucket maximum). Rows without top-k or top-p
need no count: min-p alone is decided at once (a no-filter row with a finite max is tier 0's).
Costs: a row the guess serves pays three programs that exit at once; an open row pays pass A (one
read plus the noise), and pass B (one read, ~1/3 of the guess tier's time) if live; a row accepted
saves the pivots and the refinement (~1.4 ms for flat rows at 256 x 151,936). Acceptance is the
draw's chance of being kept: ~top_p on flat rows, where the guess tier fails; top-k on flat rows
is cut by the bucket bound before pass B.

It always runs after the guess. tests/sample/test_sample_reject.py checks it against tiers 1-3 (the same
token for every row, on and off; every accepted token in the kept set of an independent sort
reference; top-k, top-p and min-p placed exactly at the draw; non-finite rows never accepted; CUDA
graph replays on a GPU). `graphrunner bench sampler` times the sampler with it, and
tools/bench/sampler_tiers.py shows which tier serves a model's own rows.
"""

from __future__ import annotations

from graphrunner.kernels import HAS_TRITON, split_pad
from graphrunner.sample.pivot_refine import NUM_PIVOTS

__all__ = ["REJECT_MARGIN", "REJECT_SLACK", "TIER_REJECT", "serve_draws"]

TIER_REJECT = -1  # pivot_sample_triton's tier of a row served by its unfiltered draw
REJECT_MARGIN = 2.0**-12  # relative: the top-p mass test's room for the tiers' float32 rounding
REJECT_SLACK = 2.0**-24  # absolute: 2**16 candidates' fixed-point truncation (2**-40 each)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from graphrunner.sample.pivot_refine import TIER_PIVOTS, _row_pivots
    from graphrunner.sample.triton_sampling import _at, _gumbel_score, _lane_best, _row_params, _store_best

    _NEG_INF = tl.constexpr(float("-inf"))
    _MARGIN = tl.constexpr(REJECT_MARGIN)
    _SLACK = tl.constexpr(REJECT_SLACK)
    _TIER = tl.constexpr(TIER_REJECT)
    _OPEN = tl.constexpr(TIER_PIVOTS)  # the flag tier 0's select gives the rows it cannot prove
    _NO_ID = tl.constexpr(2147483647)  # above every token id

    @triton.jit
    def _open(row, flag_ptr, temp_ptr):
        # A row tier -1 tries: tier 0 turned it down and it is sampled (greedy rows keep torch.argmax).
        # Every other program of the three kernels returns after these two loads.
        return (tl.load(flag_ptr + row) == _OPEN) & (tl.load(temp_ptr + row) != 0.0)

    @triton.jit(do_not_specialize=["vocab_size", "chunk"])
    def _reject_draw_kernel(x_ptr, x_stride, temp_ptr, keys_ptr, flag_ptr, draw_ptr, draw_idx_ptr, vocab_size, chunk,
                            BLOCK: tl.constexpr):
        # Program (row, split), pass A, open rows only: the best s + gumbel over the tile's non-NaN tokens
        # and its first id (the scores of every tier: div_rn, then _gumbel_score).
        row, split = tl.program_id(0), tl.program_id(1)
        if _open(row, flag_ptr, temp_ptr):
            t = tl.load(temp_ptr + row)
            key = tl.load(keys_ptr + row).to(tl.uint32)
            base, offs, lo = x_ptr + row.to(tl.int64) * x_stride, tl.arange(0, BLOCK), split * chunk
            hi = tl.minimum(lo + chunk, vocab_size)
            best = tl.full([BLOCK], _NEG_INF, tl.float32)
            best_idx = lo + offs
            for start in range(lo, hi, BLOCK):
                v = start + offs
                s = tl.math.div_rn(tl.load(base + v, mask=v < hi, other=float("nan")).to(tl.float32), t)
                best, best_idx = _lane_best(tl.where(s == s, _gumbel_score(s, v, key), _NEG_INF), v, best, best_idx)
            _store_best(draw_ptr, draw_idx_ptr, row * tl.num_programs(1) + split, best, best_idx)

    @triton.jit
    def _gate(row, x_ptr, x_stride, temp_ptr, max_ptr, sum_ptr, num_ptr, nan_ptr, log_min_p_ptr, plan_ptr, draw_ptr,
              draw_idx_ptr, num_splits, USE_MIN_P: tl.constexpr, S_PAD: tl.constexpr, P: tl.constexpr):
        # -> (i*, s*, M, t_min_p, live) of an open row (its draws exist): its unfiltered draw and whether
        # it may still be kept (module docstring's gate); every program of the row computes the same.
        t = tl.load(temp_ptr + row)
        m, ok, piv = _row_pivots(row, max_ptr, sum_ptr, num_ptr, log_min_p_ptr, num_splits, USE_MIN_P, S_PAD, P)
        t_min_p = _at(tl.arange(0, P), 0, piv)
        j = tl.arange(0, S_PAD)
        on = j < num_splits
        best = tl.load(draw_ptr + row * num_splits + j, mask=on, other=_NEG_INF)
        idx = tl.load(draw_idx_ptr + row * num_splits + j, mask=on, other=_NO_ID)
        tok = tl.min(tl.where(best == tl.max(best, 0), idx, _NO_ID), 0)  # splits ascend: the first id
        tok = tl.where(tok == _NO_ID, 0, tok)
        clean = tl.min(tl.load(nan_ptr + row * num_splits + j, mask=on, other=_NO_ID), 0) == _NO_ID
        s_star = tl.math.div_rn(tl.load(x_ptr + row.to(tl.int64) * x_stride + tok).to(tl.float32), t)
        g = tl.load(plan_ptr + 2 * row)
        mode = tl.load(plan_ptr + 2 * row + 1).to(tl.int32)
        live = ok & clean & (s_star >= t_min_p) & ((mode != 1) | (s_star >= g))
        return tok, s_star, m, t_min_p, live

    @triton.jit
    def _count_tile(base, t, s_star, m, t_min_p, p_on, cnt_ptr, mass_ptr, out, lo, vocab_size, chunk,
                    BLOCK: tl.constexpr):
        # Pass B over one tile [lo, lo + chunk) of a row: its counts and masses at `out`.
        offs = tl.arange(0, BLOCK)
        hi = tl.minimum(lo + chunk, vocab_size)
        n_gt = tl.zeros([BLOCK], tl.int32)
        n_min = tl.zeros([BLOCK], tl.int32)
        above = tl.zeros([BLOCK], tl.float32)
        at_or_above = tl.zeros([BLOCK], tl.float32)
        z_min = tl.zeros([BLOCK], tl.float32)
        for start in range(lo, hi, BLOCK):
            v = start + offs
            # NaN past the end fails every comparison (live rows hold no NaN).
            s = tl.math.div_rn(tl.load(base + v, mask=v < hi, other=float("nan")).to(tl.float32), t)
            n_gt += (s > s_star).to(tl.int32)
            n_min += (s >= t_min_p).to(tl.int32)
            if p_on:  # (uniform per row) the masses only where top-p needs them
                e = tl.where(s == s, tl.exp(s - m), 0.0)
                above += tl.where(s > s_star, e, 0.0)
                at_or_above += tl.where(s >= s_star, e, 0.0)
                z_min += tl.where(s >= t_min_p, e, 0.0)
        tl.store(cnt_ptr + 2 * out, tl.sum(n_gt, 0))
        tl.store(cnt_ptr + 2 * out + 1, tl.sum(n_min, 0))
        tl.store(mass_ptr + 3 * out, tl.sum(above, 0))
        tl.store(mass_ptr + 3 * out + 1, tl.sum(at_or_above, 0))
        tl.store(mass_ptr + 3 * out + 2, tl.sum(z_min, 0))

    @triton.jit(do_not_specialize=["vocab_size", "chunk", "num_splits"])
    def _reject_count_kernel(x_ptr, x_stride, temp_ptr, max_ptr, sum_ptr, num_ptr, nan_ptr, log_min_p_ptr, plan_ptr,
                             draw_ptr, draw_idx_ptr, top_k_ptr, top_p_ptr, flag_ptr, cnt_ptr, mass_ptr, vocab_size,
                             chunk, num_splits, USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr,
                             USE_MIN_P: tl.constexpr, S_PAD: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr):
        # Program (row, split), pass B, live open rows with top-k or top-p only: over its tile, the counts
        # of s > s* and s >= t_min_p, and (top-p) the masses exp(s - M) of s > s*, s >= s*, s >= t_min_p.
        row, split = tl.program_id(0), tl.program_id(1)
        if _open(row, flag_ptr, temp_ptr):
            _, s_star, m, t_min_p, live = _gate(row, x_ptr, x_stride, temp_ptr, max_ptr, sum_ptr, num_ptr, nan_ptr,
                                                log_min_p_ptr, plan_ptr, draw_ptr, draw_idx_ptr, num_splits,
                                                USE_MIN_P, S_PAD, P)
            _, k_on, _, p_on = _row_params(row, top_k_ptr, top_p_ptr, vocab_size, USE_TOP_K, USE_TOP_P)
            if live & (k_on | p_on):
                _count_tile(x_ptr + row.to(tl.int64) * x_stride, tl.load(temp_ptr + row), s_star, m, t_min_p, p_on,
                            cnt_ptr, mass_ptr, row * num_splits + split, split * chunk, vocab_size, chunk, BLOCK)

    @triton.jit(do_not_specialize=["vocab_size", "num_splits"])
    def _reject_decide_kernel(x_ptr, x_stride, temp_ptr, max_ptr, sum_ptr, num_ptr, nan_ptr, log_min_p_ptr, plan_ptr,
                              draw_ptr, draw_idx_ptr, top_k_ptr, top_p_ptr, flag_ptr, cnt_ptr, mass_ptr, tok_ptr,
                              thr_ptr, vocab_size, num_splits, USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr,
                              USE_MIN_P: tl.constexpr, S_PAD: tl.constexpr, P: tl.constexpr):
        # Program row, open rows only: the proof of the module docstring; an accepted row gets its token,
        # tier -1 and a NaN threshold; the others keep flag 1 (tiers 1-3 serve them as without tier -1).
        row = tl.program_id(0)
        if _open(row, flag_ptr, temp_ptr):
            tok, s_star, m, t_min_p, live = _gate(row, x_ptr, x_stride, temp_ptr, max_ptr, sum_ptr, num_ptr,
                                                  nan_ptr, log_min_p_ptr, plan_ptr, draw_ptr, draw_idx_ptr,
                                                  num_splits, USE_MIN_P, S_PAD, P)
            k, k_on, top_p, p_on = _row_params(row, top_k_ptr, top_p_ptr, vocab_size, USE_TOP_K, USE_TOP_P)
            j = tl.arange(0, S_PAD)
            # The counts exist for live rows with top-k or top-p only (a bound on j: the interpreter's
            # splat of a scalar bool breaks `&`).
            on = j < tl.where(live & (k_on | p_on), num_splits, 0)
            at = row * num_splits + j
            n_gt = tl.sum(tl.load(cnt_ptr + 2 * at, mask=on, other=0), 0)
            n_min = tl.sum(tl.load(cnt_ptr + 2 * at + 1, mask=on, other=0), 0)
            on_p = j < tl.where(live & p_on, num_splits, 0)
            above = tl.sum(tl.load(mass_ptr + 3 * at, mask=on_p, other=0.0), 0)
            at_or_above = tl.sum(tl.load(mass_ptr + 3 * at + 1, mask=on_p, other=0.0), 0)
            z_min = tl.sum(tl.load(mass_ptr + 3 * at + 2, mask=on_p, other=0.0), 0)
            k_ok = ~k_on | (n_gt < k)
            # Z_b: min-p's mass when top-k keeps all of min-p's tokens; else a lower bound: top-k drops at
            # most n_min - k of them, each below s* (e < exp(s* - M)), and it keeps all of s >= s*.
            cut = z_min * (1.0 - _MARGIN) - (n_min - k).to(tl.float32) * tl.exp(s_star - m) * (1.0 + _MARGIN)
            z = tl.where(k_on & (n_min > k), tl.maximum(at_or_above, cut), z_min)
            need = top_p * z
            p_ok = ~p_on | (above + (need * _MARGIN + _SLACK) < need)
            accept = live & k_ok & p_ok
            tl.store(flag_ptr + row, _TIER, mask=accept)
            tl.store(tok_ptr + row, tok, mask=accept)
            tl.store(thr_ptr + row, float("nan"), mask=accept)


def serve_draws(x, temperature, keys, row_args, nan, plan, top_k, top_p, flags, fast, threshold, scratch,
                chunk: int, num_splits: int, blk: int, flt: dict) -> None:
    """Tier -1 for the rows tier 0 turned down (flag 1): pass A, pass B, then the decision.

    row_args: the stats' per-split max, sum, count and log(min_p); nan: [R, S] first NaN ids;
    plan: [R, 2] (g, mode); flags: [R], -1 written for the accepted rows (the others keep theirs);
    fast, threshold: [R], written for the accepted rows; scratch: ([R, S] best score, [R, S] its
    first id, [R, S, 2] counts, [R, S, 3] masses), written for open rows only.
    """
    num_rows, vocab_size = x.shape
    draw, draw_idx, cnt, mass = scratch
    shape = dict(S_PAD=split_pad(num_splits), P=NUM_PIVOTS)
    grid = (num_rows, num_splits)
    _reject_draw_kernel[grid](x, x.stride(0), temperature, keys, flags, draw, draw_idx, vocab_size, chunk, BLOCK=blk,
                              num_warps=8)
    gate = (x, x.stride(0), temperature, *row_args[:3], nan, row_args[3], plan, draw, draw_idx, top_k, top_p, flags,
            cnt, mass)
    _reject_count_kernel[grid](*gate, vocab_size, chunk, num_splits, BLOCK=blk, num_warps=8, **flt, **shape)
    _reject_decide_kernel[(num_rows,)](*gate, fast, threshold, vocab_size, num_splits, num_warps=4, **flt, **shape)
