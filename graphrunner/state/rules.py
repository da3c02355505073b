"""The rules a SchedulerOutput must satisfy, each defined once.

A rule is a predicate that says where it is violated, written with numpy operators so
that one definition serves a single request (scalars) and a whole batch (arrays), and
the words of its error, which name the offending value and the limit. The three checks
in `graphrunner.state.validation` — the per-request reference, the vectorised batch check
and the steady-decode shortcut — all evaluate these definitions; none restates a rule.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphrunner.limits import StepLimits
from graphrunner.protocol import CachedRequestData, NewRequestData, SamplingParams


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
    return np.minimum(np.asarray(held, dtype=np.int64) * limits.tokens_per_block, limits.max_model_len)


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
    "decode_length", lambda r, L: (r.computed >= r.known) & (r.n > L.uniform_decode_query_len),
    lambda rid, r, L: f"request {rid!r}: a decode step takes exactly 1 token, got {r.n}"
    if L.uniform_decode_query_len == 1 else
    f"request {rid!r}: a decode step takes 1 token plus at most num_speculative_tokens="
    f"{L.uniform_decode_query_len - 1} draft slots, got {r.n}")
BLOCKS_HELD = Rule(
    "blocks_held", lambda r, L: r.computed + r.n > np.asarray(r.held, dtype=np.int64) * L.tokens_per_block,
    lambda rid, r, L: f"request {rid!r}: {r.computed + r.n} tokens need "
                      f"{-(-(r.computed + r.n) // L.tokens_per_block)} blocks, it holds {r.held}")

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
    ids = np.asarray(block_ids, dtype=np.int64)  # field_type_violation: ints within int64
    return (ids < 0) | (ids >= num_kv_blocks)


def too_many_blocks(total: Any, limits: StepLimits) -> Any:
    return np.asarray(total) > limits.max_num_blocks_per_req


def block_ids_message(req_id: str, block_id: int, num_kv_blocks: int) -> str:
    return f"request {req_id!r}: block id {block_id} out of range [0, {num_kv_blocks})"


def too_many_blocks_message(req_id: str, total: int, limits: StepLimits) -> str:
    return (f"request {req_id!r}: {total} blocks exceed the per-request limit of {limits.max_num_blocks_per_req} "
            f"(max_model_len={limits.max_model_len}, block_size={limits.block_size})")


@dataclass(frozen=True)
class BlockClaim:
    """Blocks one request adds this step: `block_ids` (in table order), of which those from
    index `first_written` on hold positions it will write (at or after its first uncomputed
    token); the ones before are full blocks of its computed prefix (a prefix-cache hit)."""

    req_id: str
    block_ids: list[int]
    first_written: int


def first_written_block(num_computed: int, held: int, limits: StepLimits) -> int:
    """Index, among the blocks a request adds after the `held` it has, of the first one that
    holds a position at or after `num_computed` (the blocks before it are full and computed)."""
    return max(0, num_computed // limits.tokens_per_block - held)


def block_sharing_violation(claims: list[BlockClaim], holders: np.ndarray, freed: np.ndarray | None,
                            holder_ids: Callable[[int], list[str]]) -> str | None:
    """The error of the KV-block ownership rule, or None.

    A block a request writes belongs to it alone: no other live request may hold it, and no
    request holds a block twice. Only full blocks of a computed prefix are shared (prefix
    caching); a request never writes them. `holders`: [num_kv_blocks] live rows holding each
    block before this step; `freed`: the blocks of the rows this step removes (None: none);
    `holder_ids(b)`: the live requests holding block b (for the message only).
    """
    written = [b for c in claims for b in c.block_ids[c.first_written:]]
    distinct = all(len(set(c.block_ids)) == len(c.block_ids) for c in claims)
    if not written and distinct:
        return None
    w = np.asarray(written, dtype=np.int64)
    count = holders[w]
    if freed is not None and freed.size:
        count = count - (w[:, None] == freed[None, :]).sum(axis=1)
    # Python sets: a step adds a few blocks per boundary-crossing request, where np.unique / np.isin
    # cost 10-20 us of call overhead each.
    unique = set(written)
    if (distinct and not count.any() and len(unique) == len(written)
            and unique.isdisjoint([b for c in claims for b in c.block_ids[:c.first_written]])):
        return None
    return _word_block_sharing(claims, holders, freed, holder_ids)


def _word_block_sharing(claims: list[BlockClaim], holders: np.ndarray, freed: np.ndarray | None,
                        holder_ids: Callable[[int], list[str]]) -> str:
    """The message of the first claim that breaks `block_sharing_violation`'s rule."""
    freed_count = Counter(() if freed is None else freed.tolist())
    claimed: dict[int, str] = {}  # block -> the request of this step that added it
    written_by: dict[int, str] = {}
    for c in claims:
        for j, b in enumerate(c.block_ids):
            if b in c.block_ids[:j]:
                return f"request {c.req_id!r}: block id {b} appears twice in its blocks"
            writes = j >= c.first_written
            if writes and int(holders[b]) - freed_count[b] > 0:
                others = holder_ids(b)
                owner = others[0] if others else "another request"
                if owner == c.req_id:
                    return f"request {c.req_id!r}: block id {b} is one it already holds (a block appears twice)"
                return (f"request {c.req_id!r}: block id {b} belongs to live request {owner!r}; a block a request "
                        "writes cannot be shared (only full blocks of a computed prefix are)")
            other = written_by.get(b) if not writes else claimed.get(b)
            if other is not None and other != c.req_id:
                return (f"request {c.req_id!r}: block id {b} is also given to request {other!r} this step; a block a "
                        "request writes cannot be shared (only full blocks of a computed prefix are)")
            claimed[b] = c.req_id
            if writes:
                written_by[b] = c.req_id
    raise AssertionError("block_sharing_violation found a fault that its wording does not")


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
    first = None if set(map(type, tokens)) <= _INT_TYPES else next(
        (t for t in tokens if isinstance(t, bool) or not isinstance(t, (int, np.integer))), None)
    if first is not None:
        return f"request {req_id!r}: token id {first!r} is not an integer"
    # Python min/max: no int64 conversion, so an id past int64 is out of the vocabulary too.
    if min(tokens) < 0 or max(tokens) >= limits.vocab_size:
        bad = next(t for t in tokens if not 0 <= t < limits.vocab_size)
        return f"request {req_id!r}: token id {int(bad)} outside the vocabulary [0, {limits.vocab_size})"
    if not 0 <= num_computed < len(tokens):
        return f"request {req_id!r}: num_computed_tokens={num_computed} must be in [0, {len(tokens)})"
    return None


