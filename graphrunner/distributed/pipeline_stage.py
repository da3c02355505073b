"""PipelineStage: what one pipeline-parallel stage does around each step, outside the graphs.

The runner holds one when `pipeline_parallel_size > 1` and calls it at two fixed points of
the step: `receive` before the forward, `send` after it (plus `output` when the engine takes
a pipelined step's result). The TP ranks and PP stages of one DP replica run the same
deterministic scheduler over the same requests and dispatch table, so they derive the same
descriptor for every step without communicating.

* Before the forward (non-first stages): receive the previous stage's hidden states and
  residual into persistent [max_num_tokens, hidden] buffers, `[:num_tokens_padded]`. The
  forward (eager, compiled pieces or FULL graph) reads those buffers; a non-last stage's
  step body copies its (hidden, residual) into persistent output buffers.
* After the forward: those outputs go to the next stage by non-blocking send; the last
  stage broadcasts the step's sampled tokens through the `PPHandler` (a sibling PP
  communicator, async work / side stream). Pipelined (the default without speculation): a
  non-last stage queues the receive and runs `post_update` at once (counts advance; the rows
  that sampled get placeholder tokens); the tokens are applied when the engine takes the
  step's output (`take_tokens`, in step order, rows that changed hands since skipped by the
  generation counters). The engine keeps up to P batches of disjoint requests in flight, so a
  request's placeholder is overwritten before it runs again, and stage 0 runs batch T + 1
  while the last stage runs batch T. With speculative decoding (a [rows, 2k + 4] outcome per
  step) the non-last stages consume the broadcast in the same step (depth 0), write it into
  their buffers and run `post_update` then.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from graphrunner.distributed.groups import ParallelGroups
from graphrunner.distributed.pp_handler import PPHandler
from graphrunner.step.buffers import StageBuffers
from graphrunner.step.inputs import InputBatch


class PipelineStage:
    """This rank's stage of the pipeline: hidden-state P2P and the sampled-token broadcast."""

    def __init__(self, groups: ParallelGroups, *, max_num_reqs: int, num_rows: int, device: torch.device,
                 spec: Any = None) -> None:
        self.groups = groups
        self.device = device
        self.pp = groups.pp
        self.is_first_stage = groups.pp.is_first
        self.is_last_stage = groups.pp.is_last
        self.stage = StageBuffers()  # [max_T, hidden] PP buffers (allocate_buffers)
        self._sends: list[Any] = []  # the last step's hidden-state sends (dist.Work), waited at the next
        # Pipelined PP (no speculation): a non-last stage applies a step's tokens when its output
        # is taken, not in the step, so it can run the next batches meanwhile (module docstring).
        self.defers_tokens = spec is None and not self.is_last_stage
        self._taken: deque[Any] = deque()  # StepTokens applied early (`receive`), for their outputs
        self.handler: PPHandler | None = PPHandler(
            groups.pp_broadcast_group, max_num_reqs, device, depth=groups.pp_size if spec is None else 0,
            num_rows=num_rows, timeout_s=groups.config.collective_timeout_s,
            width=spec.pp_width if spec is not None else 1,
        )
        self.spec = spec  # speculative decoding: rows of emitted tokens, counts and drafts go round

    def allocate_buffers(self, max_num_tokens: int, hidden_size: int, dtype: torch.dtype) -> StageBuffers:
        """Persistent PP buffers of the largest step (graphs capture their addresses)."""
        self.stage = StageBuffers.allocate(max_num_tokens, hidden_size, dtype, self.device,
                                           receives=not self.is_first_stage, sends=not self.is_last_stage)
        return self.stage

    def rows_freed(self, rows: list[int]) -> None:
        """Request rows changed hands: receives queued for them must not be applied."""
        if self.handler is not None:
            for row in rows:
                self.handler.generations.bump(row)

    def close(self) -> None:
        """Finish in-flight sends and broadcasts (before the groups are destroyed)."""
        self._finish_sends()
        if self.handler is not None:
            self.handler.close()
            self.handler = None

    def _finish_sends(self) -> None:
        sends, self._sends = self._sends, []
        if sends:
            with self.groups.exchange(f"PP send of the previous step's hidden states to rank {self.pp.next_rank}"):
                for work in sends:
                    work.wait()

    # ---- per step ---------------------------------------------------------------------
    def receive(self, batch: InputBatch, requests: Any = None) -> None:
        """Before the forward. Non-first stages: receive the previous stage's output for this step.
        Non-last stages first finish the previous step's sends (this step rewrites their buffers),
        then apply the broadcast tokens this step's requests still wait for (`requests`: the
        runner's request states; None for a dummy step). Those come from a step at least P steps
        old (the scheduler's pipeline rule), so on CUDA the stream waits on a broadcast that has
        normally landed, and the host never waits for a token before a launch."""
        self._finish_sends()
        if self.defers_tokens and requests is not None:
            assert self.handler is not None
            with self.groups.exchange("PP broadcast of the sampled tokens from the last stage (receive)"):
                for got, every in self.handler.take_for(batch.idx_mapping_np[: batch.num_reqs]):
                    self._apply(got, requests.last_sampled, requests.all_token_ids)
                    self._taken.append(every)
        stage = self.stage
        if stage.hidden_in is None or stage.residual_in is None:
            return
        num_tokens_padded = batch.num_tokens_padded
        src, group = self.pp.prev_rank, self.pp.device_group
        with self.groups.exchange(f"PP receive of the step's hidden states from rank {src}"):
            dist.recv(stage.hidden_in[:num_tokens_padded], src=src, group=group)
            dist.recv(stage.residual_in[:num_tokens_padded], src=src, group=group)
            aux = self._aux_hidden()
            if aux is not None:  # EAGLE-3: the feature layers of the stages before, for the last one's drafter
                dist.recv(aux[:num_tokens_padded], src=src, group=group)

    def _aux_hidden(self) -> torch.Tensor | None:
        return self.spec.buffers.aux_hidden if self.spec is not None else None

    def send(self, batch: InputBatch, produces: np.ndarray | None, post_update: Callable[[InputBatch], None],
             positions: np.ndarray | None = None) -> None:
        """After the forward: send the stage output on; exchange the sampled tokens; finish
        non-last stages' state.

        produces: [R] bool, which requests sample a token this step; None for a dummy
        step (scratch rows only: no token exchange, every stage skips it alike).
        positions: [R] where each entry's token goes in its history (deferred stages).
        """
        Tp = batch.num_tokens_padded
        stage = self.stage
        if stage.hidden_out is not None and stage.residual_out is not None:
            dst, group = self.pp.next_rank, self.pp.device_group
            with self.groups.exchange(f"PP send of the step's hidden states to rank {dst}"):
                # Non-blocking: waited for when the buffers are next rewritten (`receive`),
                # so the host goes on to the next batch while the hidden states travel.
                self._sends = [dist.isend(stage.hidden_out[:Tp], dst=dst, group=group),
                               dist.isend(stage.residual_out[:Tp], dst=dst, group=group)]
                aux = self._aux_hidden()
                if aux is not None:
                    self._sends.append(dist.isend(aux[:Tp], dst=dst, group=group))
        if produces is not None:
            assert self.handler is not None
            with self.groups.exchange("PP broadcast of the sampled tokens from the last stage"):
                if self.defers_tokens:  # queue the receive; the tokens are applied by `take_tokens`
                    self.handler.post_sample(batch.idx_mapping_np[: batch.num_reqs], batch.num_reqs_padded,
                                             produces=produces, positions=positions)
                else:
                    self._exchange_sampled(batch, produces)
        if not self.is_last_stage:
            # Deferred: the counts advance now; the rows that sampled get placeholder tokens, which
            # `take_tokens` overwrites before the scheduler can run those requests again.
            post_update(batch)

    def output(self, pending: Any, build: Callable[[Any, dict], Any], requests: Any, async_output: bool) -> Any:
        """A non-last stage's output of a pipelined step: its tokens are taken from the last
        stage's broadcast when the output is resolved (at once, or on `AsyncOutput.get()`)."""
        from graphrunner.step.output import AsyncOutput

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
        if self._taken:  # applied before a later step's forward (`receive`): older than any queued
            return self._taken.popleft()
        assert self.handler is not None
        with self.groups.exchange("PP broadcast of the sampled tokens from the last stage (receive)"):
            got, every = self.handler.take_oldest()
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
        handler = self.handler
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


__all__ = ["PipelineStage"]
