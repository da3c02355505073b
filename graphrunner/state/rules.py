"""The rules a SchedulerOutput must satisfy, each defined once.

A rule is a predicate that says where it is violated, written with numpy operators so
that one definition serves a single request (scalars) and a whole batch (arrays), and
the words of its error, which name the offending value and the limit. The three checks
in `graphrunner.state.validation` — the per-request reference, the vectorised batch check
and the steady-decode shortcut — all evaluate these definitions; none restates a rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphrunner.limits import StepLimits


@dataclass(frozen=True)
class Rows:
    """Per scheduled request (arrays [S], or scalars for one request): `n` tokens scheduled
    now, `computed` tokens already computed, `known` tokens known (prompt + outputs),
    `held` KV blocks held after this step's new blocks."""

    n: Any
    computed: Any
    known: Any
    held: Any


@dataclass(frozen=True)
class Rule:
    name: str
    violated: Callable[[Rows, StepLimits], Any]  # True where violated (bool or [S] bool)
    message: Callable[[str, Rows, StepLimits], str]  # the error for one request


def token_limit(held: Any, limits: StepLimits) -> Any:
    """The most tokens a request holding `held` blocks may reach: the bound that the
    `max_model_len` and `blocks_held` rules together put on `computed + n`."""
    return np.minimum(np.asarray(held, dtype=np.int64) * limits.block_size, limits.max_model_len)


AT_LEAST_ONE_TOKEN = Rule(
    "at_least_one_token", lambda r, L: r.n < 1,
    lambda rid, r, L: f"request {rid!r}: {r.n} scheduled tokens; must be >= 1")
MAX_MODEL_LEN = Rule(
    "max_model_len", lambda r, L: r.computed + r.n > L.max_model_len,
    lambda rid, r, L: f"request {rid!r}: {r.computed + r.n} tokens would exceed max_model_len={L.max_model_len}")
CHUNK_WITHIN_KNOWN = Rule(
    "chunk_within_known", lambda r, L: (r.computed < r.known) & (r.computed + r.n > r.known),
    lambda rid, r, L: f"request {rid!r}: chunk [{r.computed}, {r.computed + r.n}) runs past its {r.known} known "
                      "tokens (the next token is not sampled yet)")
DECODE_LENGTH = Rule(
    "decode_length", lambda r, L: (r.computed >= r.known) & (r.n != 1),
    lambda rid, r, L: f"request {rid!r}: a decode step takes exactly 1 token, got {r.n}")
BLOCKS_HELD = Rule(
    "blocks_held", lambda r, L: r.computed + r.n > np.asarray(r.held, dtype=np.int64) * L.block_size,
    lambda rid, r, L: f"request {rid!r}: {r.computed + r.n} tokens need "
                      f"{-(-(r.computed + r.n) // L.block_size)} blocks, it holds {r.held}")

# Checked in this order for each scheduled request: the reference raises the first.
SCHEDULED_RULES: tuple[Rule, ...] = (AT_LEAST_ONE_TOKEN, MAX_MODEL_LEN, CHUNK_WITHIN_KNOWN, DECODE_LENGTH, BLOCKS_HELD)
# The rules on a chunk's shape (not on room): they do not read `held`.
SHAPE_RULES: tuple[Rule, ...] = (AT_LEAST_ONE_TOKEN, CHUNK_WITHIN_KNOWN, DECODE_LENGTH)


def first_violation(rules: tuple[Rule, ...], rows: Rows, limits: StepLimits) -> Rule | None:
    """The first rule one request (scalar `rows`) violates, or None."""
    return next((rule for rule in rules if bool(rule.violated(rows, limits))), None)


def any_violated(rules: tuple[Rule, ...], rows: Rows, limits: StepLimits) -> bool:
    """Whether any request of the batch (array `rows`) violates any rule."""
    return any(bool(np.any(rule.violated(rows, limits))) for rule in rules)


# ---- KV blocks -------------------------------------------------------------------------
def block_ids_out_of_range(block_ids: Any, num_kv_blocks: int) -> Any:
    ids = np.asarray(block_ids, dtype=np.int64)
    return (ids < 0) | (ids >= num_kv_blocks)


def too_many_blocks(total: Any, limits: StepLimits) -> Any:
    return np.asarray(total) > limits.max_num_blocks_per_req


def block_ids_message(req_id: str, block_id: int, num_kv_blocks: int) -> str:
    return f"request {req_id!r}: block id {block_id} out of range [0, {num_kv_blocks})"


def too_many_blocks_message(req_id: str, total: int, limits: StepLimits) -> str:
    return (f"request {req_id!r}: {total} blocks exceed the per-request limit of {limits.max_num_blocks_per_req} "
            f"(max_model_len={limits.max_model_len}, block_size={limits.block_size})")


# ---- the batch ---------------------------------------------------------------------------
def batch_violation(total: int, claimed_total: int, num_scheduled: int, limits: StepLimits) -> str | None:
    """The error of the batch-size rules, or None."""
    if total != claimed_total:
        return f"total_num_scheduled_tokens={claimed_total} but num_scheduled_tokens sums to {total}"
    if total > limits.max_num_tokens:
        return f"{total} scheduled tokens exceed max_num_batched_tokens={limits.max_num_tokens}"
    if num_scheduled > limits.max_num_reqs:
        return f"{num_scheduled} scheduled requests exceed max_num_seqs={limits.max_num_reqs}"
    return None


def prompt_violation(req_id: str, tokens: list[int], num_computed: int, limits: StepLimits) -> str | None:
    """The error of a new request's prompt rules, or None (token ids are ints: NewRequestData checks)."""
    if not tokens:
        return f"request {req_id!r} has an empty prompt"
    if len(tokens) > limits.max_model_len:
        return f"request {req_id!r}: {len(tokens)} tokens exceed max_model_len={limits.max_model_len}"
    arr = np.asarray(tokens)
    if arr.dtype.kind not in "iu":
        first = next(t for t in tokens if isinstance(t, bool) or not isinstance(t, (int, np.integer)))
        return f"request {req_id!r}: token id {first!r} is not an integer"
    bad = (arr < 0) | (arr >= limits.vocab_size)
    if bad.any():
        return (f"request {req_id!r}: token id {int(arr[bad.argmax()])} outside the vocabulary "
                f"[0, {limits.vocab_size})")
    if not 0 <= num_computed < len(tokens):
        return f"request {req_id!r}: num_computed_tokens={num_computed} must be in [0, {len(tokens)})"
    return None