def spec_tokens_violation(rid: str, draft_ids: list[int], rows: Rows | None, limits: StepLimits) -> str | None:
    """The error of one `scheduled_spec_decode_tokens` entry, or None. `rows` describes the
    request's scheduled chunk (None: the request is not scheduled this step)."""
    k = limits.uniform_decode_query_len - 1
    if rows is None:
        return f"scheduled_spec_decode_tokens has drafts for request {rid!r}, which is not scheduled this step"
    if rows.computed < rows.known:
        return (f"scheduled_spec_decode_tokens has drafts for request {rid!r}, which is in prefill "
                f"({rows.computed} of {rows.known} known tokens computed): drafts follow a sampled token")
    if len(draft_ids) > k:
        return (f"request {rid!r}: {len(draft_ids)} draft tokens, more than num_speculative_tokens={k}")
    if rows.n != 1 + len(draft_ids):
        return (f"request {rid!r}: {rows.n} scheduled tokens, but a verifying request takes 1 + its "
                f"{len(draft_ids)} drafts")
    if draft_ids and (min(draft_ids) < -1 or max(draft_ids) >= limits.vocab_size):
        bad = next(t for t in draft_ids if not -1 <= t < limits.vocab_size)
        return (f"request {rid!r}: draft token id {bad} outside [0, vocab_size={limits.vocab_size}) "
                "(-1: the runner's own draft)")
    if draft_ids and (min(draft_ids) < 0 <= max(draft_ids)):
        return f"request {rid!r}: draft ids {draft_ids} mix placeholders (-1) and real ids; use one kind"
    return None


