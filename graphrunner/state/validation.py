"""Checks a SchedulerOutput against the runner's limits and state before anything changes.

Every rule (`graphrunner.state.rules`) raises ValueError naming the offending value and
the limit. Because all checks run before the first state change, a rejected step leaves
the runner exactly as it was and the next valid step proceeds normally.

Three checks evaluate the same rule definitions:
- `validate_reference` goes request by request in Python and words every error;
- `_validate_vectorized` (what the runner calls for a general step) checks whole
  batches with numpy, so a step of hundreds of requests costs microseconds;
- `_validate_steady_decode` (a repeated decode batch) checks only what can change
  between such steps, in a handful of C-level calls.
On any violation the fast checks hand over to the reference, which finds the first
offending value and raises with its message. Tests check that all three accept exactly
the same inputs. Field types (`check_field_types`) are checked on every step, first:
the runner runs them before it reads any field to look for a steady-decode plan.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from graphrunner.limits import StepLimits
from graphrunner.protocol import CachedRequestData, NewRequestData, SchedulerOutput
from graphrunner.state.rules import (
    SCHEDULED_RULES,
    SHAPE_RULES,
    BlockClaim,
    Rows,
    any_violated,
    batch_violation,
    block_ids_message,
    block_ids_out_of_range,
    block_sharing_violation,
    container_type_violation,
    field_type_violation,
    first_violation,
    first_written_block,
    prompt_violation,
    spec_tokens_violation,
    steady_type_violation,
    token_limit,
    too_many_blocks,
    too_many_blocks_message,
)
from graphrunner.state.store import StateStore


class _Invalid(Exception):
    """Raised inside a fast check: some rule fails; the reference words it."""


@dataclass
class DecodeHint:
    """What the runner knows about a repeated uniform-decode batch (its steady-decode plan).

    rows: [R] int64 state rows, in batch order. limit: [R] int64, per row the most tokens
    it may hold (`rules.token_limit` of its blocks). all_decode: every row had all its
    known tokens computed after the step the plan was made in (so each of them can only
    decode from then on). rows_index: `rows` as a slice where they are consecutive (a
    cheaper gather), else None.
    """

    rows: np.ndarray
    limit: np.ndarray
    all_decode: bool
    rows_index: slice | None = None
    # (computed[0], min(limit - computed), min(computed)) at one step: every row of an
    # all-decode plan advances by the same q per step, so the room and the lowest count of
    # all rows follow from row 0 alone.
    room_ref: tuple[int, int, int] | None = None
    # Whether q tokens per row pass the shape rules once every row decodes (set on first use).
    decode_shape_ok: bool | None = None
    # [int] * R: what the types of the token counts look like (`rules.steady_type_violation`).
    int_row: list[type] = field(init=False)

    def __post_init__(self) -> None:
        self.int_row = [int] * len(self.rows)

    def set_limit(self, limit: np.ndarray) -> None:
        self.limit = limit
        self.room_ref = None


def check_field_types(so: SchedulerOutput) -> None:
    """ValueError naming the first SchedulerOutput field of the wrong type (`rules.field_type_violation`)."""
    error = field_type_violation(so)
    if error:
        raise ValueError(error)


def check_field_containers(so: SchedulerOutput) -> None:
    """ValueError naming the first field whose container is of the wrong type (O(1); the runner
    runs it before it reads any field to look for a steady-decode plan)."""
    error = container_type_violation(so)
    if error:
        raise ValueError(error)


def validate_scheduler_output(state: StateStore, limits: StepLimits, so: SchedulerOutput,
                              hint: DecodeHint | None = None, new_blocks: bool | None = None) -> None:
    """Check `so` against the runner's limits and state; ValueError names the first violation.

    `hint` (optional) is the runner's steady-decode shortcut: the caller has checked
    that `so` admits and removes nothing, that `num_scheduled_tokens` and
    `scheduled_cached_reqs.req_ids` list the same ids in the same order, each scheduled
    exactly `uniform_decode_query_len` tokens, and that no request changed rows since
    the hint was made. `new_blocks` (optional, with a hint): whether any
    `scheduled_cached_reqs.new_block_ids` entry is non-empty, if the caller knows.
    """
    # With a hint the caller has run check_field_containers (it read the fields to find the plan).
    error = steady_type_violation(so, bool(new_blocks), hint.int_row) if hint is not None else field_type_violation(so)
    if error:
        raise ValueError(error)
    try:
        if hint is not None:
            _validate_steady_decode(state, limits, so, hint, new_blocks)
        else:
            _validate_vectorized(state, limits, so)
    except _Invalid:
        # The reference is the specification: it raises with the first violation's
        # message (and, should the two ever disagree, its acceptance wins).
        validate_reference(state, limits, so)


# ---- the reference ----------------------------------------------------------------------------
def _check_blocks(req_id: str, block_ids: list[int], held: int, state: StateStore, limits: StepLimits) -> int:
    """Validates new block ids for a request; returns the blocks it will hold."""
    num_kv = state.tables.num_kv_blocks
    for b in block_ids:
        if bool(block_ids_out_of_range(b, num_kv)):
            raise ValueError(block_ids_message(req_id, b, num_kv))
    total = held + len(block_ids)
    if bool(too_many_blocks(total, limits)):
        raise ValueError(too_many_blocks_message(req_id, total, limits))
    return total


def _check_sampling(state: StateStore, limits: StepLimits, new: NewRequestData) -> None:
    """A new request's SamplingParams: the construction checks again (the object may have
    been changed since, through object.__setattr__), then the vocabulary- and
    runner-dependent ones."""
    params = new.sampling_params
    try:
        params.validate()
        state.sampling.validate(params, limits.vocab_size, state.eos_token_ids, prompt_len=len(new.prompt_token_ids))
    except ValueError as e:
        raise ValueError(f"request {new.req_id!r}: {e}") from None


def _sharing_error(state: StateStore, limits: StepLimits, claims: list[BlockClaim],
                   removed_rows: list[int]) -> str | None:
    """The KV-block ownership rule (`rules.block_sharing_violation`) for this step's new blocks."""
    if not claims:
        return None
    tables, names = state.tables, state.requests.index_to_req_id
    freed = (np.concatenate([tables.table_np[r, : tables.num_blocks[r]] for r in removed_rows])
             if removed_rows else None)

    def holder_ids(block: int) -> list[str]:
        return [str(names[r]) for r in tables.holder_rows(block) if r not in removed_rows and names[r] is not None]

    return block_sharing_violation(claims, tables.holders, freed, holder_ids)


