"""The logit processors in one pass over the logits, and the persistent penalty counts.

`processors.py` applies allowed ids / grammar, logit bias, min_tokens and penalties as
separate [R, V] torch passes and rebuilds the penalty counts from the whole history every
step. Here (Triton, CUDA; CPU tests under TRITON_INTERPRET=1):

- `process_logits_triton`: a dense kernel, many programs per row (one per V tile), reads
  the raw logits, the bitmask words (only for rows that use them) and the counts row (only
  for rows with penalties), applies the allowed/grammar mask then the penalties, and writes
  the processed logits to a persistent buffer (never the graph pool). Then a sparse kernel
  recomputes the few elements a row's logit-bias slots and min_tokens stop slots touch, from
  the raw logit: mask, + bias (every slot, in slot order, as scatter_add does), + (-inf or 0)
  per stop slot, then the penalties. Duplicate ids in a row compute the same value, so their
  writes agree. Order and formulas are those of processors.py; the division is IEEE
  (`div_rn`) and FMA contraction is off, so the result is bit-identical to the torch
  reference (NaN where it gives NaN). With `stats` (a batch that returns logprobs) the dense
  kernel also writes the raw logits' logsumexp partials and group maxima of its tile
  (logprobs_fused.tile_stats), so the logprobs need no second read of the logits.
- `refresh_counts`: rows flagged stale (admitted since) rebuilt from their token history,
  one program per batch entry that returns at once unless its row is stale.

Speculative verification: the row of slot j also counts the j history tokens after the
persistent counts' end (the drafts before it) as outputs (`base`, `ahead`).
"""

from __future__ import annotations

import torch

from graphrunner.kernels import HAS_TRITON
from graphrunner.sample.logprobs_fused import GROUP, TILE, LogprobStats
from graphrunner.sample.processors import PROMPT_FLAG, refresh_counts_torch
from graphrunner.state.counts import check_counts
from graphrunner.state.sampling import SamplingStates

_COUNT_MASK = PROMPT_FLAG - 1
_BLOCK = TILE  # vocab entries per program of the dense kernel (a [_BLOCK / GROUP, GROUP] tile)
_HISTORY_BLOCK = 1024  # history positions per loop iteration of the rebuild