# ---- field types ---------------------------------------------------------------------------
# Python ints and numpy integers; bool is not a count (type(True) is bool, not int).
_INT_TYPES = frozenset({int, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64})
# Every count and id is held in int64 rows and arrays.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# The sequence fields: lists (tuples too); a numpy array's truth value is ambiguous.
_SEQUENCES = (list, tuple)
_ID_SETS = (set, frozenset)


def _not_ints(values: Any) -> tuple[Any] | None:
    """(the first value of `values` that is not an int64 integer,), or None (C-level: map(type), min, max)."""
    if set(map(type, values)) <= _INT_TYPES:
        if not values or (INT64_MIN <= min(values) and max(values) <= INT64_MAX):
            return None
        return (next(v for v in values if not INT64_MIN <= v <= INT64_MAX),)
    return (next(v for v in values if type(v) not in _INT_TYPES),)


def _described(value: Any) -> str:
    """A value that is no count or id, with why: its type, or its range."""
    if type(value) in _INT_TYPES:
        return f"{value} (outside the int64 range)"
    return f"{value!r} ({type(value).__name__})"


def _all_str(values: Any) -> bool:
    return set(map(type, values)) <= {str}


def _is_int64(value: Any) -> bool:
    return type(value) in _INT_TYPES and INT64_MIN <= value <= INT64_MAX


def container_type_violation(so: Any) -> str | None:
    """The error of the first SchedulerOutput field whose container is of the wrong type, or
    None: O(1) checks (and the id sets' members), run on every step before any field is read.
    The ids sets come first, then the fields in `field_type_violation`'s order."""
    # Every step runs this: one expression for the common case (0.4 µs, the loop below 0.85).
    cached, fin, pre = so.scheduled_cached_reqs, so.finished_req_ids, so.preempted_req_ids
    if (isinstance(fin, _ID_SETS) and isinstance(pre, _ID_SETS) and isinstance(so.num_scheduled_tokens, dict)
            and isinstance(so.scheduled_new_reqs, _SEQUENCES) and isinstance(cached, CachedRequestData)
            and isinstance(cached.req_ids, _SEQUENCES) and isinstance(cached.new_block_ids, _SEQUENCES)
            and isinstance(cached.num_computed_tokens, _SEQUENCES)
            and isinstance(so.scheduled_spec_decode_tokens, dict)
            and (not fin or _all_str(fin)) and (not pre or _all_str(pre))):
        return None
    for name in ("finished_req_ids", "preempted_req_ids"):
        ids = getattr(so, name)
        if not isinstance(ids, _ID_SETS) or not _all_str(ids):
            return f"{name} must be a set of request id strings, got {_show(ids)}"
    if not isinstance(so.num_scheduled_tokens, dict):
        return f"num_scheduled_tokens must map request id strings to ints, got {_show(so.num_scheduled_tokens)}"
    if not isinstance(so.scheduled_new_reqs, _SEQUENCES):
        return f"scheduled_new_reqs must be a list of NewRequestData, got {_show(so.scheduled_new_reqs)}"
    cached = so.scheduled_cached_reqs
    if not isinstance(cached, CachedRequestData):
        return f"scheduled_cached_reqs must be a CachedRequestData, got {_show(cached)}"
    for name in ("req_ids", "new_block_ids", "num_computed_tokens"):
        column = getattr(cached, name)
        if not isinstance(column, _SEQUENCES):
            return f"scheduled_cached_reqs.{name} must be a list, got {_show(column)}"
    spec = so.scheduled_spec_decode_tokens
    if not isinstance(spec, dict):
        return f"scheduled_spec_decode_tokens must map request id strings to lists of token ids, got {_show(spec)}"
    return None