def validate_reference(state: StateStore, limits: StepLimits, so: SchedulerOutput) -> None:
    """Request-by-request check of every rule; raises ValueError at the first violation."""
    requests, held_blocks = state.requests, state.tables.num_blocks
    check_field_types(so)
    total = sum(so.num_scheduled_tokens.values())
    error = batch_violation(total, so.total_num_scheduled_tokens, len(so.num_scheduled_tokens), limits)
    if error:
        raise ValueError(error)

    removed = so.finished_req_ids | so.preempted_req_ids
    live = {rid for rid in requests.req_id_to_index if rid not in removed}
    claims: list[BlockClaim] = []  # the blocks each request adds this step
    # req_id -> (num_computed, known tokens, blocks held) after this step's admissions.
    after: dict[str, tuple[int, int, int]] = {}
    for rid in live:
        row = requests.req_id_to_index[rid]
        after[rid] = (int(requests.num_computed_np[row]), int(requests.prefill_len_np[row]), int(held_blocks[row]))

    for new in so.scheduled_new_reqs:
        rid = new.req_id
        if rid in after:
            raise ValueError(f"request id {rid!r} is already live (duplicate new request)")
        tokens = new.all_token_ids
        error = prompt_violation(rid, tokens, new.num_computed_tokens, limits)
        if error:
            raise ValueError(error)
        held = _check_blocks(rid, new.block_ids, 0, state, limits)
        _check_sampling(state, limits, new)
        after[rid] = (new.num_computed_tokens, len(tokens), held)
        claims.append(BlockClaim(rid, list(new.block_ids), first_written_block(new.num_computed_tokens, 0, limits)))
    if len(after) > limits.max_num_reqs:
        raise ValueError(f"{len(after)} live requests exceed max_num_seqs={limits.max_num_reqs}")

    cached = so.scheduled_cached_reqs
    if not len(cached.req_ids) == len(cached.new_block_ids) == len(cached.num_computed_tokens):
        raise ValueError("scheduled_cached_reqs: req_ids, new_block_ids and num_computed_tokens differ in length")
    for rid, new_blocks, nc in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True):
        if rid not in live:
            raise ValueError(f"unknown request id {rid!r} in scheduled_cached_reqs (not live in the runner)")
        computed, known, held = after[rid]
        if nc != computed:
            raise ValueError(f"request {rid!r}: scheduler says num_computed_tokens={nc}, runner has {computed}")
        after[rid] = (computed, known, _check_blocks(rid, new_blocks or [], held, state, limits))
        if new_blocks:
            claims.append(BlockClaim(rid, list(new_blocks), first_written_block(computed, held, limits)))
    removed_rows = [requests.req_id_to_index[rid] for rid in removed if rid in requests.req_id_to_index]
    error = _sharing_error(state, limits, claims, removed_rows)
    if error:
        raise ValueError(error)

    for rid, n in so.num_scheduled_tokens.items():
        if rid not in after:
            raise ValueError(f"unknown request id {rid!r} in num_scheduled_tokens (not live in the runner)")
        rows = Rows(n, *after[rid])
        rule = first_violation(SCHEDULED_RULES, rows, limits)
        if rule is not None:
            raise ValueError(rule.message(rid, rows, limits))
    error = _spec_tokens_error(so, after, limits)
    if error:
        raise ValueError(error)


