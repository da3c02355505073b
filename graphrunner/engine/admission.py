"""Admission checks and KV blocks of the reference scheduler, kept out of scheduler.py.

`validate_prompt`: what a prompt must satisfy to be queued. `admit_blocks`: the blocks of a
waiting request being admitted, its cached prefix first under prefix caching (the runner then
prefills only the rest). `cache_filled_blocks`: after a step, key the blocks its requests filled.
"""

from __future__ import annotations

from typing import Any

from graphrunner.engine.prefix_cache import PrefixCachingAllocator
from graphrunner.engine.request import Request
from graphrunner.protocol import SamplingParams, SchedulerOutput

Scheduler = Any  # graphrunner.engine.scheduler.Scheduler, which imports this module


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def validate_prompt(sched: Scheduler, req_id: str, prompt: list[int], params: SamplingParams) -> None:
    """ValueError naming the request when the prompt is empty, too long, outside the vocabulary, or
    cannot fit the KV cache on its own (then preemption could never make room for it)."""
    if not prompt:
        raise ValueError(f"request {req_id!r}: the prompt is empty")
    if len(prompt) > sched.max_model_len:
        source = getattr(sched, "max_model_len_source", "")
        raise ValueError(f"request {req_id!r}: prompt length {len(prompt)} exceeds max_model_len={sched.max_model_len}"
                         + (f" ({source})" if source else ""))
    vocab = sched.vocab_size
    bad = None if vocab is None else next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"request {req_id!r}: token id {bad} is out of range for vocab_size={vocab}")
    needed = _cdiv(sched.max_computed_tokens(len(prompt), params.max_tokens), sched.block_size)
    if needed > sched.num_blocks:
        lookahead = f" + {sched.spec_lookahead} draft slots" if sched.num_speculative_tokens else ""
        raise ValueError(
            f"request {req_id!r}: needs up to {needed} KV blocks (prompt {len(prompt)} + max_tokens "
            f"{params.max_tokens}{lookahead}, block_size {sched.block_size}) but the cache has "
            f"num_blocks={sched.num_blocks}"
        )


def admit_blocks(sched: Scheduler, req: Request, budget: int) -> tuple[int, list[int]] | None:
    """(tokens to schedule, block ids) for waiting `req`, or None when they do not fit (nothing
    changed, or its KV is still arriving through the connector: `sched.waiting_for_kv`). With prefix
    caching its longest cached prefix of full blocks comes first and counts as computed; at least
    its last token is always computed (the step samples after it). Requests asking for prompt
    logprobs are not served from the cache (every position is needed)."""
    alloc, bs = sched.block_allocator, sched.block_size
    hit: list[int] = []
    if isinstance(alloc, PrefixCachingAllocator) and req.sampling_params.prompt_logprobs is None:
        hit = alloc.lookup(req.block_key_tokens, (req.num_tokens - 1) // bs, req.cache_salt)
    req.num_computed_tokens = len(hit) * bs
    # A KV connector may hold the blocks after the local hit (loaded before the step, not computed).
    connector, external = sched.kv_connector, 0
    if connector is not None and req.sampling_params.prompt_logprobs is None:
        matched = connector.get_num_new_matched_tokens(req, req.num_computed_tokens)
        if matched is None:  # its KV is on its way from another instance: admitted once it is here
            req.num_computed_tokens = 0
            sched.waiting_for_kv = True
            return None
        external = matched
        req.num_computed_tokens += external
    req.num_prefill_tokens = req.num_tokens  # (re)admitted: every known token is prefill, hit or not
    num_new = sched.num_new_tokens(req, budget)
    needed = _cdiv(req.num_computed_tokens + num_new, bs) - len(hit)
    reclaimed = sum(not alloc.is_allocated(b) for b in hit)  # hit blocks sitting in the free queue
    if not alloc.can_allocate(needed + reclaimed):
        req.num_computed_tokens = 0
        return None
    if hit:
        assert isinstance(alloc, PrefixCachingAllocator)
        alloc.touch(hit)
    block_ids = hit + alloc.allocate(needed)
    if external:
        connector.update_state_after_alloc(req, block_ids, external)
    return num_new, block_ids


def cache_filled_blocks(sched: Scheduler, so: SchedulerOutput) -> None:
    """Prefix caching, after a step's output is applied: key every full block of the step's
    requests whose tokens are all known (placeholders are not)."""
    alloc = sched.block_allocator
    if not isinstance(alloc, PrefixCachingAllocator):
        return
    bs = alloc.block_size
    for req_id in so.num_scheduled_tokens:
        req = sched.requests.get(req_id)
        if req is None or not req.block_ids:
            continue
        # The last known token's KV is computed by the step after it was sampled (maybe still in flight).
        full = min(req.num_computed_tokens, req.num_tokens - 1, len(req.block_ids) * bs) // bs
        known = sched.cached_blocks.get(req_id, 0)
        if full > known:
            alloc.register(req.block_key_tokens, req.block_ids, full, req.cache_salt, known)
            sched.cached_blocks[req_id] = full
            if sched.kv_connector is not None:
                sched.kv_connector.blocks_cached(req, full)


__all__ = ["admit_blocks", "cache_filled_blocks", "validate_prompt"]