def steady_type_violation(so: Any, new_blocks: bool, int_row: list[type]) -> str | None:
    """`field_type_violation` for a step that repeats the steady-decode plan, given that its
    containers passed `container_type_violation`. What the plan lookup proved is not checked
    again: the request ids equal the plan's (strings) and the token counts equal q by value;
    their types are checked here (1.0 == 1 and True == 1). `num_computed_tokens` is checked by
    the steady validation itself, whose int64 comparison with the runner's counters rejects
    every other type (`validation._validate_steady_decode`). New block ids are checked in full.

    int_row: [int] * R (R: the plan's rows). The token counts' types, as a list, are compared
    with it (C-level, identity first): 3.1 us at 256 rows, the cheapest exact check measured
    (a set of the types 4.7, a tuple 4.0). Any other type (numpy integers too, which are
    accepted) takes the full check."""
    if (type(so.total_num_scheduled_tokens) is not int
            or list(map(type, so.num_scheduled_tokens.values())) != int_row
            or new_blocks or so.scheduled_cached_reqs.new_block_ids.count(None)
            != len(so.scheduled_cached_reqs.new_block_ids)):
        return field_type_violation(so)
    return None


def field_type_violation(so: Any) -> str | None:
    """The error of the first SchedulerOutput field of the wrong type, or None.

    Counts, block ids and token counts must be integers within int64 (not floats, strings
    or bools), request ids strings, the id sets sets, the per-request columns lists. Every
    step is checked, the steady-decode one included (`steady_type_violation`).
    """
    error = container_type_violation(so)
    if error:
        return error
    nst = so.num_scheduled_tokens
    if not _all_str(nst):
        return f"num_scheduled_tokens must map request id strings to ints, got {_show(nst)}"
    bad = _not_ints(nst.values())
    if bad is not None:
        return f"num_scheduled_tokens has {_described(bad[0])}; token counts must be ints"
    if not _is_int64(so.total_num_scheduled_tokens):
        return f"total_num_scheduled_tokens={so.total_num_scheduled_tokens!r} must be an int"
    for new in so.scheduled_new_reqs:
        if not isinstance(new, NewRequestData):
            return f"scheduled_new_reqs must be a list of NewRequestData, got an item {_show(new)}"
        if type(new.req_id) is not str:
            return f"request id {new.req_id!r} must be a string"
        if not isinstance(new.block_ids, _SEQUENCES):
            return f"request {new.req_id!r}: block_ids must be a list of ints, got {_show(new.block_ids)}"
        bad = _not_ints(new.block_ids)
        if bad is not None:
            return f"request {new.req_id!r}: block id {_described(bad[0])}; block ids must be ints"
        if not _is_int64(new.num_computed_tokens):
            return f"request {new.req_id!r}: num_computed_tokens={new.num_computed_tokens!r} must be an int"
        if not isinstance(new.sampling_params, SamplingParams):
            return f"request {new.req_id!r}: sampling_params must be a SamplingParams, got {_show(new.sampling_params)}"
    cached = so.scheduled_cached_reqs
    if not _all_str(cached.req_ids):
        return f"scheduled_cached_reqs.req_ids must be strings, got {_show(cached.req_ids)}"
    bad = _not_ints(cached.num_computed_tokens)
    if bad is not None:
        return f"scheduled_cached_reqs.num_computed_tokens has {_described(bad[0])}; must be ints"
    blocks_of = cached.new_block_ids
    if blocks_of.count(None) != len(blocks_of):  # steady decoding: all None but every block_size steps
        for rid, blocks in zip(cached.req_ids, blocks_of, strict=False):  # lengths: a rule of its own
            if blocks is None:
                continue
            if not isinstance(blocks, _SEQUENCES):
                return f"request {rid!r}: new_block_ids must be None or a list of ints, got {_show(blocks)}"
            bad = _not_ints(blocks)
            if bad is not None:
                return f"request {rid!r}: new block id {_described(bad[0])}; block ids must be ints"
    spec = so.scheduled_spec_decode_tokens
    if not _all_str(spec):
        return f"scheduled_spec_decode_tokens must map request id strings to lists of token ids, got {_show(spec)}"
    for rid, draft_ids in spec.items():
        if not isinstance(draft_ids, _SEQUENCES):
            return f"request {rid!r}: draft tokens must be a list of token ids, got {_show(draft_ids)}"
        bad = _not_ints(draft_ids)
        if bad is not None:
            return f"request {rid!r}: draft token id {_described(bad[0])}; token ids must be ints"
    return None


def _show(value: Any) -> str:
    """repr(value), shortened for error messages."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