def _spec_tokens_error(so: SchedulerOutput, after: dict[str, tuple[int, int, int]], limits: StepLimits) -> str | None:
    """The first bad `scheduled_spec_decode_tokens` entry's error (after: rid -> computed, known, held)."""
    nst = so.num_scheduled_tokens
    for rid, draft_ids in so.scheduled_spec_decode_tokens.items():
        state = after.get(rid)
        rows = Rows(nst[rid], *state) if rid in nst and state is not None else None
        error = spec_tokens_violation(rid, list(draft_ids), rows, limits)
        if error:
            return error
    return None


# ---- the fast checks ----------------------------------------------------------------------------
def _rows_of(ids, index: dict[str, int], removed: set[str], new_rows: dict[str, int]) -> np.ndarray:
    """State rows of `ids` after removals and admissions (new requests get virtual rows)."""
    if not removed and not new_rows:
        try:
            return np.fromiter(map(index.__getitem__, ids), dtype=np.int64, count=len(ids))
        except KeyError:
            raise _Invalid from None
    rows = []
    for rid in ids:
        row = new_rows.get(rid)
        if row is None:
            if rid in removed or rid not in index:
                raise _Invalid
            row = index[rid]
        rows.append(row)
    return np.asarray(rows, dtype=np.int64)


def _held_after_new_blocks(held: np.ndarray, rows: np.ndarray, new_block_ids: list, grown: np.ndarray,
                           num_kv_blocks: int, limits: StepLimits) -> np.ndarray:
    """`held` (a copy) plus each row's new blocks (`grown`: the entries that have some, `_rows_with_blocks`);
    _Invalid if a block rule fails."""
    held = held.astype(np.int64)  # a copy: the added blocks are hypothetical until the step applies
    if grown.size:  # one numpy pass: a block-boundary step adds a block to every running row
        lists = [new_block_ids[i] for i in grown.tolist()]
        counts = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
        ids = np.fromiter(chain.from_iterable(lists), dtype=np.int64, count=int(counts.sum()))
        if block_ids_out_of_range(ids, num_kv_blocks).any():
            raise _Invalid
        np.add.at(held, rows[grown], counts)
    if len(rows) and bool(too_many_blocks(held[rows], limits).any()):
        raise _Invalid
    return held


