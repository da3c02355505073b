"""Graph-safe token sampling: the whole pipeline, from persistent per-row state.

Order (vLLM's), per batch entry:
  1. allowed-ids mask, logit bias, min_tokens mask (stop ids/EOS -inf until reached)
  2. penalties (repetition over prompt+output, frequency/presence over output), from the
     persistent per-row counts (SamplingStates.counts); on CUDA 1-2 are one fused pass
     (fused_process.py) into a persistent buffer
  3. logprobs are of the RAW logits (before 1-2), written after sampling; when 1-2 ran as
     the fused pass, from the raw-logit statistics it left (logprobs_fused.py)
  4. greedy rows: argmax of the processed logits (after 1-2)
  5. random rows: temperature -> min-p -> top-k -> top-p -> Gumbel-max, with noise
     from a stateless hash of (seed, position, token id), so a seeded request's tokens
     do not depend on its batch, graph mode, replays or preemption. The filters are
     sort-free per-row thresholds (filters.py; on CUDA pivot_select.py, ~20x faster than
     a segmented sort at 256 rows on an H100).
A plain-greedy batch (argmax of the raw logits) does not come here: the LM head takes
its argmax (layers/embedding.py's `greedy`, with greedy_head.py's kernel on a GPU).

Per-request settings live in `SamplingStates` rows (written with staged writes at
admission); a step gathers them through `idx_mapping`. Everything is sized by the
padded R, V, max_model_len and slot counts: no host sync, no value-dependent shapes.
`SamplingFeatures` (static per graph) only skips stages; each stage is an exact
identity for rows that do not use it, so the all-features variant matches any batch.
"""

from __future__ import annotations

import torch

from graphrunner.kernels import use_triton
from graphrunner.sample import rng
from graphrunner.sample.argmax import argmax_rows
from graphrunner.sample.filters import apply_filters
from graphrunner.sample.fused_process import process_logits_triton, refresh_counts
from graphrunner.sample.logprobs import compute_logprobs
from graphrunner.sample.logprobs_fused import LogprobStats, logprobs_from_stats, stats_usable
from graphrunner.sample.pivot_select import pivot_sample_triton
from graphrunner.sample.processors import (
    add_draft_counts,
    apply_allowed,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    token_counts,
)
from graphrunner.sample.row_params import gather_row_params
from graphrunner.state.features import SamplingFeatures
from graphrunner.state.sampling import SamplingStates

__all__ = ["Sampler", "apply_top_k_top_p"]


def apply_top_k_top_p(
    logits: torch.Tensor,  # [R, V] float32, already temperature-scaled
    top_k: torch.Tensor,  # [R] int32, 0 = off
    top_p: torch.Tensor,  # [R] float32, 1 = off
    use_top_k: bool,
    use_top_p: bool,
) -> torch.Tensor:  # [R, V] with filtered-out entries at -inf
    """Top-k then top-p, sort-free (see filters.py)."""
    no_min_p = torch.zeros_like(top_p)
    return apply_filters(logits, top_k, top_p, no_min_p, use_top_k, use_top_p, False)


