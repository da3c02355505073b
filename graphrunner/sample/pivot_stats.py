"""pivot_select's tier-0 stats pass (Triton): the one read of the logits every sampled row pays.

Program (row, split) over its chunk of x: what the plan and the later tiers need of the row (max of
s = x / T and its first id, the first NaN id, sum, count and min of the finite x, the maxima of NB
disjoint lane groups), and for min-p rows (the "one-pass" rows) tier 0's candidates as well, so
that a batch of min-p rows reads its logits once in tier 0. pivot_select.py documents the tiers;
this module holds the pass and the predicate the later kernels share (`_one_pass`).
"""

from __future__ import annotations

from graphrunner.kernels import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from graphrunner.sample.triton_sampling import _append

    _NEG_INF = tl.constexpr(float("-inf"))
    _POS_INF = tl.constexpr(float("inf"))

    @triton.jit
    def _one_pass(row, log_min_p_ptr, ONE_PASS: tl.constexpr):
        # A row whose tier-0 candidates the stats pass collects (min-p on): its guess pass is skipped.
        if ONE_PASS:
            return tl.load(log_min_p_ptr + row) > _NEG_INF
        return tl.zeros([], tl.int1)

    @triton.jit
    def _one_pass_bound(peak, t, lmp):
        # x0 <= every float32 x with div_rn(x, t) >= max(peak) / T + log(min_p) =: b (t > 0): b * t less
        # a margin above the two roundings (2**-24 relative each, and absolute below the normal range
        # for t < 1e15); no bound (-inf) when b * t overflows. Looser than _x_bound's bisection, no loop.
        bt = (tl.math.div_rn(tl.max(peak, 0), t) + lmp) * t
        x0 = bt - tl.abs(bt) * 9.5367431640625e-07 - 1e-30  # 2**-20
        return tl.where(x0 == x0, x0, _NEG_INF)

    @triton.jit
    def _load_tile(base, v, hi):
        return tl.load(base + v, mask=v < hi, other=_NEG_INF).to(tl.float32)

    @triton.jit
    def _stats_step(x, v, peak, arg, first_nan, total, count, low, n_ptr, cand_x_ptr, cand_v_ptr, row, capacity, x0,
                    APPEND: tl.constexpr):
        # One loaded tile x (ids v) into the accumulators (and, with APPEND, the candidates x >= x0).
        better = x > peak  # strict: the first id of a tie within a lane
        peak = tl.where(better, x, peak)
        arg = tl.where(better, v, arg)
        first_nan = tl.minimum(first_nan, tl.where(x != x, v, 2147483647))
        finite = (x > _NEG_INF) & (x < _POS_INF)
        total += tl.where(finite, x, 0.0)
        count += finite.to(tl.int32)
        low = tl.minimum(low, tl.where(finite, x, _POS_INF))
        if APPEND:
            _append(n_ptr, cand_x_ptr, cand_v_ptr, row, capacity, x, v, (x >= x0) & (x > _NEG_INF))
        return peak, arg, first_nan, total, count, low

    @triton.jit
    def _stats_span(base, lo, hi, offs, peak, arg, first_nan, total, count, low, n_ptr, cand_x_ptr, cand_v_ptr, row,
                    capacity, x0, APPEND: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
        # Tiles [lo, hi) into the accumulators, UNROLL (1, 2 or 4) tiles per step: their loads are issued together
        # before any is used (one load in flight per program left the pass latency-bound: H100, 256
        # rows, ~97 us against a ~52 us read). Tiles past hi load -inf, which changes nothing. With
        # APPEND, tokens x >= x0 are also appended as candidates (the one-pass rows).
        for start in range(lo, hi, UNROLL * BLOCK):
            x_a = _load_tile(base, start + offs, hi)
            if UNROLL >= 2:
                x_b = _load_tile(base, start + BLOCK + offs, hi)
            if UNROLL >= 4:
                x_c = _load_tile(base, start + 2 * BLOCK + offs, hi)
                x_d = _load_tile(base, start + 3 * BLOCK + offs, hi)
            peak, arg, first_nan, total, count, low = _stats_step(
                x_a, start + offs, peak, arg, first_nan, total, count, low, n_ptr, cand_x_ptr, cand_v_ptr, row,
                capacity, x0, APPEND)
            if UNROLL >= 2:
                peak, arg, first_nan, total, count, low = _stats_step(
                    x_b, start + BLOCK + offs, peak, arg, first_nan, total, count, low, n_ptr, cand_x_ptr,
                    cand_v_ptr, row, capacity, x0, APPEND)
            if UNROLL >= 4:
                peak, arg, first_nan, total, count, low = _stats_step(
                    x_c, start + 2 * BLOCK + offs, peak, arg, first_nan, total, count, low, n_ptr, cand_x_ptr,
                    cand_v_ptr, row, capacity, x0, APPEND)
                peak, arg, first_nan, total, count, low = _stats_step(
                    x_d, start + 3 * BLOCK + offs, peak, arg, first_nan, total, count, low, n_ptr, cand_x_ptr,
                    cand_v_ptr, row, capacity, x0, APPEND)
        return peak, arg, first_nan, total, count, low

    @triton.jit(do_not_specialize=["vocab_size", "chunk", "capacity"])
    def _stats_kernel(x_ptr, x_stride, temp_ptr, log_min_p_ptr, n_ptr, cand_x_ptr, cand_v_ptr, max_ptr, arg_ptr,
                      nan_ptr, sum_ptr, num_ptr, low_ptr, bmax_ptr, vocab_size, chunk, capacity,
                      ONE_PASS: tl.constexpr, SEGMENT: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
                      UNROLL: tl.constexpr):
        # Program (row, split), over its tile: max of s = x / T (NaN skipped) and its first id, the
        # first NaN id (greedy rows take it, as torch.argmax), sum, count and min of finite x (the
        # spread's mean, refinement's lowest bound), the maxima of NB disjoint lane groups (the plan's).
        # On x, divided once at the end: div_rn is monotone, so max(x) / T is max(x / T). No noise here:
        # tier -1's draw (pivot_reject's pass A) runs later, for the rows tier 0 turns down only.
        # One-pass rows (min-p on, ONE_PASS: chunks of >= 2 segments) also append tier 0's candidates:
        # every finite token with s >= M' + log(min_p), M' the max of s over the segments before its
        # own (<= M), a superset of the kept tokens (s >= t_min_p), in the same read. The bound moves
        # once per SEGMENT tiles (a block-wide max, a barrier: once per tile would cost ~2.5x); the
        # first segment has none, so it is read twice (the second time from L2).
        row, split = tl.program_id(0), tl.program_id(1)
        one_pass = _one_pass(row, log_min_p_ptr, ONE_PASS)
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
        low = tl.full([BLOCK], _POS_INF, tl.float32)
        mid = tl.where(one_pass, tl.minimum(lo + SEGMENT * BLOCK, hi), hi)
        peak, arg, first_nan, total, count, low = _stats_span(
            base, lo, mid, offs, peak, arg, first_nan, total, count, low, n_ptr, cand_x_ptr, cand_v_ptr, row,
            capacity, 0.0, False, BLOCK, UNROLL)
        if ONE_PASS:
            if one_pass:  # (uniform per row) the first segment again, against its own max
                lmp = tl.load(log_min_p_ptr + row)
                x0 = _one_pass_bound(peak, t, lmp)
                for start in range(lo, mid, BLOCK):
                    v = start + offs
                    x = _load_tile(base, v, mid)
                    _append(n_ptr, cand_x_ptr, cand_v_ptr, row, capacity, x, v, (x >= x0) & (x > _NEG_INF))
                for seg in range(mid, hi, SEGMENT * BLOCK):  # empty for other rows (mid = hi)
                    x0 = _one_pass_bound(peak, t, lmp)
                    peak, arg, first_nan, total, count, low = _stats_span(
                        base, seg, tl.minimum(seg + SEGMENT * BLOCK, hi), offs, peak, arg, first_nan, total, count,
                        low, n_ptr, cand_x_ptr, cand_v_ptr, row, capacity, x0, True, BLOCK, UNROLL)
        top = tl.max(peak, 0)
        tl.store(max_ptr + out, tl.math.div_rn(top, t))
        tl.store(arg_ptr + out, tl.min(tl.where(peak == top, arg, 2147483647), 0))  # greedy rows: T = 1
        tl.store(nan_ptr + out, tl.min(first_nan, 0))
        tl.store(sum_ptr + out, tl.math.div_rn(tl.sum(total, 0), t))
        tl.store(num_ptr + out, tl.sum(count, 0))
        tl.store(low_ptr + out, tl.math.div_rn(tl.min(low, 0), t))
        bucket = tl.max(tl.reshape(peak, [NB, BLOCK // NB]), 1)  # [NB]
        tl.store(bmax_ptr + out * NB + tl.arange(0, NB), tl.math.div_rn(bucket, t))
