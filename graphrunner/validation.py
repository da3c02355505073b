"""Checks a SchedulerOutput against the runner's limits and state before anything changes.

Every rule raises ValueError naming the offending value and the limit. Because all
checks run before the first state change, a rejected step leaves the runner exactly as
it was and the next valid step proceeds normally.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphrunner.protocol import SchedulerOutput

if TYPE_CHECKING:
    from graphrunner.runner import ModelRunner


def _check_block_ids(req_id: str, block_ids: list[int], held: int, runner: "ModelRunner") -> int:
    """Validates new block ids for a request; returns the blocks it will hold."""
    limit = runner.num_kv_blocks
    for b in block_ids:
        if not 0 <= b < limit:
            raise ValueError(f"request {req_id!r}: block id {b} out of range [0, {limit})")
    total = held + len(block_ids)
    if total > runner.max_num_blocks_per_req:
        raise ValueError(
            f"request {req_id!r}: {total} blocks exceed the per-request limit of {runner.max_num_blocks_per_req} "
            f"(max_model_len={runner.max_model_len}, block_size={runner.block_size})"
        )
    return total


def validate_scheduler_output(runner: "ModelRunner", so: SchedulerOutput) -> None:
    states = runner.req_states
    assert runner.block_tables is not None
    held_blocks = runner.block_tables.num_blocks

    total = sum(so.num_scheduled_tokens.values())
    if total != so.total_num_scheduled_tokens:
        raise ValueError(
            f"total_num_scheduled_tokens={so.total_num_scheduled_tokens} but num_scheduled_tokens sums to {total}"
        )
    if total > runner.max_num_tokens:
        raise ValueError(f"{total} scheduled tokens exceed max_num_batched_tokens={runner.max_num_tokens}")
    if len(so.num_scheduled_tokens) > runner.max_num_reqs:
        raise ValueError(f"{len(so.num_scheduled_tokens)} scheduled requests exceed max_num_seqs={runner.max_num_reqs}")

    removed = so.finished_req_ids | so.preempted_req_ids
    live = {rid for rid in states.req_id_to_index if rid not in removed}
    # req_id -> (num_computed, known tokens, blocks held) after this step's admissions.
    after: dict[str, tuple[int, int, int]] = {}
    for rid in live:
        row = states.req_id_to_index[rid]
        after[rid] = (int(states.num_computed_np[row]), int(states.prefill_len_np[row]), int(held_blocks[row]))

    for new in so.scheduled_new_reqs:
        rid = new.req_id
        if rid in after:
            raise ValueError(f"request id {rid!r} is already live (duplicate new request)")
        tokens = new.all_token_ids
        if not tokens:
            raise ValueError(f"request {rid!r} has an empty prompt")
        if len(tokens) > runner.max_model_len:
            raise ValueError(f"request {rid!r}: {len(tokens)} tokens exceed max_model_len={runner.max_model_len}")
        bad = next((t for t in tokens if not 0 <= t < runner.vocab_size), None)
        if bad is not None:
            raise ValueError(f"request {rid!r}: token id {bad} outside the vocabulary [0, {runner.vocab_size})")
        if not 0 <= new.num_computed_tokens < len(tokens):
            raise ValueError(
                f"request {rid!r}: num_computed_tokens={new.num_computed_tokens} must be in [0, {len(tokens)})"
            )
        held = _check_block_ids(rid, new.block_ids, 0, runner)
        after[rid] = (new.num_computed_tokens, len(tokens), held)
    if len(after) > runner.max_num_reqs:
        raise ValueError(f"{len(after)} live requests exceed max_num_seqs={runner.max_num_reqs}")

    cached = so.scheduled_cached_reqs
    if not len(cached.req_ids) == len(cached.new_block_ids) == len(cached.num_computed_tokens):
        raise ValueError("scheduled_cached_reqs: req_ids, new_block_ids and num_computed_tokens differ in length")
    for rid, new_blocks, nc in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
        if rid not in live:
            raise ValueError(f"unknown request id {rid!r} in scheduled_cached_reqs (not live in the runner)")
        computed, known, held = after[rid]
        if nc != computed:
            raise ValueError(f"request {rid!r}: scheduler says num_computed_tokens={nc}, runner has {computed}")
        after[rid] = (computed, known, _check_block_ids(rid, new_blocks or [], held, runner))

    for rid, n in so.num_scheduled_tokens.items():
        if rid not in after:
            raise ValueError(f"unknown request id {rid!r} in num_scheduled_tokens (not live in the runner)")
        if n < 1:
            raise ValueError(f"request {rid!r}: {n} scheduled tokens; must be >= 1")
        computed, known, held = after[rid]
        end = computed + n
        if end > runner.max_model_len:
            raise ValueError(f"request {rid!r}: {end} tokens would exceed max_model_len={runner.max_model_len}")
        if computed < known and end > known:
            raise ValueError(
                f"request {rid!r}: chunk [{computed}, {end}) runs past its {known} known tokens "
                "(the next token is not sampled yet)"
            )
        if computed >= known and n != 1:
            raise ValueError(f"request {rid!r}: a decode step takes exactly 1 token, got {n}")
        if end > held * runner.block_size:
            raise ValueError(
                f"request {rid!r}: {end} tokens need {-(-end // runner.block_size)} blocks, it holds {held}"
            )
