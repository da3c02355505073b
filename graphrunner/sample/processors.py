"""Logit processors that run before temperature: allowed ids, logit bias, min_tokens, penalties.

All take the batch's logits `x` [R, V] float32 and per-entry settings gathered from
the persistent state rows, return a new [R, V] tensor, and are neutral (bit-exact
identity) for rows that do not use them: the all-features graph relies on that.
Graph-safe: shapes depend only on R, V, the slot counts and max_model_len.
"""

from __future__ import annotations

import torch

from graphrunner.state.counts import PACKED32_FLAG, as_packed32, from_packed32

# Token counts pack prompt presence and output count in one int32 [R, V + 1] buffer:
# a prompt occurrence sets bit 24, output occurrences add 1 each. Needs
# max_model_len < 2**24 (checked) so the output count never reaches the flag. The
# persistent counts may be int16 (state/counts.py); these functions take either form.
PROMPT_FLAG = PACKED32_FLAG
_COUNT_MASK = PROMPT_FLAG - 1


def apply_allowed(x: torch.Tensor, allowed_words: torch.Tensor, use_allowed: torch.Tensor) -> torch.Tensor:
    """Tokens outside a row's allowed set get -inf.

    x: [R, V]; allowed_words: [R, ceil(V/32)] int32 bitmask; use_allowed: [R] bool.
    """
    vocab_size = x.shape[-1]
    shifts = torch.arange(32, device=x.device, dtype=torch.int32)  # [32]
    bits = ((allowed_words[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab_size]  # [R, V]
    drop = use_allowed[:, None] & (bits == 0)
    return x.masked_fill(drop, float("-inf"))


def apply_logit_bias(x: torch.Tensor, bias_ids: torch.Tensor, bias_values: torch.Tensor) -> torch.Tensor:
    """x[r, bias_ids[r, j]] += bias_values[r, j]. Unused slots are (0, +0.0): exact no-ops.

    bias_ids: [R, B] int64, bias_values: [R, B] float32. Ids in a row are distinct, so
    the order of the adds cannot change a result.
    """
    return x.scatter_add(1, bias_ids, bias_values)


def apply_min_tokens(
    x: torch.Tensor,  # [R, V]
    stop_ids: torch.Tensor,  # [R, S] int64; unused slots repeat a real id
    min_tokens: torch.Tensor,  # [R] int32, 0 = off
    num_output: torch.Tensor,  # [R] int64 output tokens generated before this one
) -> torch.Tensor:
    """Stop ids (and EOS) get -inf while fewer than min_tokens tokens were generated.

    Adds -inf (active) or 0 (inactive) at each slot: repeated ids add -inf twice, which
    is still -inf, so duplicates are harmless and the result order-independent.
    """
    active = num_output < min_tokens.to(torch.int64)  # [R]
    add = torch.where(active, float("-inf"), 0.0)[:, None].expand(stop_ids.shape).to(x.dtype)  # [R, S]
    return x.scatter_add(1, stop_ids, add)


def token_counts(
    all_token_ids: torch.Tensor,  # [rows, L] int32, the token history
    rows: torch.Tensor,  # [R] int64 state rows of the batch
    prompt_len: torch.Tensor,  # [R] int64 original prompt lengths
    seq_len: torch.Tensor,  # [R] int64 tokens known before the one being sampled
    vocab_size: int,
) -> torch.Tensor:  # [R, V] int32: PROMPT_FLAG if in the prompt, + output count
    """Prompt presence and output counts per token, from the history of positions < seq_len.

    Positions outside a part are sent to a trash column V (then dropped), so every
    scatter has a fixed shape [R, L] and no value-dependent work.
    """
    max_model_len = all_token_ids.shape[1]
    if max_model_len >= PROMPT_FLAG:
        raise ValueError(f"max_model_len={max_model_len} too large for packed token counts (limit {PROMPT_FLAG - 1})")
    tokens = all_token_ids[rows].to(torch.int64)  # [R, L]
    pos = torch.arange(max_model_len, device=tokens.device)[None, :]  # [1, L]
    is_prompt = pos < prompt_len[:, None]
    is_output = ~is_prompt & (pos < seq_len[:, None])
    trash = torch.full_like(tokens, vocab_size)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.int32, device=tokens.device)  # [R, V + 1]
    # scatter_ writes the same value for every duplicate, so it is deterministic.
    counts.scatter_(1, torch.where(is_prompt, tokens, trash), PROMPT_FLAG)
    counts.scatter_add_(1, torch.where(is_output, tokens, trash), torch.ones_like(tokens, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(
    x: torch.Tensor,  # [R, V] float32
    counts: torch.Tensor,  # [R, V] int32 from token_counts, or int16 (state/counts.py)
    repetition: torch.Tensor,  # [R] float32, 1 = off
    frequency: torch.Tensor,  # [R] float32, 0 = off
    presence: torch.Tensor,  # [R] float32, 0 = off
) -> torch.Tensor:
    """vLLM's penalties: repetition over prompt+output tokens (divide positive logits,
    multiply negative ones), then frequency (x count) and presence over output tokens."""
    counts = as_packed32(counts)
    output_count = (counts & _COUNT_MASK).to(x.dtype)  # [R, V]
    seen = counts > 0  # in the prompt or the output
    rep = torch.where(seen, repetition[:, None], 1.0)  # [R, V]
    x = torch.where(x > 0, x / rep, x * rep)
    x = x - frequency[:, None] * output_count
    return x - presence[:, None] * (output_count > 0).to(x.dtype)


def add_draft_counts(
    counts: torch.Tensor,  # [R, V] int16 | int32 packed counts of the history before `base`
    all_token_ids: torch.Tensor,  # [rows, L] int32
    rows: torch.Tensor,  # [R] int64
    base: torch.Tensor,  # [R] int64: the first position the counts do not cover
    ahead: torch.Tensor,  # [R] int64: history positions base .. base + ahead - 1 to add as outputs
    max_ahead: int,  # static bound on `ahead` (the speculative k)
) -> torch.Tensor:  # [R, V] int32 (int16 counts as they are when max_ahead is 0)
    """`counts` plus one output occurrence per token at positions [base, base + ahead).

    Speculative verification: the row of slot j sees the drafts 0..j-1 before it as earlier
    outputs (ahead = j). Positions past max_model_len or past `ahead` go to a trash column.
    """
    if max_ahead == 0:
        return counts
    vocab_size = counts.shape[1]
    max_model_len = all_token_ids.shape[1]
    j = torch.arange(max_ahead, device=counts.device)  # [k]
    pos = base[:, None] + j  # [R, k]
    use = (j < ahead[:, None]) & (pos < max_model_len)
    tokens = all_token_ids[rows[:, None], pos.clamp(max=max_model_len - 1)].long()  # [R, k]
    cols = torch.where(use, tokens, vocab_size)
    extra = torch.zeros(len(rows), vocab_size + 1, dtype=torch.int32, device=counts.device)  # [R, V + 1]
    extra.scatter_add_(1, cols, torch.ones_like(cols, dtype=torch.int32))
    return as_packed32(counts) + extra[:, :vocab_size]


def first_occurrence(rows: torch.Tensor) -> torch.Tensor:  # [R] int64
    """For each entry, the index of the first entry with the same row ([R, R] compare: R is small)."""
    same = rows[:, None] == rows[None, :]  # [R, R]
    return same.to(torch.int8).argmax(dim=1)


def refresh_counts_torch(
    counts: torch.Tensor,  # [rows, V] int16 | int32 (state/counts.py), persistent, updated in place
    stale: torch.Tensor,  # [rows] bool, persistent: rows whose counts are not current
    all_token_ids: torch.Tensor,  # [rows, L] int32
    rows: torch.Tensor,  # [R] int64 batch entry -> row
    prompt_len: torch.Tensor,  # [R] int64 original prompt lengths
    known_len: torch.Tensor,  # [R] int64 history positions to count
    clear: bool,
) -> None:
    """Torch reference of `fused_process.refresh_counts`: stale rows rebuilt from their history.

    An entry whose row is stale gets `token_counts` of positions < known_len (the first entry
    of a repeated row decides, so duplicates write identical values); other rows are
    rewritten with their own values. `clear` marks the rebuilt rows current.
    """
    first = first_occurrence(rows)  # [R]
    rebuilt = token_counts(all_token_ids, rows, prompt_len, known_len, counts.shape[1])[first]  # [R, V] int32
    rebuilt = from_packed32(rebuilt, counts.dtype)
    was_stale = stale[rows]  # [R]
    counts[rows] = torch.where(was_stale[:, None], rebuilt, counts[rows])
    if clear:
        stale[rows] = False
