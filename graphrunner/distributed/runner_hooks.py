"""What the runner does differently under TP / PP / DP, kept out of runner.py.

`ParallelHooks` is owned by a `ModelRunner` and called at a handful of seams of the
step; for a single process every hook is a cheap no-op. It receives what it uses (the
stage buffers, the graphs to dispatch with, the post-update and dummy-step functions),
never the runner.

Step protocol (all ranks run the same engine in SPMD; see `graphrunner.engine.llm`):

* Graph mode / descriptor agreement. The TP ranks and the PP stages of one DP replica
  run the same deterministic scheduler over the same requests and the same dispatch
  table (same config, same capture), so they derive the same descriptor for every step
  without communicating. DP replicas have different requests: they agree through the
  DP coordinator's one CPU all-reduce (min mode, max tokens), then re-dispatch locally.
* PP, before the forward (non-first stages): receive the previous stage's hidden states
  and residual into persistent [max_num_tokens, hidden] buffers, `[:num_tokens_padded]`,
  outside any graph. The forward (eager, compiled pieces or FULL graph) reads those
  buffers; a non-last stage's step body copies its (hidden, residual) into persistent
  output buffers, which are then sent to the next stage (outside graphs).
* PP, after the forward: the last stage broadcasts the step's sampled tokens through
  the `PPHandler` (sibling PP communicator, async work / side stream). Pipelined (the
  default without speculation): a non-last stage queues the receive and runs
  `post_update` at once (counts advance; the rows that sampled get placeholder tokens),
  and the tokens are applied when the engine takes the step's output (`take_tokens`,
  in step order, rows that changed hands since skipped by the generation counters).
  The engine keeps up to P batches of disjoint requests in flight, so a request's
  placeholder is overwritten before it runs again, and stage 0 runs batch T + 1 while
  the last stage runs batch T. With speculative decoding (a [rows, 2k + 4] outcome per
  step) the non-last stages consume the broadcast in the same step (depth 0), write it
  into their buffers and run `post_update` then.
* DP: replicas of a dense model share no collective, so by default each runs on its own
  (no per-step exchange, no padding to another replica, no dummy steps). With
  `data_parallel_lockstep=True` the `DPCoordinator` (one CPU all-reduce of every replica's
  report) gives the agreed descriptor and an idle replica runs a dummy step of it (`idle_step`).
  With `enable_dbo` too, each report says whether the rank would split its step; when the
  decision says microbatch, the step runs eagerly and its forward as two microbatches on two
  streams (`graphrunner.step.microbatch`), counted in `num_microbatched_steps`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from capture.descriptor import BatchExecutionDescriptor
from capture.modes import CUDAGraphMode
from graphrunner.distributed.groups import ParallelGroups
from graphrunner.spec_decode.step import SpeculativeStep
from graphrunner.state.features import SamplingFeatures
from graphrunner.step.body import StepBody
from graphrunner.step.buffers import StageBuffers
from graphrunner.step.graphs import StepGraphs
from graphrunner.step.inputs import InputBatch
from graphrunner.step.microbatch import Microbatcher, wants_microbatch

logger = logging.getLogger("graphrunner.distributed")


class CollectiveError(RuntimeError):
    """A step's communication with its peers failed (a peer died, stalled past the
    collective timeout, or diverged); the message says which exchange and where."""


class ParallelHooks:
    """The TP/PP/DP seams of one runner. `groups` describes this rank's place in the world."""

    def __init__(self, groups: ParallelGroups, *, max_num_reqs: int, num_rows: int, device: torch.device,
                 spec: SpeculativeStep | None = None) -> None:
        check_context_parallel(groups, spec)
        self.groups = groups
        self.device = device
        self.pp = groups.pp
        self.is_first_stage = groups.pp.is_first
        self.is_last_stage = groups.pp.is_last
        self.stage = StageBuffers()  # [max_T, hidden] PP buffers (allocate_buffers)
        self._dp: Any = None  # DPCoordinator, built lazily (dp_size > 1: it needs the dispatch table)
        self.last_dp_decision: Any = None
        self.num_dummy_steps = 0  # idle-DP-rank dummy steps run so far
        self._ubatch: Microbatcher | None = None  # DBO under lockstep DP (built with the first step)
        self.pp_handler: Any = None
        self._sends: list[Any] = []  # the last step's hidden-state sends (dist.Work), waited at the next
        # Pipelined PP (no speculation): a non-last stage applies a step's tokens when its output
        # is taken, not in the step, so it can run the next batches meanwhile (module docstring).
        self.defers_tokens = groups.pp_size > 1 and spec is None and not self.is_last_stage
        self._taken: deque[Any] = deque()  # StepTokens applied early (`before_forward`), for their outputs
        if groups.pp_size > 1:
            from graphrunner.distributed.pp_handler import PPHandler

            self.pp_handler = PPHandler(
                groups.pp_broadcast_group, max_num_reqs, device, depth=groups.pp_size if spec is None else 0,
                num_rows=num_rows, timeout_s=groups.config.collective_timeout_s,
                width=spec.pp_width if spec is not None else 1,
            )
        self.spec = spec  # speculative decoding: rows of emitted tokens, counts and drafts go round

    @contextmanager
    def exchange(self, what: str) -> Iterator[None]:
        """Re-raise a failed collective as CollectiveError naming the exchange, this rank's
        place and the timeout (used only on multi-process paths: no cost for one process)."""
        try:
            yield
        except CollectiveError:
            raise
        except RuntimeError as e:
            g = self.groups
            raise CollectiveError(
                f"{what} failed on rank {g.rank} (tp {g.tp_rank}/{g.tp_size}, pp {g.pp_rank}/{g.pp_size}, "
                f"dp {g.dp_rank}/{g.dp_size}; collective_timeout_s={g.config.collective_timeout_s}): a peer died, "
                f"stalled or diverged: {e}"
            ) from e

    def raise_step_failure(self, error: RuntimeError) -> NoReturn:
        """Raise for a step whose forward failed: under TP/PP/DP a CollectiveError naming this
        rank's place (TP all-reduces run inside the model); for one process `error` as it is."""
        if self.groups.world_size == 1 or isinstance(error, CollectiveError):
            raise error
        with self.exchange("the step's forward (its tensor-parallel all-reduces)"):
            raise error

    def on_row_freed(self, row: int) -> None:
        """A request row changed hands: receives queued for it must not be applied."""
        if self.pp_handler is not None:
            self.pp_handler.generations.bump(row)

    def _finish_sends(self) -> None:
        sends, self._sends = self._sends, []
        if sends:
            with self.exchange(f"PP send of the previous step's hidden states to rank {self.pp.next_rank}"):
                for work in sends:
                    work.wait()

    def close(self) -> None:
        """Finish in-flight sends and broadcasts (before the groups are destroyed)."""
        self._finish_sends()
        if self.pp_handler is not None:
            self.pp_handler.close()
            self.pp_handler = None

    # ---- set-up -------------------------------------------------------------------
    def allocate_buffers(self, max_num_tokens: int, hidden_size: int, dtype: torch.dtype) -> StageBuffers:
        """Persistent PP buffers of the largest step (graphs capture their addresses)."""
        if self.groups.pp_size > 1:
            self.stage = StageBuffers.allocate(max_num_tokens, hidden_size, dtype, self.device,
                                               receives=not self.is_first_stage, sends=not self.is_last_stage)
        return self.stage

    def agree_num_kv_blocks(self, num_blocks: int) -> int:
        """The minimum over the world: every rank of a replica must size the same cache."""
        cpu = self.groups.world_cpu_group
        if cpu is None:
            return num_blocks
        t = torch.tensor([num_blocks], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=cpu)
        return int(t.item())

    # ---- per step: descriptor -------------------------------------------------------
    def dispatch(self, graphs: StepGraphs, num_reqs: int, num_tokens: int, uniform: int | None,
                 force_eager: bool = False) -> BatchExecutionDescriptor:
        """The step's descriptor: local dispatch, then DP agreement (lockstep DP only)."""
        if not self.groups.dp_lockstep:
            return graphs.dispatch(num_reqs, num_tokens, uniform, force_eager)
        plan = self._coordinate(graphs, num_reqs, num_tokens, uniform, force_eager)
        assert plan.descriptor is not None and not plan.dummy, "a busy DP rank got no descriptor"
        if plan.microbatch:  # two microbatches run eagerly at this rank's real size (step/microbatch.py)
            return BatchExecutionDescriptor(CUDAGraphMode.NONE, num_tokens, num_reqs)
        return plan.descriptor

    def _coordinate(self, graphs: StepGraphs, num_reqs: int, num_tokens: int, uniform: int | None,
                    force_eager: bool = False):
        """One DP all-reduce; returns this rank's `RankPlan` (and arms or disarms DBO's split)."""
        from graphrunner.distributed.dp_coordinator import DPCoordinator, DPReport

        if self._dp is None:
            self._dp = DPCoordinator(self.groups.dp.cpu_group, graphs.table)
        wants = self._wants_microbatch(graphs.body, num_reqs, num_tokens, uniform)
        # Before capture every step is eager: report NONE so that nobody replays.
        report = DPReport.from_batch(graphs.table, num_reqs, num_tokens, uniform, wants_microbatch=wants,
                                     force_eager=force_eager or not graphs.captured)
        with self.exchange("DP step agreement (all-reduce over the data-parallel replicas)"):
            decision = self._dp.coordinate(report)
        self.last_dp_decision = decision
        plan = decision.for_rank(self.groups.dp_rank)
        if self._ubatch is not None:
            self._ubatch.arm(plan.ubatch_split if plan.microbatch and not plan.dummy else None)
        return plan

    def _wants_microbatch(self, body: StepBody, num_reqs: int, num_tokens: int, uniform: int | None) -> bool:
        """DBO (config.enable_dbo): whether this rank would split its step; builds the microbatcher once."""
        config = self.groups.config
        if not config.enable_dbo:
            return False
        if self._ubatch is None:
            self._ubatch = body.microbatch = Microbatcher(body.limits.max_num_reqs, self.device)
        return wants_microbatch(num_reqs, num_tokens, uniform, body.limits.uniform_decode_query_len,
                                config.dbo_decode_token_threshold, config.dbo_prefill_token_threshold)

    @property
    def num_microbatched_steps(self) -> int:
        """Steps whose forward actually ran as two microbatches (DBO; 0 without it)."""
        return self._ubatch.num_steps if self._ubatch is not None else 0

    def idle_step(self, graphs: StepGraphs, body: StepBody) -> None:
        """A lockstep DP rank with nothing scheduled: join the coordination and run a dummy
        step of the agreed size, so that every collective inside the step (TP, PP) matches."""
        if not self.groups.dp_lockstep:
            return
        plan = self._coordinate(graphs, 0, 0, None)
        if plan.skip:
            return
        self.num_dummy_steps += 1
        self._dummy_step(graphs, body, plan.descriptor)

    def _dummy_step(self, graphs: StepGraphs, body: StepBody, desc: BatchExecutionDescriptor) -> None:
        """The agreed descriptor over scratch entries only: the same graph / compiled / eager
        body (and PP exchange) as a real step of that shape, touching no live request."""
        query_lens = graphs.capture_query_lens(desc)
        num_reqs_padded = desc.num_reqs if desc.num_reqs is not None else len(query_lens)
        batch = body.dummy_batch(query_lens, SamplingFeatures(), num_reqs_padded, desc.num_tokens)
        body.current_batch = batch
        self.before_forward(batch)
        graphs.run(desc, batch)
        self.after_forward(batch, None, body.post_update)
        body.current_batch = None
        body.reset_scratch_row()

    # ---- per step: PP -----------------------------------------------------------------
    def before_forward(self, batch: InputBatch, requests: Any = None) -> None:
        """Non-first stages: receive the previous stage's output for this step. Non-last stages
        first finish the previous step's sends (this step rewrites their buffers), then apply
        the broadcast tokens this step's requests still wait for (`requests`: the runner's
        request states; None for a dummy step). Those come from a step at least P steps old
        (the scheduler's pipeline rule), so on CUDA the stream waits on a broadcast that has
        normally landed, and the host never waits for a token before a launch."""
        self._finish_sends()
        if self.defers_tokens and requests is not None:
            with self.exchange("PP broadcast of the sampled tokens from the last stage (receive)"):
                for got, every in self.pp_handler.take_for(batch.idx_mapping_np[: batch.num_reqs]):
                    self._apply(got, requests.last_sampled, requests.all_token_ids)
                    self._taken.append(every)
        num_tokens_padded = batch.num_tokens_padded
        stage = self.stage
        if stage.hidden_in is None or stage.residual_in is None:
            return
        src, group = self.pp.prev_rank, self.pp.device_group
        with self.exchange(f"PP receive of the step's hidden states from rank {src}"):
            dist.recv(stage.hidden_in[:num_tokens_padded], src=src, group=group)
            dist.recv(stage.residual_in[:num_tokens_padded], src=src, group=group)

    def after_forward(self, batch: InputBatch, produces: np.ndarray | None,
                      post_update: Callable[[InputBatch], None], positions: np.ndarray | None = None) -> None:
        """Send the stage output on; exchange the sampled tokens; finish non-last stages' state.

        produces: [R] bool, which requests sample a token this step; None for a dummy
        step (scratch rows only: no token exchange, every stage skips it alike).
        positions: [R] where each entry's token goes in its history (deferred stages).
        """
        if self.groups.pp_size == 1:
            return
        Tp = batch.num_tokens_padded
        stage = self.stage
        if stage.hidden_out is not None and stage.residual_out is not None:
            dst, group = self.pp.next_rank, self.pp.device_group
            with self.exchange(f"PP send of the step's hidden states to rank {dst}"):
                # Non-blocking: waited for when the buffers are next rewritten (`before_forward`),
                # so the host goes on to the next batch while the hidden states travel.
                self._sends = [dist.isend(stage.hidden_out[:Tp], dst=dst, group=group),
                               dist.isend(stage.residual_out[:Tp], dst=dst, group=group)]
        if produces is not None:
            with self.exchange("PP broadcast of the sampled tokens from the last stage"):
                if self.defers_tokens:  # queue the receive; the tokens are applied by `take_tokens`
                    self.pp_handler.post_sample(batch.idx_mapping_np[: batch.num_reqs], batch.num_reqs_padded,
                                                produces=produces, positions=positions)
                else:
                    self._exchange_sampled(batch, produces)
        if not self.is_last_stage:
            # Deferred: the counts advance now; the rows that sampled get placeholder tokens, which
            # `take_tokens` overwrites before the scheduler can run those requests again.
            post_update(batch)

    def deferred_output(self, pending: Any, build: Callable[[Any, dict], Any], requests: Any,
                        async_output: bool) -> Any:
        """A non-last stage's output of a pipelined step: its tokens are taken from the last
        stage's broadcast when the output is resolved (at once, or on `AsyncOutput.get()`)."""
        from graphrunner.async_output import AsyncOutput

        def resolve(_host: dict | None = None) -> Any:
            taken = self.take_tokens(pending.produces_token, requests.last_sampled, requests.all_token_ids)
            # [R] int32 on the host (waits for the step's broadcast only); nothing sampled: prefill chunks only
            every = taken.get() if taken is not None else torch.zeros(pending.batch.num_reqs, dtype=torch.int32)
            return build(pending, {"sampled": every})

        return AsyncOutput(None, -1, {}, resolve, None) if async_output else resolve()

    def take_tokens(self, produces: np.ndarray, last_sampled: torch.Tensor, all_token_ids: torch.Tensor) -> Any:
        """A deferred (non-last stage) step's tokens, in step order: applied to the request rows
        that still hold their request; returns every entry's token (`StepTokens`; None: nothing sampled)."""
        if not produces.any():
            return None
        if self._taken:  # applied before a later step's forward (`before_forward`): older than any queued
            return self._taken.popleft()
        with self.exchange("PP broadcast of the sampled tokens from the last stage (receive)"):
            got, every = self.pp_handler.take_oldest()
        self._apply(got, last_sampled, all_token_ids)
        return every

    @staticmethod
    def _apply(got: Any, last_sampled: torch.Tensor, all_token_ids: torch.Tensor) -> None:
        """A received step's tokens into the rows that still hold their request (None: no row does)."""
        if got is None:
            return
        got.write_into(last_sampled)
        keep = got.positions < all_token_ids.shape[1]  # a request at max_model_len has no slot for its token
        if keep.any():
            rows = torch.from_numpy(got.rows[keep]).to(all_token_ids.device)
            cols = torch.from_numpy(got.positions[keep]).to(all_token_ids.device)
            all_token_ids.index_put_((rows, cols), got.tokens[torch.from_numpy(keep).to(got.tokens.device)]
                                     .to(all_token_ids.dtype))

    def _exchange_sampled(self, batch: InputBatch, produces: np.ndarray) -> None:
        """Last stage -> every stage, through the PPHandler; `positions` carry batch indices back."""
        handler = self.pp_handler
        assert handler is not None
        R, spec = batch.num_reqs, self.spec
        payload = None
        if self.is_last_stage:
            payload = spec.pp_payload(batch) if spec is not None else batch.sampled
        handler.post_sample(batch.idx_mapping_np[:R], batch.num_reqs_padded, sampled=payload, produces=produces,
                            positions=np.arange(R, dtype=np.int64))
        if self.is_last_stage:
            return
        for got in handler.consume():
            index = torch.from_numpy(got.positions).to(batch.sampled.device)
            if spec is not None:
                spec.pp_apply(batch, index, got.tokens)
            else:
                batch.sampled.index_copy_(0, index, got.tokens.to(batch.sampled.dtype))


