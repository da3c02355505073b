"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

Each step, `schedule()` plans the batch in two passes:

1. Running requests first, in admission order: decodes and continuing prefill chunks,
   each under the step's token budget. A request that cannot get the KV blocks it needs
   preempts the most recently admitted running request (its blocks are freed and it goes
   back to the front of the waiting queue to be recomputed later), repeatedly, until the
   blocks fit or it has preempted itself.
2. Then, unless something was preempted this step (the cache is full), waiting requests
   are admitted in FCFS order while the token budget, `max_num_seqs` and free blocks allow.

`update_from_output()` folds the runner's sampled tokens back in and finishes requests.
The runner learns about finished and preempted requests through the *next* step's
`finished_req_ids` and the current step's `preempted_req_ids`. The hand-off is
transactional: a plan's finished ids count as delivered once the next plan is made, and
`step_failed()` (its step raised, maybe before the runner read them) puts them back for the
next plan to carry again; the runner ignores finished ids it no longer holds. A lost id
would leave its row, and its KV blocks, held in the runner for good.

Async scheduling (`async_scheduling=True`): the engine schedules and launches step
N + 1 before step N's tokens are known, so the host keeps only upper bounds.
`schedule()` advances `num_computed_tokens` at once and counts each token a scheduled
chunk will sample as a placeholder output (`Request.num_output_placeholders`); the next
decode of that request computes the placeholder, whose value the runner reads on the
device. `update_from_output(so_N, out_N)` (called in schedule order, one step late)
turns placeholders into tokens and finishes requests on EOS / stop / length; a request
that finished this way may already be in step N + 1, whose token for it is discarded
(it reaches the runner as finished on the next schedule). A request whose in-flight
tokens already reach max_tokens or max_model_len is not scheduled again.
Preemption with a token in flight is allowed: the victim's KV is dropped, its token is
appended when its step resolves, and it is not re-admitted before (its NewRequestData
must carry every token).
Speculative decoding (`num_speculative_tokens=k > 0`): every decode is scheduled as
q = 1 + k tokens, the last sampled token and k draft slots (capped by the budget and
max_model_len), so steady decode batches stay uniform (FULL graphs). The plan names no
drafts (the runner reads its own on the device: q - 1 placeholders) unless the engine gives
a decode real ids (`schedule_drafts`: structured outputs). A verifying step emits 1..q
tokens (accepted drafts and one more), appended one by one: a stop token, max_tokens or
max_model_len inside the run ends the request there. KV is valid for the emitted tokens
only: sync, num_computed_tokens advances by their number, not q; async, the plan
advanced it by q at once (as the runner's count does at launch), and the output, one
step late, takes the rejected q - emitted back (as the runner does when it resolves that
step) unless the request was preempted since. Blocks are reserved for all q tokens and
`num_lookahead_tokens` more (a draft model's KV); a request must fit the cache alone with them.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from itertools import compress, repeat
from typing import TYPE_CHECKING, Any

import numpy as np

from graphrunner.engine.admission import admit_blocks, cache_filled_blocks, validate_prompt
from graphrunner.engine.block_allocator import BlockAllocator
from graphrunner.engine.pipeline_rule import PipelineRule
from graphrunner.engine.prefix_cache import PrefixCachingAllocator
from graphrunner.engine.request import Request, RequestExtras, RequestStatus, SequenceOutput
from graphrunner.engine.runner_output import check_num_sampled, check_partial_prefill, output_entry, token_logprobs
from graphrunner.protocol import (
    CachedRequestData,
    LoRARequest,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
    check_token_ids,
)

if TYPE_CHECKING:
    from graphrunner.kv_transfer.base import KVConnectorScheduler


FAST_DECODE_MIN_REQUESTS = 16  # see Scheduler._fast_decode_min


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Field reads over a batch of requests in C (map over an attrgetter), not a Python loop.
_NUM_COMPUTED = operator.attrgetter("num_computed_tokens")
_PLACEHOLDERS = operator.attrgetter("num_output_placeholders")
_OUTPUTS = operator.attrgetter("output_token_ids")
_BLOCKS = operator.attrgetter("block_ids")


def _gather(getter: Any, reqs: list[Request]) -> np.ndarray:
    return np.fromiter(map(getter, reqs), np.int64, len(reqs))


def _gather_len(getter: Any, reqs: list[Request]) -> np.ndarray:
    return np.fromiter(map(len, map(getter, reqs)), np.int64, len(reqs))


def _scatter(reqs: list[Request], name: str, values: np.ndarray) -> None:
    for _ in map(setattr, reqs, repeat(name), values.tolist()):
        pass


@dataclass(frozen=True)
class _DecodeBatch:
    """The running requests of a steady decode, for the scheduler's fast path: what does not
    change while they run (the changing counts are read from the requests each step)."""

    reqs: list[Request]
    ids: list[str]
    id_set: frozenset[str]
    num_prefill: np.ndarray
    num_prompt: np.ndarray
    max_tokens: np.ndarray
    stop_ids: np.ndarray  # every token that may stop one of them: a sampled one sends it the general way

    @staticmethod
    def of(reqs: list[Request], eos_token_ids: frozenset[int]) -> _DecodeBatch:
        n = len(reqs)
        params = [r.sampling_params for r in reqs]
        stop: set[int] = set().union(*(p.stop_token_ids for p in params))
        if not all(p.ignore_eos for p in params):
            stop |= eos_token_ids
        ids = [r.req_id for r in reqs]
        return _DecodeBatch(
            reqs, ids, frozenset(ids), np.fromiter((r.num_prefill_tokens for r in reqs), np.int64, n),
            np.fromiter((len(r.prompt_token_ids) for r in reqs), np.int64, n),
            np.fromiter((p.max_tokens for p in params), np.int64, n), np.array(sorted(stop), np.int64))

    def matches(self, reqs: list[Request]) -> bool:
        return len(reqs) == len(self.reqs) and all(map(operator.is_, reqs, self.reqs))

    def select(self, keep: np.ndarray) -> _DecodeBatch:
        """The rows where `keep` is True. The stop ids of the others stay: a superset only sends
        more tokens the general way."""
        mask = keep.tolist()
        ids = list(compress(self.ids, mask))
        return _DecodeBatch(list(compress(self.reqs, mask)), ids, frozenset(ids), self.num_prefill[keep],
                            self.num_prompt[keep], self.max_tokens[keep], self.stop_ids)


@dataclass(frozen=True)
class SchedulerStats:
    """What the scheduler holds at one moment (the server's /metrics gauges): counts, so that the
    stats of data-parallel replicas add up (`merge`)."""

    num_running: int = 0
    num_waiting: int = 0
    num_used_blocks: int = 0
    num_blocks: int = 0
    num_preemptions: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache
    prefix_query_tokens: int = 0  # prompt tokens looked up in it

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @staticmethod
    def merge(parts: Iterable[SchedulerStats]) -> SchedulerStats:
        """The stats of several replicas as one (every count summed)."""
        parts = list(parts)
        return SchedulerStats(*(sum(getattr(p, f.name) for p in parts) for f in fields(SchedulerStats)))


@dataclass(frozen=True)
class _Launched:
    """Async: a launched plan, the requests it samples for, and its decodes (they verify drafts)."""

    plan: SchedulerOutput
    produces: frozenset[str]
    decodes: frozenset[str]
    batch: _DecodeBatch | None = None  # planned by the steady-decode fast path
    num_preemptions: int = 0  # the scheduler's count at launch


class Scheduler:
    """Plans one `SchedulerOutput` per step for a `ModelRunner`.

    Args:
        max_num_seqs: most requests in one step (and most running requests).
        max_num_batched_tokens: token budget of one step.
        max_model_len: most tokens (prompt + output) a request may have KV for.
        block_size: tokens per KV block.
        num_blocks: KV blocks in the runner's cache.
        enable_chunked_prefill: split prompts across steps under the token budget; when
            False a prompt is scheduled whole or not at all.
        vocab_size: when given, prompt token ids are checked against `[0, vocab_size)`.
        eos_token_ids: tokens that end a request unless its `ignore_eos` is set.
        async_scheduling: schedule with placeholders for tokens still in flight (module
            docstring); outputs must then be applied in schedule order, one per non-empty
            plan. pipeline_depth P >= 2 (pipelined PP): a request with a token in flight runs
            again once its last plan is P plans old, or, disjoint_in_flight, once the token is
            applied (pipeline_rule.py).
        num_speculative_tokens: k draft slots behind every decode (0: no speculation);
            the runner's `uniform_decode_query_len` - 1. num_lookahead_tokens: slots past a
            decode's tokens it also gets blocks for (k for a draft model's KV, else 0).
        max_loras: with LoRA on, the most distinct adapters among the running requests (so in any
            step): a waiting request whose adapter would exceed it stays queued while later ones
            with running adapters (or none) are admitted, as vLLM's scheduler does. 0: LoRA off.
        kv_connector: the scheduler's side of a KV connector (graphrunner.kv_transfer): a waiting
            request's blocks past its local prefix-cache hit may come from it (they count as computed
            and cached; the runner loads them before the step), and each plan carries its metadata.
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_size: int,
        num_blocks: int,
        enable_chunked_prefill: bool = True,
        *,
        vocab_size: int | None = None,
        eos_token_ids: Iterable[int] = (),
        async_scheduling: bool = False,
        disjoint_in_flight: bool = False,
        pipeline_depth: int = 0,
        enable_prefix_caching: bool = False,
        num_speculative_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        max_loras: int = 0,
        kv_connector: KVConnectorScheduler | None = None,
    ) -> None:
        if type(num_speculative_tokens) is not int or num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens!r} must be an int >= 0")
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len), ("block_size", block_size)):
            if value <= 0:
                raise ValueError(f"{name}={value} must be positive")
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            # Without chunking, a prompt of max_model_len tokens could never be scheduled.
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} < max_model_len={max_model_len} "
                "needs enable_chunked_prefill=True"
            )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_model_len_source = ""  # where max_model_len came from, for over-length errors (LLM sets it)
        self.block_size = block_size
        self.enable_chunked_prefill = enable_chunked_prefill
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_allocator = PrefixCachingAllocator(num_blocks, block_size) if enable_prefix_caching else \
            BlockAllocator(num_blocks)
        self.cached_blocks: dict[str, int] = {}  # prefix caching: full blocks keyed so far, per running request

        self.requests: dict[str, Request] = {}  # live (waiting or running) requests
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the tail is preempted first
        # Finished since the last schedule(); the runner drops them on the next step.
        self._finished_req_ids: set[str] = set()
        # The finished ids the latest plan carries, until the next plan (or `step_failed`).
        self._handed_finished: set[str] = set()
        self.num_preemptions = 0  # running total, for stats and tests
        self.pipeline = PipelineRule(pipeline_depth, disjoint_in_flight) if pipeline_depth > 1 else None
        self.async_scheduling = async_scheduling or self.pipeline is not None
        self.num_speculative_tokens = num_speculative_tokens
        self.num_lookahead_tokens = num_lookahead_tokens
        # Slots a request may hold blocks for past its tokens: k per decode counted as computed
        # (sync: the one planned; async: the unresolved one too), and the lookahead.
        self.spec_lookahead = num_speculative_tokens * (2 if self.async_scheduling else 1) + num_lookahead_tokens
        # Async: the launched plans whose outputs are not applied yet, in schedule order.
        self._in_flight: deque[_Launched] = deque()
        # Siblings held back until their leader's prompt blocks are cached (add_request's wait_for).
        self._deferred: dict[str, list[Request]] = {}
        self.max_loras = max_loras
        self.running_loras: dict[int, int] = {}  # adapter id -> running requests with it
        # Multimodal models: the encoder budget and the runner's encoder cache, as the engine tracks them
        # (multimodal.scheduling.EncoderScheduler); None for a text-only model.
        self.encoder: Any = None
        self.kv_connector = kv_connector
        self.waiting_for_kv = False
        if kv_connector is not None and isinstance(self.block_allocator, PrefixCachingAllocator):
            self.block_allocator.on_evict = kv_connector.block_evicted
        # Steady decode (every running request decodes, nothing waits): plans and outputs as array
        # operations over the batch instead of ~10 Python calls per request and step, from this
        # many running requests on (None: always the general path). 256 decoding requests, schedule +
        # update on a CPU: 600 -> 130 us per step sync, 770 -> 190 us async. The arrays' fixed cost
        # loses below 16 (engine loop with a no-op step, 2-core CPU, fast / general path, sync: 56.6 /
        # 26.5 us at 1 request, 61.4 / 47.1 at 8, 64.7 / 66.1 at 16, 83.1 / 184.0 at 64).
        self._fast_decode_min: int | None = FAST_DECODE_MIN_REQUESTS
        self._batch: _DecodeBatch | None = None  # the running requests as of the last fast plan
        self._fast_plan: tuple[SchedulerOutput, _DecodeBatch] | None = None  # sync: the latest fast plan

    # ---------------------------------------------------------------- requests
    @property
    def num_blocks(self) -> int:
        return self.block_allocator.num_blocks

    def add_request(self, req_id: str, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                    wait_for: str | None = None, lora_request: LoRARequest | None = None, *,
                    extras: RequestExtras | None = None) -> Request:
        """Queue a request. Raises ValueError (and changes nothing) when it can never run.

        `extras`: what the runner receives with the prompt besides its token ids (pooling params,
        prompt embeddings, multimodal inputs; `RequestExtras`).

        `wait_for`: a live request with the same prompt (a sibling of parallel sampling, n > 1).
        With prefix caching this one is held back until that request's prompt blocks are
        cached, so that it takes them instead of computing the prompt again; then it goes to
        the front of the queue. Without prefix caching (or with nothing to share) it queues now.
        `lora_request`: the adapter it runs with (refused when LoRA is off).
        """
        prompt = self.check_request(req_id, prompt_token_ids, sampling_params)
        if lora_request is not None and not self.max_loras:
            raise ValueError(f"request {req_id!r}: lora_request={lora_request} needs enable_lora=True")
        req = Request(req_id=req_id, prompt_token_ids=prompt, sampling_params=sampling_params,
                      lora_request=lora_request, extras=extras or RequestExtras())
        if self.encoder is not None:
            self.encoder.check_request(req)
        self.requests[req_id] = req
        if wait_for is not None and self._can_share(wait_for, req):
            req.wait_for = wait_for
            self._deferred.setdefault(wait_for, []).append(req)
        else:
            self.waiting.append(req)
        return req

    def _can_share(self, leader_id: str, req: Request) -> bool:
        """Whether `req` gains from waiting for live `leader_id`'s prompt blocks (module docstring of
        prefix_cache.py: at most (prompt - 1) // block_size full blocks are ever taken from the cache)."""
        leader = self.requests.get(leader_id)
        return (isinstance(self.block_allocator, PrefixCachingAllocator) and leader is not None
                and leader.num_output_tokens == 0 and req.sampling_params.prompt_logprobs is None
                and (len(req.prompt_token_ids) - 1) // self.block_size > 0)

    def _release_deferred(self, leader_id: str) -> None:
        """Queue the requests held back for `leader_id` (its prompt is cached, or it ended), first in line."""
        for req in reversed(self._deferred.pop(leader_id, [])):
            req.wait_for = None
            self.waiting.appendleft(req)

    def _unlink(self, req: Request) -> None:
        """Take a live request out of the running list, the waiting queue or the held-back siblings."""
        if req.wait_for is not None:
            self._deferred[req.wait_for].remove(req)
            req.wait_for = None
        elif req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            if req.lora_request is not None:
                self._lora_running(req.lora_request.lora_int_id, -1)
        else:
            self.waiting.remove(req)

    def check_request(self, req_id: str, prompt_token_ids: Sequence[int], sampling_params: SamplingParams) -> list[int]:
        """Raise ValueError if `add_request` would refuse the request; changes nothing.

        Checks the id is not live, every prompt token id is an int (not a float, str or
        bool: the message names the value and its position), the prompt is non-empty,
        within max_model_len and the vocabulary, and the request fits the KV cache alone.
        Returns the prompt as a list of Python ints.
        """
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(
                f"request {req_id!r}: sampling_params must be a SamplingParams, got {type(sampling_params).__name__}"
            )
        if req_id in self.requests or req_id in self._finished_req_ids or any(
                req_id in launched.plan.num_scheduled_tokens for launched in self._in_flight):
            raise ValueError(f"duplicate req_id {req_id!r}: a request with this id is still live (or finished "
                             "but not yet reported to the runner, or in a step still in flight)")
        check_token_ids(f"request {req_id!r} prompt", prompt_token_ids)
        prompt = [int(t) for t in prompt_token_ids]
        validate_prompt(self, req_id, prompt, sampling_params)
        return prompt

    def max_computed_tokens(self, prompt_len: int, max_tokens: int) -> int:
        """Most token slots a request ever holds blocks for: the last sampled token is never
        computed, draft slots are (up to max_model_len)."""
        cap = self.max_model_len - (0 if self.num_speculative_tokens else 1)
        return min(prompt_len + max_tokens - 1 + self.spec_lookahead, max(prompt_len, cap))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's name): blocks in use keep their content, none is hit again."""
        if isinstance(self.block_allocator, PrefixCachingAllocator):
            self.block_allocator.reset()
            self.cached_blocks.clear()

    def abort_request(self, req_id: str) -> SequenceOutput | None:
        """Drop a live request (no-op for an unknown id); returns its output with finish_reason "abort"."""
        return self.finish_request(req_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, req_id: str, status: RequestStatus) -> SequenceOutput | None:
        """End a live request from outside a step (abort, stop string); None for an unknown id. Its
        blocks are freed at once (steps run in order), its in-flight tokens dropped when their
        outputs are applied (async), and the next plan's `finished_req_ids` frees its runner row."""
        req = self.requests.get(req_id)
        if req is None:
            return None
        self._unlink(req)
        if req.status == RequestStatus.RUNNING:  # only a request the runner holds is announced
            self._finished_req_ids.add(req_id)
        self._finish(req, status)
        return req.to_output()

    def abort_after_failure(self) -> list[SequenceOutput]:
        """Abort every live request after a step raised part-way (the engine's recovery path).

        Unlike `abort_request`, every aborted id goes to the runner in the next
        `finished_req_ids`, waiting ones too (a failed step may have admitted one the scheduler
        counts as waiting); the runner ignores ids it does not hold. Plans in flight (async)
        are dropped. Returns the outputs ("abort")."""
        self.step_failed()
        outputs = []
        for req in list(self.requests.values()):
            self._unlink(req)
            req.num_output_placeholders = 0
            self._finished_req_ids.add(req.req_id)
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            outputs.append(req.to_output())
        self._in_flight.clear()
        return outputs

    def step_failed(self) -> None:
        """The step of the latest plan raised: the runner may not have taken the plan's finished
        ids (its validation failed, or it was interrupted before reading them), so the next
        plan carries them again. Idempotent."""
        self._finished_req_ids |= self._handed_finished
        self._handed_finished = set()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def stats(self) -> SchedulerStats:
        """The counts behind the server's gauges (`SchedulerStats`)."""
        alloc = self.block_allocator
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.requests) - len(self.running),
            num_used_blocks=alloc.num_used, num_blocks=alloc.num_blocks, num_preemptions=self.num_preemptions,
            prefix_hit_tokens=getattr(alloc, "num_hit_tokens", 0),  # 0 without prefix caching
            prefix_query_tokens=getattr(alloc, "num_query_tokens", 0))

    # ---------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Plan the next step. Always returns an output (possibly with no tokens)."""
        new_reqs: list[NewRequestData] = []
        preempted: set[str] = set()
        self.waiting_for_kv = False  # set by admission when the connector says a request's KV is arriving
        fast_min = self._fast_decode_min
        fast = self._plan_decodes() if fast_min is not None and len(self.running) >= fast_min else None
        if fast is not None:
            batch, cached, num_scheduled, budget, counts = fast
        else:
            self._batch = None  # admissions and preemptions change what it holds
            cached = CachedRequestData()
            num_scheduled = {}
            budget = self._schedule_running(self.max_num_batched_tokens, cached, num_scheduled, preempted)
            # Admit waiting requests only if the cache was not just found to be full.
            if not preempted:
                budget = self._schedule_waiting(budget, new_reqs, num_scheduled)

        # The previous plan's step ran (else `step_failed` gave its ids back): its ids are delivered.
        finished, self._finished_req_ids = self._finished_req_ids, set()
        self._handed_finished = finished
        so = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=finished,
            preempted_req_ids=preempted,
        )
        if self.encoder is not None:
            so.scheduled_encoder_inputs, so.free_encoder_mm_hashes = self.encoder.take()
        if self.kv_connector is not None:  # before async counts the plan as computed: chunks start here
            so.kv_connector_metadata = self.kv_connector.build_connector_meta(so, self.requests)
        if self.async_scheduling and num_scheduled:
            if fast is not None:
                self._advance_decodes(so, batch, *counts)
            else:
                self._advance_in_flight(so)
        self._fast_plan = (so, batch) if fast is not None and not self.async_scheduling else None
        return so

    def _plan_decodes(
        self,
    ) -> tuple[_DecodeBatch, CachedRequestData, dict[str, int], int, tuple[np.ndarray, np.ndarray]] | None:
        """The fast path of `schedule`: when nothing waits and every running request decodes
        1 + k tokens within the budget and max_model_len, with the KV blocks it needs free (the
        general path would then preempt nothing), its plan (batch, cached, num_scheduled, budget
        left, and the requests' computed tokens and placeholders for `_advance_decodes`), made with
        array operations; None (nothing changed) for the general path."""
        running = self.running
        q = 1 + self.num_speculative_tokens
        if (self.waiting or not running or self.encoder is not None or self.kv_connector is not None
                or self.pipeline is not None):
            return None
        batch = self._batch
        if batch is not None and not batch.matches(running):
            # Requests ended since the last plan (most steps of a large batch): drop their rows.
            batch = batch.select(np.fromiter(map(self.requests.__contains__, batch.ids), bool, len(batch.ids)))
            if not batch.matches(running):
                batch = None
        if batch is None:
            batch = _DecodeBatch.of(list(running), self.eos_token_ids)
        self._batch = batch
        held = np.zeros(len(batch.reqs), np.int64)  # sync: no placeholders
        if self.async_scheduling:  # `_finishes_in_flight`: not scheduled (async: the last token is in flight)
            held = _gather(_PLACEHOLDERS, batch.reqs)
            if held.any():
                pending = _gather_len(_OUTPUTS, batch.reqs) + held
                done = (held > 0) & ((pending >= batch.max_tokens) | (batch.num_prompt + pending >= self.max_model_len))
                if done.any():
                    batch, held = batch.select(~done), held[~done]
        reqs = batch.reqs
        n = len(reqs)
        computed = _gather(_NUM_COMPUTED, reqs)
        if (not n or n * q > self.max_num_batched_tokens or (batch.num_prefill <= 0).any()
                or (batch.num_prefill > computed).any() or (computed > self.max_model_len - q).any()):
            return None  # a prefill chunk, a decode cut by the budget or max_model_len
        # `_try_grow` for all: blocks for q tokens and the lookahead, the new ones in admission order.
        end = np.minimum(computed + (q + self.num_lookahead_tokens), self.max_model_len)
        needed = -(-end // self.block_size) - _gather_len(_BLOCKS, reqs)
        new_block_ids: list[list[int] | None] = [None] * n
        growing = np.flatnonzero(needed > 0)
        if growing.size:
            if not self.block_allocator.can_allocate(int(needed[growing].sum())):
                return None  # someone would be preempted
            for i, num in zip(growing.tolist(), needed[growing].tolist(), strict=True):
                new_blocks = self.block_allocator.allocate(num)
                reqs[i].block_ids.extend(new_blocks)
                new_block_ids[i] = new_blocks
        cached = CachedRequestData(list(batch.ids), new_block_ids, computed.tolist())
        return batch, cached, dict.fromkeys(batch.ids, q), self.max_num_batched_tokens - n * q, (computed, held)

    def _advance_decodes(self, so: SchedulerOutput, batch: _DecodeBatch, computed: np.ndarray,
                         held: np.ndarray) -> None:
        """`_advance_in_flight` of a fast plan (`computed`, `held`: its requests' counts as planned):
        every request decodes, so each samples."""
        reqs = batch.reqs
        _scatter(reqs, "num_computed_tokens", computed + (1 + self.num_speculative_tokens))
        _scatter(reqs, "num_output_placeholders", held + 1)
        self._in_flight.append(_Launched(so, batch.id_set, batch.id_set, batch, self.num_preemptions))

    def _schedule_running(
        self, budget: int, cached: CachedRequestData, num_scheduled: dict[str, int], preempted: set[str]
    ) -> int:
        """Pass 1: schedule the running requests in admission order; returns the budget left."""
        # `self.running` shrinks from the tail as we preempt, and only unscheduled
        # requests (index > i) or the current one can be preempted.
        i, cap = 0, self.pipeline.cap(len(self.running)) if self.pipeline else len(self.running)
        while i < len(self.running) and budget > 0 and len(num_scheduled) < cap:
            req = self.running[i]
            num_new = 0 if self._finishes_in_flight(req) else self.num_new_tokens(req, budget)
            if num_new == 0:
                i += 1
                continue
            new_blocks = self._try_grow(req, num_new, preempted)
            if new_blocks is None:
                break  # `req` preempted itself; everything after it is gone too
            cached.req_ids.append(req.req_id)
            cached.new_block_ids.append(new_blocks or None)
            cached.num_computed_tokens.append(req.num_computed_tokens)
            num_scheduled[req.req_id] = num_new
            if self.encoder is not None:
                self.encoder.commit(req, req.num_computed_tokens, num_new)
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, budget: int, new_reqs: list[NewRequestData], num_scheduled: dict[str, int]) -> int:
        """Pass 2: admit waiting requests in FCFS order; returns the budget left. A request whose
        adapter would make the running adapters more than `max_loras` is passed over (it keeps its
        place) for this step."""
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.num_output_placeholders:
                break  # preempted with a token in flight: resume once it is known (FCFS)
            if req.lora_request is not None and not self._lora_fits(req.lora_request.lora_int_id):
                skipped.append(self.waiting.popleft())
                continue
            remaining = req.num_tokens  # waiting requests have nothing computed
            if not self.enable_chunked_prefill and remaining > budget:
                break
            admitted = admit_blocks(self, req, budget)  # (with prefix caching: its cached prefix first)
            if admitted is None:
                break  # FCFS: do not let later, smaller requests jump the queue
            num_new, block_ids = admitted
            if num_new == 0:  # the encoder cannot serve its first image yet: undo, and keep FCFS
                self.block_allocator.free(block_ids)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.block_ids = block_ids
            if self.encoder is not None:
                self.encoder.commit(req, req.num_computed_tokens, num_new)
            if not req.num_preemptions:
                req.num_cached_tokens = req.num_computed_tokens
            req.status = RequestStatus.RUNNING
            req.num_prefill_tokens = req.num_tokens
            self.running.append(req)
            if req.lora_request is not None:
                self._lora_running(req.lora_request.lora_int_id, 1)
            new_reqs.append(
                NewRequestData(
                    req_id=req.req_id,
                    prompt_token_ids=list(req.prompt_token_ids),
                    sampling_params=req.sampling_params,
                    block_ids=list(req.block_ids),
                    num_computed_tokens=req.num_computed_tokens,
                    output_token_ids=list(req.output_token_ids),
                    lora_request=req.lora_request,
                    pooling_params=req.extras.pooling_params,
                    prompt_embeds=req.extras.prompt_embeds,
                    mm_features=list(req.extras.mm_features),
                )
            )
            num_scheduled[req.req_id] = num_new
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _lora_fits(self, adapter_id: int) -> bool:
        return adapter_id in self.running_loras or len(self.running_loras) < self.max_loras

    def _lora_running(self, adapter_id: int, change: int) -> None:
        """A request with adapter `adapter_id` starts (+1) or stops (-1) running."""
        count = self.running_loras.get(adapter_id, 0) + change
        if count:
            self.running_loras[adapter_id] = count
        else:
            del self.running_loras[adapter_id]

    def _finishes_in_flight(self, req: Request) -> bool:
        """Async: nothing to schedule while the request's in-flight tokens end it by length, or
        while the pipeline rule holds it back."""
        if not req.num_output_placeholders:
            return False
        return bool(self.pipeline and self.pipeline.waits(req)) or (
            req.num_output_tokens + req.num_output_placeholders >= req.sampling_params.max_tokens
            or req.num_tokens_with_placeholders >= self.max_model_len)

    def _advance_in_flight(self, so: SchedulerOutput) -> None:
        """Async: count the plan's tokens as computed (drafts included: the output takes the
        rejected ones back), and each chunk that samples as one placeholder."""
        produces, decodes = set(), set()
        for req_id, num_new in so.num_scheduled_tokens.items():
            req = self.requests[req_id]
            if req.is_decoding:
                decodes.add(req_id)
            req.num_computed_tokens += num_new
            if req.is_decoding:  # the chunk reached the end of the known tokens: it samples
                req.num_output_placeholders += 1
                produces.add(req_id)
        self._in_flight.append(_Launched(so, frozenset(produces), frozenset(decodes)))
        if self.pipeline is not None:
            self.pipeline.launched(self.requests[r] for r in so.num_scheduled_tokens)

    def schedule_drafts(self, so: SchedulerOutput, req_id: str, draft_ids: list[int]) -> None:
        """Give a planned decode of `so` real drafts, a prefix of its draft slots (the rest are dropped)."""
        cut = so.num_scheduled_tokens[req_id] - 1 - len(draft_ids)
        so.num_scheduled_tokens[req_id] -= cut
        so.total_num_scheduled_tokens -= cut
        so.scheduled_spec_decode_tokens[req_id] = list(draft_ids)
        if self.async_scheduling:  # `_advance_in_flight` counted every planned slot as computed
            self.requests[req_id].num_computed_tokens -= cut

    def num_new_tokens(self, req: Request, budget: int) -> int:
        """Tokens to compute for `req` this step, capped by the budget and by max_model_len
        (KV beyond it has no room in the runner's tables): a prefill chunk's uncomputed
        tokens, or a decode's last sampled token and its k draft slots (known or not)."""
        wanted = 1 + self.num_speculative_tokens if req.is_decoding else req.num_uncomputed_tokens
        room = self.max_model_len - req.num_computed_tokens
        num_new = max(0, min(wanted, budget, room))
        if self.encoder is not None and num_new and req.extras.mm_features:  # stop before an image not encodable now
            num_new = self.encoder.trim(req, req.num_computed_tokens, num_new)
        return num_new

    def _try_grow(self, req: Request, num_new: int, preempted: set[str]) -> list[int] | None:
        """Blocks for `num_new` more tokens, preempting from the tail of `running` as needed:
        the new block ids, or None if `req` itself was preempted."""
        # A decode also reserves the lookahead (a draft model's KV for its drafts). Negative after
        # rejected drafts: the request still holds blocks for their slots.
        end = min(req.num_computed_tokens + num_new + self.num_lookahead_tokens * req.is_decoding, self.max_model_len)
        needed = max(0, _cdiv(end, self.block_size) - len(req.block_ids))
        if needed == 0:
            return []  # most decode steps: the last block still has room
        while not self.block_allocator.can_allocate(needed):
            victim = self.running.pop()
            if victim.lora_request is not None:
                self._lora_running(victim.lora_request.lora_int_id, -1)
            self._preempt(victim)
            preempted.add(victim.req_id)
            if victim is req:
                if self.block_allocator.num_used == 0:
                    # Alone with the whole cache and still short: add_request's bound was
                    # broken; retrying would spin forever.
                    raise RuntimeError(
                        f"request {req.req_id!r} needs {needed} more KV blocks with the whole cache "
                        f"(num_blocks={self.num_blocks}) free; it can never be scheduled"
                    )
                return None
        new_blocks = self.block_allocator.allocate(needed)
        req.block_ids.extend(new_blocks)
        return new_blocks

    def _preempt(self, req: Request) -> None:
        """Preempt by recompute: drop the KV, keep the tokens, requeue at the front."""
        self.block_allocator.free(req.block_ids)
        self.cached_blocks.pop(req.req_id, None)
        if self.encoder is not None:
            self.encoder.release(req)
        if self.kv_connector is not None:
            self.kv_connector.request_preempted(req)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---------------------------------------------------------------- update

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[SequenceOutput]:
        """Apply one step's sampled tokens; returns the requests that finished in it.

        Raises RuntimeError when the runner's output does not match the plan (a token for a
        partial prefill chunk, none for a chunk that reached its end, or more than a chunk can
        emit: 1, or 1 + its draft slots for a decode)."""
        # Prefix caching: key the blocks the last applied step filled (sync: this one's, once applied).
        if self.async_scheduling:
            return self._update_from_async_output(scheduler_output, runner_output)
        fast_plan, self._fast_plan = self._fast_plan, None
        finished = None
        if fast_plan is not None and fast_plan[0] is scheduler_output:
            finished = self._apply_decodes(fast_plan[1], runner_output, None)
        if finished is None:
            finished = self._apply_output(scheduler_output, runner_output)
            cache_filled_blocks(self, scheduler_output)
        self._release_cached_siblings()
        return finished

    def _release_cached_siblings(self) -> None:
        """Queue the siblings whose leader's prompt blocks are cached now."""
        if self._deferred:
            for leader_id in [r for r in self._deferred if self._prompt_cached(r)]:
                self._release_deferred(leader_id)

    def _prompt_cached(self, leader_id: str) -> bool:
        """Whether the siblings held back for `leader_id` may go: its shareable prompt blocks are
        keyed in the prefix cache (or it ended)."""
        leader = self.requests.get(leader_id)
        if leader is None:
            return True
        return self.cached_blocks.get(leader_id, 0) >= (leader.num_prompt_tokens - 1) // self.block_size

    def _apply_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[SequenceOutput]:
        finished: list[SequenceOutput] = []
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted between schedule() and now
            out = self._apply_one(req, num_tokens, runner_output)
            if out is not None:
                finished.append(out)
        return finished

    def _apply_one(self, req: Request, num_tokens: int, runner_output: ModelRunnerOutput) -> SequenceOutput | None:
        """Sync: apply a running request's part of the output; its output if it finished."""
        index, sampled = output_entry(req, runner_output)
        if req.is_decoding:
            check_num_sampled(req, sampled, num_tokens)
            req.num_computed_tokens += len(sampled)  # KV of rejected drafts is rewritten later
        else:
            req.num_computed_tokens += num_tokens
            if req.num_computed_tokens < req.num_tokens:
                check_partial_prefill(req, sampled)
                return None
            check_num_sampled(req, sampled, 1)
        return self._append_sampled(req, sampled, runner_output, index)

    def _update_from_async_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[SequenceOutput]:
        """Async: placeholders become tokens, rejected drafts stop counting as computed, and
        finished requests' later in-flight tokens are dropped."""
        if not self._in_flight or self._in_flight[0].plan is not scheduler_output:
            raise RuntimeError(
                "async scheduling: outputs must be applied in schedule order, once per non-empty plan "
                f"({len(self._in_flight)} plans in flight)"
            )
        launched = self._in_flight.popleft()
        if launched.batch is not None and launched.num_preemptions == self.num_preemptions:
            finished = self._apply_decodes(launched.batch, runner_output, launched)
            if finished is not None:
                self._release_cached_siblings()
                return finished
        cache_filled_blocks(self, scheduler_output)
        finished = []
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None:
                continue  # finished (by an earlier output) or aborted since: discard its tokens
            out = self._apply_one_async(req, num_tokens, launched, runner_output)
            if out is not None:
                finished.append(out)
        self._release_cached_siblings()
        return finished

    def _apply_one_async(self, req: Request, num_tokens: int, launched: _Launched,
                         runner_output: ModelRunnerOutput) -> SequenceOutput | None:
        """Async: apply a live request's part of the output; its output if it finished."""
        req_id = req.req_id
        index, sampled = output_entry(req, runner_output)
        if bool(sampled) != (req_id in launched.produces):
            raise RuntimeError(
                f"runner sampled {sampled} for request {req_id!r}, but its chunk "
                f"{'reached' if req_id in launched.produces else 'did not reach'} the end of its tokens"
            )
        if not sampled:
            return None
        decoded = req_id in launched.decodes
        check_num_sampled(req, sampled, num_tokens if decoded else 1)
        req.num_output_placeholders -= 1
        # A preempted request (WAITING: it cannot be re-admitted while this token was a
        # placeholder) already counts nothing as computed.
        if decoded and req.status == RequestStatus.RUNNING:
            req.num_computed_tokens -= num_tokens - len(sampled)
        return self._append_sampled(req, sampled, runner_output, index)

    def _apply_decodes(self, batch: _DecodeBatch, runner_output: ModelRunnerOutput,
                       launched: _Launched | None) -> list[SequenceOutput] | None:
        """The fast path of `update_from_output` (`launched`: async) for a fast plan's output of one
        token per request: array operations for the requests it does not end, the general
        per-request code, in plan order, for the others (a token that may stop it, length, a first
        token). None (nothing changed) when the general path must apply it: logprobs, speculation,
        a request aborted (sync) since the plan, an entry missing or sampling nothing."""
        tokens, produces = runner_output.token_array, runner_output.produces_array
        if (tokens is None or runner_output.logprobs is not None or runner_output.prompt_logprobs_dict
                or self.num_speculative_tokens or self.kv_connector is not None):
            return None
        reqs, ids, num_prompt, max_tokens = batch.reqs, batch.ids, batch.num_prompt, batch.max_tokens
        if launched is None:
            if not batch.matches(self.running):  # aborted between schedule() and now
                return None
        else:  # a request finished (or aborted) since the plan: its token is discarded
            live = np.fromiter(map(self.requests.__contains__, ids), bool, len(ids))
            if not live.all():
                keep = live.tolist()
                reqs, ids = list(compress(reqs, keep)), list(compress(ids, keep))
                num_prompt, max_tokens = num_prompt[live], max_tokens[live]
        if runner_output.req_ids == ids:
            rows: Any = slice(None)
        else:
            index = runner_output.req_id_to_index
            if not all(map(index.__contains__, ids)):
                return None
            rows = np.fromiter(map(index.__getitem__, ids), np.int64, len(ids))
        if produces is not None and not produces[rows].all():
            return None
        sampled = tokens[rows]
        prefix_caching = isinstance(self.block_allocator, PrefixCachingAllocator)
        num_outputs = _gather_len(_OUTPUTS, reqs)
        # Async applies no computed count (one token per decode: nothing rejected), so reads it only to cache blocks.
        computed = _gather(_NUM_COMPUTED, reqs) if launched is None or prefix_caching else num_outputs
        if launched is not None and prefix_caching:  # the blocks the previous output filled
            self._cache_filled(reqs, ids, num_prompt + num_outputs, computed)
        # Requests this token may end (`Request.stop_status`), or that get their first token.
        special = ((num_outputs == 0) | (num_outputs + 1 >= max_tokens)
                   | (num_prompt + num_outputs + 1 >= self.max_model_len) | np.isin(sampled, batch.stop_ids))
        plain_reqs, plain_computed = reqs, computed
        if special.any():
            plain_reqs = list(compress(reqs, (~special).tolist()))
            sampled, plain_computed = sampled[~special], computed[~special]
        if launched is None:
            _scatter(plain_reqs, "num_computed_tokens", plain_computed + 1)
        else:
            _scatter(plain_reqs, "num_output_placeholders", _gather(_PLACEHOLDERS, plain_reqs) - 1)
        for _ in map(list.append, map(_OUTPUTS, plain_reqs), sampled.tolist()):
            pass
        finished: list[SequenceOutput] = []
        for i in np.flatnonzero(special).tolist():
            if launched is None:
                out = self._apply_one(reqs[i], 1, runner_output)
            else:
                out = self._apply_one_async(reqs[i], 1, launched, runner_output)
            if out is not None:
                finished.append(out)
        if launched is None and prefix_caching:
            # Each request not finished now has one more token, and one more computed.
            num_tokens, computed = num_prompt + num_outputs + 1, computed + 1
            if finished:
                keep = np.fromiter(map(self.requests.__contains__, ids), bool, len(ids))
                mask = keep.tolist()
                reqs, ids = list(compress(reqs, mask)), list(compress(ids, mask))
                num_tokens, computed = num_tokens[keep], computed[keep]
            self._cache_filled(reqs, ids, num_tokens, computed)
        return finished

    def _cache_filled(self, reqs: list[Request], ids: list[str], num_tokens: np.ndarray, computed: np.ndarray) -> None:
        """`cache_filled_blocks` for live running requests (their token and computed counts), with
        array operations."""
        bs = self.block_size
        full = np.minimum(np.minimum(computed, num_tokens - 1), _gather_len(_BLOCKS, reqs) * bs) // bs
        known = np.fromiter(map(self.cached_blocks.get, ids, repeat(0)), np.int64, len(ids))
        alloc = self.block_allocator
        assert isinstance(alloc, PrefixCachingAllocator)
        for i in np.flatnonzero(full > known).tolist():
            req = reqs[i]
            alloc.register(req.block_key_tokens, req.block_ids, int(full[i]), req.cache_salt, int(known[i]))
            self.cached_blocks[ids[i]] = int(full[i])

    def _append_sampled(
        self, req: Request, sampled: list[int], runner_output: ModelRunnerOutput, index: int
    ) -> SequenceOutput | None:
        """Append a step's tokens one by one; the first that ends the request finishes it
        (the rest of an accepted run is dropped) and its output is returned."""
        for j, token in enumerate(sampled):
            req.append_output(int(token), token_logprobs(runner_output, index, j))
            status = req.stop_status(self.eos_token_ids, self.max_model_len)
            if status is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
                if req.lora_request is not None:
                    self._lora_running(req.lora_request.lora_int_id, -1)
                self._finished_req_ids.add(req.req_id)
            else:
                self.waiting.remove(req)  # async: preempted while these tokens were in flight
            self._finish(req, status)
            return req.to_output()
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.req_id in self._deferred:
            self._release_deferred(req.req_id)
        if self.kv_connector is not None:
            self.kv_connector.request_finished(req)
        req.status = status
        if self.encoder is not None:
            self.encoder.release(req)
        if req.block_ids:
            self.block_allocator.free(req.block_ids)
            self.cached_blocks.pop(req.req_id, None)
            req.block_ids = []
        del self.requests[req.req_id]
