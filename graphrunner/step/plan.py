"""StepPlanner: the host side of a step between validation and the run.

It orders the batch decode-first, asks the dispatch table for the step's descriptor
(agreed across DP replicas), uploads the two per-step host arrays (idx_mapping and
query_start_loc) and returns the batch's views; after the run it advances the host
mirrors of the request counters and says which requests produced a token.

Steady decoding schedules the same requests in the same order step after step. The
planner keeps the last uniform-decode step's layout (`DecodePlan`); while it stays
valid, the next such step reuses the order, rows, descriptor, graph and views and skips
the upload. That is a shortcut inside this one path, not a second path: every step
goes through `reusable_plan` -> validation -> `prepare` -> run -> `advance`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from capture.descriptor import BatchExecutionDescriptor
from capture.full import FullGraph
from capture.modes import CUDAGraphMode
from graphrunner.limits import StepLimits
from graphrunner.protocol import SchedulerOutput
from graphrunner.spec_decode.step import VerifyRecord
from graphrunner.state.store import StateStore
from graphrunner.state.validation import DecodeHint
from graphrunner.step.graphs import StepGraphs
from graphrunner.step.inputs import InputBatch, InputBuffers
from graphrunner.step.output import OutputLayout

# (num_reqs, num_tokens, uniform query length | None, force_eager) -> the step's descriptor
Dispatch = Callable[[int, int, "int | None", bool], BatchExecutionDescriptor]


@dataclass
class DecodePlan:
    """A uniform-decode step's host-side layout, reused while it stays valid.

    Valid while no request is admitted or removed (`epoch`), the graphs are unchanged
    (`graphs_key`), and — for skipping the upload — the device buffer still holds upload
    number `upload_version`.
    """

    req_ids: list[str]  # batch order == scheduler order (all query lengths equal)
    hint: DecodeHint  # rows, per-row token limits, all-decode flag (validation)
    idx_mapping: np.ndarray  # [R] int32
    query_lens: np.ndarray  # [R] int32, all == q
    desc: BatchExecutionDescriptor
    batch: InputBatch
    epoch: int
    graphs_key: tuple[int, int, bool]
    upload_version: int
    req_id_to_index: dict[str, int]
    all_produce: np.ndarray  # [R] bool, all True: what every all-decode step samples
    rows_index: slice | np.ndarray  # idx_mapping as a slice where its rows are consecutive
    full_graph: FullGraph | None  # what replays the step (desc FULL), looked up once
    output_layout: OutputLayout | None = None  # the step's D2H copies, resolved on first use


def as_slice(rows: np.ndarray) -> slice | np.ndarray:
    """`rows` as a slice when they are consecutive ascending (a basic-index update is
    several times cheaper than a fancy-index one), else `rows` itself."""
    n = len(rows)
    if n and int(rows[-1]) - int(rows[0]) == n - 1 and (n == 1 or bool((np.diff(rows) == 1).all())):
        return slice(int(rows[0]), int(rows[0]) + n)
    return rows


class StepPlanner:
    """Order, dispatch and upload of each step; the steady-decode plan cache."""

    def __init__(self, state: StateStore, inputs: InputBuffers, graphs: StepGraphs, limits: StepLimits,
                 dispatch: Dispatch, reuse_plans: bool, pcp: Any = None, lora: Any = None) -> None:
        self.state = state
        self.lora = lora  # layers.lora.manager.LoraManager with LoRA on, else None
        self._lora_keys = 0  # numbers each LoRA batch's metadata upload
        self.pcp = pcp  # prefill context parallelism (distributed.pcp_step), None without it
        self.inputs = inputs
        self.graphs = graphs
        self.limits = limits
        self.dispatch = dispatch  # graphs.dispatch, or its DP-agreed form
        self.reuse_plans = reuse_plans  # False under DP: replicas agree on each step's descriptor anew
        self.plan: DecodePlan | None = None  # the last uniform-decode step's layout

    def _graphs_key(self) -> tuple[int, int, bool]:
        g = self.graphs
        return id(g), g.generation, g.captured

    def reusable_plan(self, so: SchedulerOutput, prompt_logprobs_active: bool) -> DecodePlan | None:
        """The last decode plan if `so` schedules exactly its requests, in its order, as decodes."""
        plan = self.plan
        if plan is None or so.scheduled_new_reqs or so.finished_req_ids or so.preempted_req_ids:
            return None
        if so.scheduled_spec_decode_tokens:  # validated and applied in full (drafts may be staged)
            return None
        if prompt_logprobs_active:  # such steps must not take a FULL graph (see prepare)
            return None
        if plan.epoch != self.state.requests.epoch or plan.graphs_key != self._graphs_key():
            return None
        nst = so.num_scheduled_tokens
        if len(nst) != len(plan.req_ids) or so.scheduled_cached_reqs.req_ids != plan.req_ids:
            return None
        if list(nst) != plan.req_ids:
            return None
        q = self.limits.uniform_decode_query_len
        if so.total_num_scheduled_tokens != q * len(nst) or list(nst.values()).count(q) != len(nst):
            return None
        return plan

    def refresh_limits(self, plan: DecodePlan) -> None:
        """New KV blocks arrived for the plan's rows: their token limits changed."""
        plan.hint.set_limit(self.state.token_limits(plan.hint.rows, self.limits))

    # ---- before the run ---------------------------------------------------------------
    def prepare(self, so: SchedulerOutput, plan: DecodePlan | None,
                needs_eager: Callable[[list[str]], bool]) -> tuple[InputBatch, BatchExecutionDescriptor]:
        """Order decode-first, dispatch, upload idx_mapping and query_start_loc, return the views."""
        if plan is not None:
            batch = plan.batch
            if plan.upload_version != self.inputs.version:  # another layout was uploaded since
                self.inputs.upload(plan.idx_mapping, plan.query_lens, batch.num_reqs_padded,
                                   self.state.requests.scratch_row)
                plan.upload_version = self.inputs.version
            if plan.full_graph is None:  # eager and piecewise attention size their work by it
                computed = self.state.requests.num_computed_np
                q = self.limits.uniform_decode_query_len
                batch.attn_metadata.max_seq_len = int(computed[plan.idx_mapping].max()) + q
            if batch.has_lora:  # re-uploaded only if another batch's metadata or a slot load came since
                self.lora.prepare(batch.lora_key, plan.req_ids, plan.query_lens, batch.num_tokens_padded)
            return batch, plan.desc
        req_ids, idx_mapping, query_lens = self._order(so)
        num_reqs, num_tokens = len(req_ids), int(query_lens.sum())
        q = self.limits.uniform_decode_query_len
        uniform = q if num_tokens == num_reqs * q and bool((query_lens == q).all()) else None
        # Prompt logprobs read every position's hidden state, which no graph keeps: eager.
        eager = needs_eager(req_ids)
        if eager:
            uniform = None  # and no decode plan
        requests = self.state.requests
        # PCP: a step with a prefill runs T_local tokens per rank; dispatch by those.
        part = self.pcp.partition(query_lens, requests.num_computed_np[idx_mapping]) if self.pcp else None
        lora = self.lora
        has_lora = lora is not None and lora.has_adapters(req_ids)
        if has_lora:  # only LoRA graphs serve it (LoRA refuses PCP)
            desc = self.dispatch(num_reqs, num_tokens, uniform, eager, True)  # type: ignore[call-arg]
        else:
            desc = self.dispatch(num_reqs, num_tokens if part is None else part.num_local_tokens, uniform, eager)
        if part is not None and desc.is_full:  # split steps: PIECEWISE or eager (pcp_step docstring)
            desc = BatchExecutionDescriptor(CUDAGraphMode.NONE, part.num_local_tokens, num_reqs)
        # FULL pads tokens and requests; PIECEWISE tokens only; NONE nothing (docs/architecture.md §4).
        num_reqs_padded = desc.num_reqs if desc.is_full and desc.num_reqs is not None else num_reqs
        self.inputs.upload(idx_mapping, query_lens, num_reqs_padded, requests.scratch_row)
        max_seq_len = int((requests.num_computed_np[idx_mapping] + query_lens).max())
        batch = InputBatch.from_buffers(
            self.inputs, req_ids, idx_mapping, query_lens, num_reqs_padded,
            desc.num_tokens if part is None else num_tokens, self.state.sampling.features(idx_mapping), max_seq_len,
        )
        if part is not None:
            self.pcp.bind(batch, part, desc.num_tokens)
        if has_lora:
            self._lora_keys += 1
            batch.has_lora, batch.lora_key = True, self._lora_keys
            lora.prepare(batch.lora_key, req_ids, query_lens, batch.num_tokens_padded)
        self.plan = self._new_plan(req_ids, idx_mapping, query_lens, desc, batch) if uniform is not None else None
        return batch, desc

    def _order(self, so: SchedulerOutput) -> tuple[list[str], np.ndarray, np.ndarray]:
        """Stable sort on query length: decodes (q tokens) first, then prefill chunks."""
        nst = so.num_scheduled_tokens
        keys = list(nst)
        lens = np.fromiter(nst.values(), dtype=np.int32, count=len(keys))
        if len(lens) > 1 and bool((lens[1:] < lens[:-1]).any()):
            order = np.argsort(lens, kind="stable")
            req_ids, query_lens = [keys[i] for i in order.tolist()], lens[order]
        else:
            req_ids, query_lens = keys, lens
        index = self.state.requests.req_id_to_index
        idx_mapping = np.fromiter(map(index.__getitem__, req_ids), dtype=np.int32, count=len(req_ids))
        return req_ids, idx_mapping, query_lens

    def _new_plan(self, req_ids: list[str], idx_mapping: np.ndarray, query_lens: np.ndarray,
                  desc: BatchExecutionDescriptor, batch: InputBatch) -> DecodePlan | None:
        if not self.reuse_plans:
            return None
        rows = idx_mapping.astype(np.int64)
        rows_index = as_slice(idx_mapping)
        limits = self.state.token_limits(rows, self.limits)
        hint = DecodeHint(rows, limits, all_decode=False,
                          rows_index=rows_index if isinstance(rows_index, slice) else None)
        return DecodePlan(
            req_ids=req_ids, hint=hint, idx_mapping=idx_mapping, query_lens=query_lens, desc=desc, batch=batch,
            epoch=self.state.requests.epoch, graphs_key=self._graphs_key(), upload_version=self.inputs.version,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            all_produce=np.ones(len(req_ids), dtype=bool), rows_index=rows_index,
            full_graph=self.graphs.full_graph(desc, batch.sampling_features) if desc.is_full else None,
        )

    # ---- after the run -----------------------------------------------------------------
    def advance(self, batch: InputBatch, plan: DecodePlan | None) -> tuple[np.ndarray, bool, VerifyRecord | None]:
        """Advance the host mirrors by the step (by every scheduled token: a verifying entry
        gives its rejected slots back when its output is built). Returns ([R] bool produces a
        token, all of them do, the verifying entries or None)."""
        requests = self.state.requests
        verify = VerifyRecord.of(batch, requests) if self.limits.uniform_decode_query_len > 1 else None
        computed = requests.num_computed_np
        if plan is not None and plan.hint.all_decode:
            computed[plan.rows_index] += self.limits.uniform_decode_query_len  # rows are distinct
            return plan.all_produce, True, verify
        idx = batch.idx_mapping_np
        after = computed[idx] + batch.query_lens_np
        produces = after >= self.state.requests.prefill_len_np[idx]
        computed[idx] = after
        all_produce = bool(produces.all())
        if self.plan is not None and self.plan.batch is batch:
            # From the next step on, every row of the plan can only decode (or not yet).
            self.plan.hint.all_decode = all_produce
        return produces, all_produce, verify