if HAS_TRITON:
    import triton
    import triton.language as tl

    from graphrunner.sample.logprobs_fused import tile_stats
    from graphrunner.state.counts import add_count, load_counts, set_prompt_flag

    _OUTPUT = tl.constexpr(_COUNT_MASK)  # the output-count bits of the int32 form

    @triton.jit
    def _mask(x, ids, m, row, e, use_allowed_ptr, allowed_ptr, allowed_stride, use_grammar_ptr, grammar_ptr,
              grammar_stride, slot_stride, slots_ptr):
        """-inf where the row's allowed-ids bitmask or its slot's grammar bitmask clears the bit."""
        drop = ids < 0  # all False
        if tl.load(use_allowed_ptr + row) != 0:
            w = tl.load(allowed_ptr + row * allowed_stride + ids // 32, mask=m, other=-1)
            drop = drop | (((w >> (ids % 32)) & 1) == 0)
        if tl.load(use_grammar_ptr + row) != 0:
            slot = tl.load(slots_ptr + e).to(tl.int64)
            w = tl.load(grammar_ptr + row * grammar_stride + slot * slot_stride + ids // 32, mask=m, other=-1)
            drop = drop | (((w >> (ids % 32)) & 1) == 0)
        return tl.where(drop, float("-inf"), x)

    @triton.jit
    def _penalize(x, ids, m, row, e, rep_ptr, freq_ptr, pres_ptr, counts_ptr, counts_stride, hist_ptr, hist_stride,
                  base_ptr, ahead_ptr, max_model_len, HAS_DRAFTS: tl.constexpr, MAX_AHEAD: tl.constexpr):
        """processors.apply_penalties on the elements `ids` of entry e (row `row`); neutral rows skip it."""
        rep = tl.load(rep_ptr + row)
        freq = tl.load(freq_ptr + row)
        pres = tl.load(pres_ptr + row)
        if (rep != 1.0) | (freq != 0.0) | (pres != 0.0):
            c = load_counts(counts_ptr + row * counts_stride, ids, m)  # int32 form (flag bit 24)
            if HAS_DRAFTS:
                base = tl.load(base_ptr + e).to(tl.int64)
                ahead = tl.load(ahead_ptr + e).to(tl.int64)
                for j in tl.static_range(MAX_AHEAD):
                    p = base + j
                    use = (j < ahead) & (p < max_model_len)
                    tok = tl.load(hist_ptr + row * hist_stride + tl.minimum(p, max_model_len - 1))
                    c += ((ids == tok) & use).to(tl.int32)
            oc = (c & _OUTPUT).to(tl.float32)  # output count
            r = tl.where(c > 0, rep, 1.0)
            x = tl.where(x > 0, tl.math.div_rn(x, r), x * r)
            x = x - freq * oc
            x = x - pres * (oc > 0).to(tl.float32)
        return x

    @triton.jit
    def _dense_kernel(x_ptr, x_stride, out_ptr, out_stride, rows_ptr, vocab_size, use_allowed_ptr, allowed_ptr,
                      allowed_stride, use_grammar_ptr, grammar_ptr, grammar_stride, slot_stride, slots_ptr, rep_ptr,
                      freq_ptr, pres_ptr, counts_ptr, counts_stride, hist_ptr, hist_stride, base_ptr, ahead_ptr,
                      max_model_len, m_ptr, acc_ptr, nan_ptr, num_tiles, gkey_ptr, num_groups,
                      HAS_MASK: tl.constexpr, HAS_PENALTIES: tl.constexpr, HAS_DRAFTS: tl.constexpr,
                      MAX_AHEAD: tl.constexpr, STATS: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr):
        # Program (entry, tile) over a [GROUPS, GROUP] block of the row (the logprob stats' groups).
        e = tl.program_id(0).to(tl.int64)
        tile = tl.program_id(1)
        ids = tile * (GROUPS * GROUP) + tl.arange(0, GROUPS)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        m = ids < vocab_size
        row = tl.load(rows_ptr + e).to(tl.int64)
        x = tl.load(x_ptr + e * x_stride + ids, mask=m, other=0.0)  # [GROUPS, GROUP] raw logits
        if STATS:  # the raw logits' logsumexp partials and group maxima, for logprobs_fused
            tile_stats(x, m, ids, e, tile, m_ptr, acc_ptr, nan_ptr, num_tiles, gkey_ptr, num_groups, GROUP)
        if HAS_MASK:
            x = _mask(x, ids, m, row, e, use_allowed_ptr, allowed_ptr, allowed_stride, use_grammar_ptr, grammar_ptr,
                      grammar_stride, slot_stride, slots_ptr)
        if HAS_PENALTIES:
            x = _penalize(x, ids, m, row, e, rep_ptr, freq_ptr, pres_ptr, counts_ptr, counts_stride, hist_ptr,
                          hist_stride, base_ptr, ahead_ptr, max_model_len, HAS_DRAFTS, MAX_AHEAD)
        tl.store(out_ptr + e * out_stride + ids, x, mask=m)

    @triton.jit
    def _plus_zero(v):
        return (v == 0.0) & (v.to(tl.int32, bitcast=True) >= 0)  # +0.0: zero with the sign bit clear

    @triton.jit
    def _sparse_lanes(ids, m, v, nonzero, plus_zero, stop_ids, add, e, row, x_ptr, x_stride, out_ptr, out_stride,
                      use_allowed_ptr, allowed_ptr, allowed_stride, use_grammar_ptr, grammar_ptr, grammar_stride,
                      slot_stride, slots_ptr, rep_ptr, freq_ptr, pres_ptr, counts_ptr, counts_stride, hist_ptr,
                      hist_stride, base_ptr, ahead_ptr, max_model_len, HAS_MASK: tl.constexpr,
                      HAS_PENALTIES: tl.constexpr, HAS_DRAFTS: tl.constexpr, MAX_AHEAD: tl.constexpr):
        """Recompute and store the elements `ids` (lanes `m`) of entry e: mask, bias, stop, penalties.

        The bias is given per lane as scatter_add's net effect: used ids are distinct, so an id
        matches at most one nonzero value v and otherwise zeros, and the one-by-one additions
        give x + v, else x + 0.0 if a +0.0 matched (it turns -0.0 into +0.0), else x. Repeated
        stop slots add the same -inf or 0.0 again, which changes nothing: one addition."""
        x = tl.load(x_ptr + e * x_stride + ids, mask=m, other=0.0)
        if HAS_MASK:
            x = _mask(x, ids, m, row, e, use_allowed_ptr, allowed_ptr, allowed_stride, use_grammar_ptr, grammar_ptr,
                      grammar_stride, slot_stride, slots_ptr)
        x = tl.where(nonzero, x + v, tl.where(plus_zero, x + 0.0, x))
        x = tl.where(tl.max((ids[:, None] == stop_ids[None, :]).to(tl.int32), 1) > 0, x + add, x)
        if HAS_PENALTIES:
            x = _penalize(x, ids, m, row, e, rep_ptr, freq_ptr, pres_ptr, counts_ptr, counts_stride, hist_ptr,
                          hist_stride, base_ptr, ahead_ptr, max_model_len, HAS_DRAFTS, MAX_AHEAD)
        tl.store(out_ptr + e * out_stride + ids, x, mask=m)

    @triton.jit
    def _sparse_kernel(x_ptr, x_stride, out_ptr, out_stride, rows_ptr, pos_ptr, use_allowed_ptr, allowed_ptr,
                       allowed_stride, use_grammar_ptr, grammar_ptr, grammar_stride, slot_stride, slots_ptr, rep_ptr,
                       freq_ptr, pres_ptr, counts_ptr, counts_stride, hist_ptr, hist_stride, base_ptr, ahead_ptr,
                       max_model_len, bias_ids_ptr, bias_values_ptr, num_bias, stop_ids_ptr, num_stop,
                       prompt_len_ptr, min_tokens_ptr, HAS_MASK: tl.constexpr, HAS_PENALTIES: tl.constexpr,
                       HAS_DRAFTS: tl.constexpr, MAX_AHEAD: tl.constexpr, BIAS_PAD: tl.constexpr,
                       STOP_PAD: tl.constexpr):
        # Program e: every bias slot and every stop slot of its row, each lane recomputing its
        # element in full (so lanes sharing an id store the same value). The row's slots come in
        # with one vector load each: no loop of dependent per-slot loads.
        e = tl.program_id(0).to(tl.int64)
        row = tl.load(rows_ptr + e).to(tl.int64)
        b = tl.arange(0, BIAS_PAD)
        bias_on = b < num_bias
        bias_ids = tl.load(bias_ids_ptr + row * num_bias + b, mask=bias_on, other=-1).to(tl.int64)  # [BIAS_PAD]
        bias_values = tl.load(bias_values_ptr + row * num_bias + b, mask=bias_on, other=0.0)
        k = tl.arange(0, STOP_PAD)
        stop_on = k < num_stop
        stop_ids = tl.load(stop_ids_ptr + row * num_stop + k, mask=stop_on, other=-1).to(tl.int64)  # [STOP_PAD]
        num_output = tl.maximum(tl.load(pos_ptr + e).to(tl.int64) - tl.load(prompt_len_ptr + row), 0)
        add = tl.where(num_output < tl.load(min_tokens_ptr + row), float("-inf"), 0.0)
        nonzero = bias_values != 0.0  # NaN counts as nonzero
        plus_zero = _plus_zero(bias_values)
        # Id 0 is the one id several slots can hold (the unused (0, +0.0) slots): its net bias.
        zero = bias_ids == 0
        zero_v = tl.sum(tl.where(zero & nonzero, bias_values, 0.0), 0)  # the one nonzero value, exactly
        zero_nonzero = tl.max((zero & nonzero).to(tl.int32), 0) > 0
        zero_plus_zero = tl.max((zero & plus_zero).to(tl.int32), 0) > 0
        _sparse_lanes(bias_ids, bias_on, tl.where(zero, zero_v, bias_values),
                      tl.where(zero, zero_nonzero, nonzero), tl.where(zero, zero_plus_zero, plus_zero),
                      stop_ids, add,
                      e, row, x_ptr, x_stride, out_ptr, out_stride, use_allowed_ptr, allowed_ptr,
                      allowed_stride, use_grammar_ptr, grammar_ptr, grammar_stride, slot_stride, slots_ptr, rep_ptr,
                      freq_ptr, pres_ptr, counts_ptr, counts_stride, hist_ptr, hist_stride, base_ptr, ahead_ptr,
                      max_model_len, HAS_MASK, HAS_PENALTIES, HAS_DRAFTS, MAX_AHEAD)
        # Stop lanes look their id up among the bias slots ([STOP_PAD, BIAS_PAD] matches).
        hit = stop_ids[:, None] == bias_ids[None, :]
        hit_nonzero = hit & nonzero[None, :]
        _sparse_lanes(stop_ids, stop_on, tl.sum(tl.where(hit_nonzero, bias_values[None, :], 0.0), 1),
                      tl.max(hit_nonzero.to(tl.int32), 1) > 0,
                      tl.max((hit & plus_zero[None, :]).to(tl.int32), 1) > 0, stop_ids, add,
                      e, row, x_ptr, x_stride, out_ptr, out_stride, use_allowed_ptr, allowed_ptr,
                      allowed_stride, use_grammar_ptr, grammar_ptr, grammar_stride, slot_stride, slots_ptr, rep_ptr,
                      freq_ptr, pres_ptr, counts_ptr, counts_stride, hist_ptr, hist_stride, base_ptr, ahead_ptr,
                      max_model_len, HAS_MASK, HAS_PENALTIES, HAS_DRAFTS, MAX_AHEAD)

    @triton.jit
    def _refresh_kernel(counts_ptr, counts_stride, stale_ptr, rows_ptr, hist_ptr, hist_stride, prompt_len_ptr,
                        known_ptr, vocab_size, CLEAR: tl.constexpr, BLOCK: tl.constexpr, HBLOCK: tl.constexpr):
        e = tl.program_id(0)
        row = tl.load(rows_ptr + e).to(tl.int64)
        todo = tl.load(stale_ptr + row).to(tl.int32)
        # The first entry of a repeated row rebuilds it (atomics would count twice).
        for start in range(0, e * todo, HBLOCK):
            o = start + tl.arange(0, HBLOCK)
            earlier = tl.load(rows_ptr + o, mask=o < e, other=-1).to(tl.int64)
            todo = todo * (1 - tl.max((earlier == row).to(tl.int32), axis=0))
        if todo != 0:
            base = counts_ptr + row * counts_stride
            for v0 in range(0, vocab_size, BLOCK):
                o = v0 + tl.arange(0, BLOCK)
                tl.store(base + o, tl.zeros([BLOCK], dtype=base.dtype.element_ty), mask=o < vocab_size)
            tl.debug_barrier()  # the zeros land before any thread of this program counts
            prompt_len = tl.load(prompt_len_ptr + row).to(tl.int64)
            known = tl.load(known_ptr + e).to(tl.int64)
            end = tl.maximum(known, prompt_len)  # the whole prompt counts, as in token_counts
            for p0 in range(0, end, HBLOCK):
                p = p0 + tl.arange(0, HBLOCK)
                is_prompt = p < prompt_len
                is_output = (p >= prompt_len) & (p < known)
                tok = tl.load(hist_ptr + row * hist_stride + p, mask=is_prompt | is_output, other=0).to(tl.int64)
                set_prompt_flag(base, tok, is_prompt)
                add_count(base, tok, is_output)
            if CLEAR:
                tl.debug_barrier()
                tl.store(stale_ptr + row, 0)


def _u8(t: torch.Tensor) -> torch.Tensor:
    """A bool tensor as uint8 (the kernels load flags as bytes)."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def refresh_counts(
    counts: torch.Tensor,  # [rows, V] int16 | int32 (state/counts.py), persistent, updated in place
    stale: torch.Tensor,  # [rows] bool, persistent
    all_token_ids: torch.Tensor,  # [rows, L] int32
    idx_mapping: torch.Tensor,  # [R] int32 | int64 batch entry -> row
    prompt_len: torch.Tensor,  # [rows] int32 original prompt lengths (SamplingStates.prompt_len)
    known_len: torch.Tensor,  # [R] int: history positions each entry's counts cover
    clear: bool,
    use_triton_kernel: bool,
) -> None:
    """Rebuild the counts of the batch's stale rows as `processors.token_counts` (prompt flag
    for positions < prompt_len, +1 per output occurrence at prompt_len <= p < known_len); rows
    not stale are left alone. `clear` marks them current (the step body, which passes the
    history length known at admission).
    A stale row repeated in the batch is rebuilt by its first entry. Graph-safe."""
    if not use_triton_kernel:
        rows = idx_mapping.long()
        refresh_counts_torch(counts, stale, all_token_ids, rows, prompt_len[rows].long(), known_len.long(), clear)
        return
    check_counts(counts)
    num_reqs = idx_mapping.shape[0]
    _refresh_kernel[(num_reqs,)](
        counts, counts.stride(0), _u8(stale), idx_mapping, all_token_ids, all_token_ids.stride(0), prompt_len,
        known_len, counts.shape[1], CLEAR=clear, BLOCK=4096, HBLOCK=_HISTORY_BLOCK,
    )


def process_logits_triton(
    logits: torch.Tensor,  # [R, V] float32 raw logits (unit stride in V)
    out: torch.Tensor,  # [R, V] float32 processed logits, written (a persistent buffer)
    states: SamplingStates,
    idx_mapping: torch.Tensor,  # [R] int32 | int64 batch entry -> row
    positions: torch.Tensor,  # [R] int: position of the token each entry samples
    stages: tuple[bool, bool, bool, bool],  # (mask, bias, min_tokens, penalties) the pass applies
    slots: torch.Tensor | None = None,  # [R] int64 grammar slot of each entry; None: slot 0
    drafts: tuple[torch.Tensor, torch.Tensor, int] | None = None,  # (base [R], ahead [R], max_ahead)
    stats: LogprobStats | None = None,  # filled with the raw logits' partials (logprobs_fused) when given
) -> torch.Tensor:  # out
    """Every enabled processor in one dense pass plus a sparse fix-up (see the module docstring)."""
    s = states
    has_mask, has_bias, has_stop, has_penalties = stages
    num_reqs, vocab_size = logits.shape
    device = logits.device
    any_int = idx_mapping  # stands in for unused pointer arguments (never read)
    if has_mask:
        assert s.allowed_mask is not None and s.grammar_mask is not None
        masks = (_u8(s.use_allowed), s.allowed_mask, s.allowed_mask.stride(0), _u8(s.use_grammar), s.grammar_mask,
                 s.grammar_mask.stride(0), s.grammar_mask.stride(1),
                 slots if slots is not None else torch.zeros(num_reqs, dtype=torch.int64, device=device))
    else:
        masks = (any_int, any_int, 0, any_int, any_int, 0, 0, any_int)
    history = s.all_token_ids if s.all_token_ids is not None else any_int[None]
    base, ahead, max_ahead = drafts if drafts is not None else (any_int, any_int, 0)
    if has_penalties:
        assert s.counts is not None
        penal = (s.repetition_penalty, s.frequency_penalty, s.presence_penalty, s.counts, s.counts.stride(0),
                 history, history.stride(0), base, ahead, history.shape[1])
    else:
        penal = (s.repetition_penalty, s.frequency_penalty, s.presence_penalty, any_int, 0, any_int, 0, any_int,
                 any_int, 1)
    flags = dict(HAS_MASK=has_mask, HAS_PENALTIES=has_penalties, HAS_DRAFTS=has_penalties and max_ahead > 0,
                 MAX_AHEAD=max_ahead)
    _dense(logits, out, idx_mapping, masks, penal, flags, stats)
    num_bias = s.bias_ids.shape[1] if has_bias else 0
    num_stop = s.stop_ids.shape[1] if has_stop else 0
    if num_bias + num_stop > 0:
        _sparse_kernel[(num_reqs,)](  # one program per entry: all its bias and stop slots
            logits, logits.stride(0), out, out.stride(0), idx_mapping, positions, *masks, *penal, s.bias_ids,
            s.bias_values, num_bias, s.stop_ids, num_stop, s.prompt_len, s.min_tokens, **flags,
            BIAS_PAD=triton.next_power_of_2(max(num_bias, 1)), STOP_PAD=triton.next_power_of_2(max(num_stop, 1)),
            enable_fp_fusion=False)
    return out


def _dense(logits: torch.Tensor, out: torch.Tensor, idx_mapping: torch.Tensor, masks: tuple, penal: tuple,
           flags: dict, stats: LogprobStats | None) -> None:
    """Launch the dense kernel over [R, cdiv(V, tile)] programs; with `stats`, its tile is the scratch's."""
    num_reqs, vocab_size = logits.shape
    if stats is not None:
        if not stats.fits(num_reqs, vocab_size):
            raise ValueError(f"stats scratch {tuple(stats.tile_m.shape)} does not cover {num_reqs} x {vocab_size}")
        tile, group = stats.tile, stats.group
        scratch = (stats.tile_m, stats.tile_acc, stats.tile_nan, stats.num_tiles, stats.group_keys, stats.num_groups)
    else:
        tile, group = _BLOCK, GROUP
        scratch = (logits, logits, idx_mapping, 1, idx_mapping, 1)  # never written (STATS off)
    grid = (num_reqs, triton.cdiv(vocab_size, tile))
    _dense_kernel[grid](logits, logits.stride(0), out, out.stride(0), idx_mapping, vocab_size, *masks, *penal,
                        *scratch, **flags, STATS=stats is not None, GROUPS=tile // group, GROUP=group,
                        enable_fp_fusion=False)