def check_context_parallel(groups: ParallelGroups, spec: SpeculativeStep | None) -> None:
    """Refuse the context-parallel combinations the step does not run (ValueError naming them)."""
    pcp, dcp = groups.pcp_size, groups.dcp_size
    if pcp > 1 and dcp > 1:
        raise ValueError(f"prefill_context_parallel_size={pcp} with decode_context_parallel_size={dcp}: "
                         "use one kind of context parallelism at a time")
    if dcp > 1 and spec is not None and spec.drafter is not None:
        raise ValueError(f"decode_context_parallel_size={dcp} with a draft model: the drafter's KV is not "
                         "sharded; use method 'ngram' or DCP 1")
    if pcp > 1 and groups.pp_size > 1:
        raise ValueError(f"prefill_context_parallel_size={pcp} with pipeline_parallel_size={groups.pp_size}: "
                         "PCP runs with PP of 1 only")
    if pcp > 1 and spec is not None and spec.drafter is not None:
        raise ValueError(f"prefill_context_parallel_size={pcp} with a draft model: the drafter's catch-up prefill "
                         "is not split over the PCP group; use method 'ngram' or PCP 1")


def dp_split(items: list, dp_rank: int, dp_size: int) -> list[int]:
    """Indices of `items` DP rank `dp_rank` serves: round robin, so every replica gets
    the same count +-1 whatever the order."""
    return list(np.arange(dp_rank, len(items), dp_size))


__all__ = ["CollectiveError", "ParallelHooks", "check_context_parallel", "dp_split"]