class Sampler:
    """Turns the logits of the sampled rows into one token per row, graph-safely.

    CUDA logits take the fused Triton kernels (one processing pass, pivot_select's sort-free
    min-p / top-k / top-p, logprobs from the pass's statistics); other logits the torch
    reference, which gives the same tokens.

    Args:
        states: the per-row settings (and, for penalties, `states.counts` and `states.all_token_ids`).
        _fused: None (the rule above); True / False: the fused kernels or the torch reference on any
            device (tests: the kernels under TRITON_INTERPRET=1 on CPU, the reference on a GPU).

    Non-finite logits (a faulty model or kernel) are not detected (that would cost a host
    sync) but are contained: every stage works row by row, so NaN or +-inf in one row never
    changes another row's token or logprobs, and the bad row still gets a token id in
    [0, V) (tests/engine/test_fault_step.py checks every variant, both paths). The bad row's
    token is meaningless; which one it is: the first +inf entry, if any survives the masks
    (allowed ids, min_tokens); token 0 for a row of only -inf; for a greedy row (and any row
    of the greedy variant) the first NaN entry, as `torch.argmax` ranks NaN above every
    number; for a random row with NaN entries some entry of the row (the torch path picks a
    NaN, the Triton kernels skip NaN entries, an all-NaN row giving 0). Its logprobs are NaN
    or +-inf, their token ids and rank in range.
    """

    def __init__(self, states: SamplingStates, *, _fused: bool | None = None):
        self.states = states
        self._fused = _fused
        # Persistent scratch of the fused pass's logprob statistics (logprobs_fused), allocated up
        # front on CUDA, where graphs are captured; elsewhere on first use.
        self._stats: LogprobStats | None = None
        if states.device.type == "cuda" and states.vocab_size is not None and self._use_triton(
                torch.empty(0, device=states.device)):
            self._stats = LogprobStats.allocate(states.num_rows * states.grammar_slots, states.vocab_size,
                                                states.device)

    def _use_triton(self, x: torch.Tensor) -> bool:
        return use_triton(x) if self._fused is None else self._fused

    def __call__(
        self,
        logits: torch.Tensor,  # [R, V] float32 raw logits
        idx_mapping: torch.Tensor,  # [R] int32: batch entry -> state row
        positions: torch.Tensor,  # [R] int: position of the token being sampled (= seq_len)
        features: SamplingFeatures,
        out: torch.Tensor,  # [R] int32, written in place
        *,
        all_token_ids: torch.Tensor | None = None,  # [rows, L] int32 history to count (reference path);
        # default: the persistent counts
        out_logprobs: torch.Tensor | None = None,  # [R, >= K+1] float32 when features.wants_logprobs
        out_logprob_ids: torch.Tensor | None = None,  # [R, >= K+1] int32
        out_ranks: torch.Tensor | None = None,  # [R] int32
    ) -> torch.Tensor:
        k = features.num_logprobs
        buffers = (out_logprobs, out_logprob_ids, out_ranks)
        # A caller that returns no logprobs passes no buffers (then none are computed);
        # a caller that passes them must pass all three, wide enough for the batch's K.
        want_logprobs = features.wants_logprobs and not all(b is None for b in buffers)
        if want_logprobs:
            if out_logprobs is None or out_logprob_ids is None or out_ranks is None:
                raise ValueError(f"features ask for {k} logprobs: pass out_logprobs, out_logprob_ids and out_ranks")
            if out_logprobs.shape[1] < k + 1 or out_logprob_ids.shape[1] < k + 1:
                raise ValueError(f"logprob buffers have {out_logprobs.shape[1]} columns, need >= {k + 1}")

        # With logprobs, a fused processing pass also leaves the raw logits' statistics
        # (logprobs_fused), so the logprobs need no second read of the logits.
        stages = self._stages(features, all_token_ids)
        fused = self._fuses(logits, stages, all_token_ids)
        stats = self._logprob_stats(logits, k) if want_logprobs and fused else None
        x = self._process(logits, idx_mapping, positions, features, all_token_ids, stats=stats, stages=stages)
        if features.any_random and self._use_triton(x):
            self._sample_pivot(x, idx_mapping, positions, features, out)
        elif features.any_random:
            out.copy_(self._sample_random(x, idx_mapping.long(), positions, features))
        else:
            argmax_rows(x, out=out)  # torch.argmax's indices; split over many programs per row on CUDA
        if want_logprobs:
            assert out_logprobs is not None and out_logprob_ids is not None and out_ranks is not None
            if stats is not None:  # the fused pass filled it
                logprobs_from_stats(logits, out, k, out_logprobs, out_logprob_ids, out_ranks, stats)
            else:
                compute_logprobs(logits, out, k, out_logprobs, out_logprob_ids, out_ranks)
        return out

    def target_logits(
        self,
        logits: torch.Tensor,  # [N, V] float32 raw logits
        idx_mapping: torch.Tensor,  # [N] int32: sampled position -> state row
        positions: torch.Tensor,  # [N] int: position of the token each row samples
        features: SamplingFeatures,
        slots: torch.Tensor | None = None,  # [N] int64: each row's sampled slot (its grammar mask); None: 0
    ) -> torch.Tensor:  # [N, V] float32
        """The target distribution of speculative verification (spec_decode.rejection).

        The processed logits (steps 1-2 of the module docstring) with -inf where min-p,
        top-k or top-p drop a token of a random row, the filters computed on the
        temperature-scaled logits exactly as `__call__` does: `result / T` is then what
        the plain sampler draws from, bit for bit. Rows of one request at consecutive
        positions see the history up to their own position (penalties, min_tokens) and
        their own slot's grammar mask (`SamplingStates.grammar_mask[row, slot]`).
        """
        rows = idx_mapping.long()  # [N]
        x = self._process(logits, rows, positions, features, None, slots)
        if not features.any_random:
            return x
        is_greedy = self.states.temperature[rows] == 0.0  # [N]
        kept = self._scaled_and_filtered(x, rows, features)  # [N, V]
        dropped = (kept == float("-inf")) & ~is_greedy[:, None]  # [N, V]
        return x.masked_fill(dropped, float("-inf"))

    def _scaled_and_filtered(self, x: torch.Tensor, rows: torch.Tensor,
                             features: SamplingFeatures) -> torch.Tensor:  # [R, V]
        """x / T (T = 1 for greedy rows), then min-p / top-k / top-p at -inf (filters.py)."""
        s = self.states
        temperature = s.temperature[rows]  # [R]
        scaled = x / torch.where(temperature == 0.0, 1.0, temperature)[:, None]  # [R, V]
        return apply_filters(scaled, s.top_k[rows], s.top_p[rows], s.min_p[rows], features.any_top_k,
                             features.any_top_p, features.any_min_p)

    def _process(
        self,
        logits: torch.Tensor,  # [R, V] float32 raw logits
        rows: torch.Tensor,  # [R] int32 | int64 state rows
        positions: torch.Tensor,  # [R]
        features: SamplingFeatures,
        all_token_ids: torch.Tensor | None,  # a history to count instead of the persistent counts
        slots: torch.Tensor | None = None,  # [R] int64 sampled slot of each row (grammar mask); None: slot 0
        stats: LogprobStats | None = None,  # the fused pass fills it (logprobs_fused); others leave it alone
        stages: tuple[bool, bool, bool, bool] | None = None,  # `_stages(features, all_token_ids)`, if known
    ) -> torch.Tensor:  # [R, V] float32
        """Steps 1-2: allowed ids, logit bias, min_tokens, penalties (each skipped when off).

        CUDA: one fused pass (fused_process.py) into the states'
        persistent processed-logits buffer; else the torch processors. Penalties read the
        persistent counts (rows still stale are first rebuilt from the history before their
        sampled position, see SamplingStates) plus, for a slot j of speculative verification,
        the j drafts before it; an explicit `all_token_ids` is counted instead (the reference).
        """
        s = self.states
        if stages is None:
            stages = self._stages(features, all_token_ids)
        if not any(stages):
            return logits
        rows = rows.long()  # [R] (a no-op for int64; the sampled-only step has no stage and no copy)
        drafts = None
        if stages[3] and all_token_ids is None:
            drafts = self._current_counts(logits, rows, positions, slots)
        if self._fuses(logits, stages, all_token_ids):
            out = s.processed_logits(logits.shape[0], logits.shape[1])  # [R, V] persistent
            return process_logits_triton(logits, out, s, rows, positions, stages, slots, drafts, stats)
        return self._process_torch(logits, rows, positions, stages, all_token_ids, drafts, slots)

    def _stages(self, features: SamplingFeatures,
                all_token_ids: torch.Tensor | None) -> tuple[bool, bool, bool, bool]:
        """(mask, bias, min_tokens, penalties): the processors `_process` applies."""
        s = self.states
        has_mask = features.any_logit_bias and s.allowed_mask is not None and s.grammar_mask is not None
        # Without counts validate() rejects every request with penalties, so skipping them is
        # exact (this keeps the all-features variant usable on such runners).
        has_penalties = features.any_penalties and (all_token_ids is not None or s.counts is not None)
        return has_mask, features.any_logit_bias, features.any_min_tokens, has_penalties

    def _fuses(self, logits: torch.Tensor, stages: tuple[bool, bool, bool, bool],
               all_token_ids: torch.Tensor | None) -> bool:
        """Whether `_process` runs the fused Triton pass (which can fill logprob stats)."""
        fits = all_token_ids is None and logits.dtype == torch.float32 and logits.stride(-1) == 1
        return any(stages) and fits and self._use_triton(logits)

    def _logprob_stats(self, logits: torch.Tensor, num_logprobs: int) -> LogprobStats | None:
        """The persistent stats scratch for these logits, when the fused pass can fill it (Triton, fp32,
        K within the select kernel's limit); allocated on first use, which must precede graph capture."""
        if not (self._use_triton(logits) and stats_usable(logits, num_logprobs)):
            return None
        num, vocab_size = logits.shape
        if self._stats is None or not self._stats.fits(num, vocab_size):
            if logits.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"logprob stats scratch for {num} x {vocab_size} must exist before graph capture")
            rows = max(num, self.states.num_rows * self.states.grammar_slots)
            self._stats = LogprobStats.allocate(rows, vocab_size, logits.device)
        return self._stats

    def _current_counts(self, logits: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                        slots: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """Rebuild stale rows (callers without a step body) from the history before each entry's
        first sampled position; return the drafts each slot adds: (base [R], ahead [R], max_ahead)."""
        s = self.states
        assert s.counts is not None and s.all_token_ids is not None
        base = positions.long() if slots is None else positions.long() - slots  # [R]
        refresh_counts(s.counts, s.counts_stale, s.all_token_ids, rows, s.prompt_len, base, clear=False,
                       use_triton_kernel=self._use_triton(logits))
        if slots is None or s.grammar_slots == 1:
            return None
        return base, slots, s.grammar_slots - 1

    def _process_torch(self, logits: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                       stages: tuple[bool, bool, bool, bool], all_token_ids: torch.Tensor | None,
                       drafts: tuple[torch.Tensor, torch.Tensor, int] | None,
                       slots: torch.Tensor | None) -> torch.Tensor:  # [R, V] float32
        """The torch processors: separate [R, V] passes (the reference of the fused kernels)."""
        s = self.states
        has_mask, has_bias, has_stop, has_penalties = stages
        x = logits
        seq_len = positions.long()  # [R]
        prompt_len = s.prompt_len[rows].long()  # [R]
        if has_bias:
            if has_mask:
                assert s.allowed_mask is not None and s.grammar_mask is not None
                # allowed ids AND the step's grammar mask, one [R, V] pass (an unused mask is all ones)
                allowed = torch.where(s.use_allowed[rows, None], s.allowed_mask[rows], -1)  # [R, W] int32
                masks = s.grammar_mask[rows, 0] if slots is None else s.grammar_mask[rows, slots]  # [R, W] int32
                grammar = torch.where(s.use_grammar[rows, None], masks, -1)  # [R, W] int32
                x = apply_allowed(x, allowed & grammar, s.use_allowed[rows] | s.use_grammar[rows])
            x = apply_logit_bias(x, s.bias_ids[rows], s.bias_values[rows])
        if has_stop:
            num_output = (seq_len - prompt_len).clamp(min=0)  # [R] tokens generated before this one
            x = apply_min_tokens(x, s.stop_ids[rows], s.min_tokens[rows], num_output)
        if has_penalties:
            if all_token_ids is not None:
                counts = token_counts(all_token_ids, rows, prompt_len, seq_len, x.shape[-1])  # [R, V] int32
            else:
                assert s.counts is not None and s.all_token_ids is not None
                counts = s.counts[rows]  # [R, V] int16 | int32 (state/counts.py)
                if drafts is not None:
                    counts = add_draft_counts(counts, s.all_token_ids, rows, *drafts)
            x = apply_penalties(x, counts, s.repetition_penalty[rows], s.frequency_penalty[rows],
                                s.presence_penalty[rows])
        return x

    def _sample_random(
        self,
        x: torch.Tensor,  # [R, V] processed logits
        rows: torch.Tensor,  # [R] int64
        positions: torch.Tensor,  # [R]
        features: SamplingFeatures,
    ) -> torch.Tensor:  # [R] int64
        """The torch reference of `_sample_pivot`: the same tokens."""
        s = self.states
        is_greedy = s.temperature[rows] == 0.0  # [R]
        greedy = argmax_rows(x)  # [R] int64
        scaled = self._scaled_and_filtered(x, rows, features)  # [R, V]
        keys = rng.row_keys(s.seed[rows], positions.long())  # [R]
        sampled = (scaled + rng.gumbel(keys, x.shape[-1])).argmax(dim=-1)  # [R]
        return torch.where(is_greedy, greedy, sampled)

    def _sample_pivot(
        self,
        x: torch.Tensor,  # [R, V] float32 processed logits
        idx_mapping: torch.Tensor,  # [R] int32 | int64 state rows
        positions: torch.Tensor,  # [R]
        features: SamplingFeatures,
        out: torch.Tensor,  # [R] int32 | int64, written in place
    ) -> None:
        """The filters and the draw on the Triton kernels: the rows' settings and keys in one gather
        (row_params.py), then threshold and draw in one or two reads of x (pivot_select.py);
        greedy rows get argmax(x). The token goes straight into `out`."""
        p = gather_row_params(self.states, idx_mapping, positions)
        threshold = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)  # [R]
        pivot_sample_triton(x.contiguous().float(), p.temperature, p.keys, p.top_k, p.top_p, p.min_p,
                            features.any_top_k, features.any_top_p, features.any_min_p, out, threshold)