def _validate_steady_decode(state: StateStore, limits: StepLimits, so: SchedulerOutput, hint: DecodeHint,
                            new_blocks: bool | None = None) -> None:
    """The rules that can fail for a repeated decode batch (see `validate_scheduler_output`).

    A handful of C-level calls whatever the batch size: this runs every decode step.
    """
    q = limits.uniform_decode_query_len
    rows = hint.rows
    # The batch rules: reusable_plan checked that the total is q x rows, rows <= max_num_seqs.
    if q * len(rows) > limits.max_num_tokens:
        raise _Invalid
    cached = so.scheduled_cached_reqs
    computed = state.requests.num_computed_np[rows if hint.rows_index is None else hint.rows_index]  # [R] int64
    # The claimed counts as int64 bytes against the counters': one C-level pass that also
    # rejects every non-integer (float, str, None: TypeError; past int64: OverflowError), 4.0 us
    # at 256 rows where list equality with `computed.tolist()` plus a type pass cost 8.3.
    # bools convert; one equals a counter only where the counter is 0 or 1 (see `low` below).
    claimed = cached.num_computed_tokens
    try:
        if array("q", claimed).tobytes() != computed.tobytes():
            raise _Invalid
    except (TypeError, OverflowError):
        raise _Invalid from None
    if new_blocks is None:
        new_blocks = any(cached.new_block_ids)
    limit = hint.limit
    if new_blocks:
        if len(cached.new_block_ids) != len(rows):  # the columns' lengths: the reference words it
            raise _Invalid
        held_before = state.tables.num_blocks
        grown = _rows_with_blocks(cached.new_block_ids)
        held = _held_after_new_blocks(held_before, rows, cached.new_block_ids, grown, state.tables.num_kv_blocks,
                                      limits)
        limit = token_limit(held[rows], limits)
        if _sharing_error(state, limits, _cached_claims(cached, grown, rows, computed, held_before, limits), []):
            raise _Invalid
    # The max_model_len and blocks_held rules, as room left under `rules.token_limit`.
    # With speculation rows advance by their accepted counts, not by q each: no shortcut.
    if new_blocks or not hint.all_decode or q > 1:
        room, low = int((limit - computed).min()), int(computed.min())
    else:
        if hint.room_ref is None:
            hint.room_ref = (claimed[0], int((limit - computed).min()), int(computed.min()))
        base_computed, base_room, base_low = hint.room_ref
        room, low = base_room - (claimed[0] - base_computed), base_low + (claimed[0] - base_computed)
    if room < q:
        raise _Invalid
    if low <= 1 and bool in set(map(type, claimed)):  # True == 1: only the types tell
        raise _Invalid
    # The shape rules: per row while some row may still prefill. Once every row decodes,
    # their outcome is the same for every row and every later step of the plan (q and
    # `computed >= known` do not change), so row 0 decides it once.
    if not hint.all_decode:
        known = state.requests.prefill_len_np[rows]
        if any_violated(SHAPE_RULES, Rows(q, computed, known, None), limits):
            raise _Invalid
    else:
        if hint.decode_shape_ok is None:
            row0 = Rows(q, int(computed[0]), int(state.requests.prefill_len_np[rows[0]]), None)
            hint.decode_shape_ok = first_violation(SHAPE_RULES, row0, limits) is None
        if not hint.decode_shape_ok:
            raise _Invalid


def _rows_with_blocks(new_block_ids: list) -> np.ndarray:
    """Indices of the non-empty entries of `new_block_ids` (a C-level pass: most entries of a decode step
    are None, and a generator over them cost 15-40 us a step at 256 requests)."""
    return np.flatnonzero(np.fromiter(map(bool, new_block_ids), dtype=bool, count=len(new_block_ids)))


def _cached_claims(cached: CachedRequestData, grown: np.ndarray, rows: np.ndarray, computed: np.ndarray,
                   held: np.ndarray, limits: StepLimits) -> list[BlockClaim]:
    """The blocks running requests add this step. grown: the entries with new blocks
    (`_rows_with_blocks`); computed: [R] their num_computed_tokens (in `cached` order); rows: [R]
    their state rows; held: blocks per state row before the step."""
    ids, blocks = cached.req_ids, cached.new_block_ids
    return [BlockClaim(ids[i], list(blocks[i]), first_written_block(int(computed[i]), int(held[rows[i]]), limits))
            for i in grown.tolist()]


def _validate_vectorized(state: StateStore, limits: StepLimits, so: SchedulerOutput) -> None:
    """The general step's check (types: checked before, by `check_field_types`)."""
    requests, tables, nst = state.requests, state.tables, so.num_scheduled_tokens
    n = np.fromiter(nst.values(), dtype=np.int64, count=len(nst))  # [S] tokens per scheduled request
    if batch_violation(int(n.sum()), so.total_num_scheduled_tokens, len(n), limits):
        raise _Invalid
    removed = so.finished_req_ids | so.preempted_req_ids if (so.finished_req_ids or so.preempted_req_ids) else set()
    index = requests.req_id_to_index
    computed, known, held = requests.num_computed_np, requests.prefill_len_np, tables.num_blocks
    new_rows: dict[str, int] = {}
    claims: list[BlockClaim] = []
    news = so.scheduled_new_reqs
    if news:
        base = requests.num_rows
        new_computed, new_known, new_held = [], [], []
        for j, new in enumerate(news):
            rid, tokens, blocks = new.req_id, new.all_token_ids, new.block_ids
            if rid in new_rows or (rid in index and rid not in removed):
                raise _Invalid
            if prompt_violation(rid, tokens, new.num_computed_tokens, limits):
                raise _Invalid
            if blocks and block_ids_out_of_range(blocks, tables.num_kv_blocks).any():
                raise _Invalid
            if too_many_blocks(len(blocks), limits):
                raise _Invalid
            try:
                _check_sampling(state, limits, new)
            except ValueError:
                raise _Invalid from None
            new_rows[rid] = base + j
            if blocks:
                claims.append(BlockClaim(rid, list(blocks), first_written_block(new.num_computed_tokens, 0, limits)))
            new_computed.append(new.num_computed_tokens)
            new_known.append(len(tokens))
            new_held.append(len(blocks))
        num_removed_live = sum(1 for rid in removed if rid in index)
        if requests.num_live - num_removed_live + len(news) > limits.max_num_reqs:
            raise _Invalid
        computed = np.concatenate([computed, np.asarray(new_computed, dtype=computed.dtype)])
        known = np.concatenate([known, np.asarray(new_known, dtype=known.dtype)])
        held = np.concatenate([held, np.asarray(new_held, dtype=held.dtype)])

    cached = so.scheduled_cached_reqs
    num_cached = len(cached.req_ids)
    if not num_cached == len(cached.new_block_ids) == len(cached.num_computed_tokens):
        raise _Invalid
    if num_cached:
        if removed and not removed.isdisjoint(cached.req_ids):
            raise _Invalid
        crows = _rows_of(cached.req_ids, index, set(), {})
        nc = np.fromiter(cached.num_computed_tokens, dtype=np.int64, count=num_cached)
        if not np.array_equal(nc, computed[crows]):
            raise _Invalid
        if any(cached.new_block_ids):
            grown = _rows_with_blocks(cached.new_block_ids)
            claims += _cached_claims(cached, grown, crows, nc, held, limits)
            held = _held_after_new_blocks(held, crows, cached.new_block_ids, grown, tables.num_kv_blocks, limits)
    if claims:
        removed_rows = [index[rid] for rid in removed if rid in index]
        if _sharing_error(state, limits, claims, removed_rows):
            raise _Invalid

    rows = _rows_of(nst, index, removed, new_rows) if len(n) else np.zeros(0, dtype=np.int64)
    if len(n) and any_violated(SCHEDULED_RULES, Rows(n, computed[rows], known[rows], held[rows]), limits):
        raise _Invalid
    if so.scheduled_spec_decode_tokens and _spec_tokens_error(so, _after_of(nst, rows, computed, known, held), limits):
        raise _Invalid


def _after_of(ids, rows: np.ndarray, computed: np.ndarray, known: np.ndarray, held: np.ndarray) -> dict:
    """req_id -> (computed, known, held) of the scheduled requests (the reference's `after`)."""
    return {rid: (int(computed[r]), int(known[r]), int(held[r])) for rid, r in zip(ids, rows.tolist(), strict=True)}
