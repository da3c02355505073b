"""What a step hands back: the pending step, its device-to-host copies, ModelRunnerOutput.

`execute_model` leaves a `PendingStep`; `sample_tokens` turns it into the engine's
result, either at once (one blocking D2H copy) or as an `AsyncOutput` whose copies run
on the output copy stream. A steady decode batch copies the same tensor prefixes step
after step, so its `OutputLayout` is resolved once and kept in the decode plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from capture.descriptor import BatchExecutionDescriptor
from capture.full import FullGraph
from graphrunner.async_output import AsyncOutput, OutputLayout, OutputRing
from graphrunner.protocol import DraftTokenIds, ModelRunnerOutput
from graphrunner.sample.logprobs import logprob_dicts
from graphrunner.spec_decode.step import SpecBuffers, VerifyRecord
from graphrunner.state.requests import RequestState
from graphrunner.state.sampling import SamplingStates
from graphrunner.step.buffers import LogprobBuffers
from graphrunner.step.inputs import InputBatch
from graphrunner.step.plan import DecodePlan


@dataclass
class PendingStep:
    """What `execute_model` leaves for `sample_tokens`."""

    batch: InputBatch
    descriptor: BatchExecutionDescriptor
    produces_token: np.ndarray  # [num_reqs] bool: the chunk reached the end of the known tokens
    all_produce: bool  # produces_token.all(), computed once
    # Requests whose prompt logprobs completed in this step: req_id -> vLLM's PromptLogprobs.
    prompt_logprobs: dict[str, list] | None = None
    plan: DecodePlan | None = None  # the decode plan the step ran from (its layout and index)
    verify: VerifyRecord | None = None  # speculative decoding: the entries that verified drafts


@dataclass
class DeferredStep:
    """A structured-output step waiting for its grammar masks: `sample_tokens` runs the rest.
    `sampling_graph`: the sampling half of a split step whose forward already ran, else None."""

    batch: InputBatch
    descriptor: BatchExecutionDescriptor
    plan: DecodePlan | None
    sampling_graph: FullGraph | None


class StepOutputs:
    """Builds each step's `ModelRunnerOutput`, synchronously or through the output ring."""

    def __init__(self, ring: OutputRing, logprobs: LogprobBuffers, sampling: SamplingStates, max_num_reqs: int,
                 requests: RequestState, spec: SpecBuffers | None = None):
        self.ring = ring
        self.logprobs = logprobs
        self.sampling = sampling
        self.max_num_reqs = max_num_reqs
        self.requests = requests
        self.spec = spec  # speculative decoding: k + 1 token slots per entry, and the drafts
        self.slots = spec.tokens.shape[1] if spec is not None else 1
        self.drafts: DraftTokenIds | None = None  # the last built step's proposals

    def collect(self, pending: PendingStep, async_output: bool) -> ModelRunnerOutput | AsyncOutput:
        plan = pending.plan
        if plan is not None:
            # Steady decoding: the same output tensors every step, their copies resolved once.
            if plan.output_layout is None:
                plan.output_layout = self.layout(pending.batch)
            layout = plan.output_layout
        else:
            layout = self.layout(pending.batch)
        if async_output:
            return self.ring.launch_layout(layout, partial(self.build, pending))
        return self.build(pending, layout.tensors)

    def layout(self, batch: InputBatch) -> OutputLayout:
        """What a step copies to the host: its sampled tokens (and the logprob rows it asked for)."""
        R, cap, S = batch.num_reqs, self.max_num_reqs, self.slots
        spec = self.spec
        if spec is None:
            device_outputs = {"sampled": batch.sampled[:R]}  # [R] int32
        else:
            device_outputs = {
                "tokens": spec.tokens[:R], "num_accepted": spec.num_accepted[:R],  # [R, k + 1], [R] int32
                "proposed": spec.proposed[:R], "num_proposed": spec.num_proposed[:R],  # [R, k], [R] int32
            }
        capacity = dict.fromkeys(device_outputs, cap)
        if batch.sampling_features.wants_logprobs:
            # Whole rows (contiguous: one raw copy each); the host keeps the asked-for columns.
            lp = self.logprobs
            device_outputs["logprob_values"] = lp.values[: R * S]  # [R * S, K_all+1] float32
            device_outputs["logprob_token_ids"] = lp.token_ids[: R * S]  # [R * S, K_all+1] int32
            device_outputs["logprob_ranks"] = lp.ranks[: R * S]  # [R * S] int32
            capacity.update(logprob_values=cap * S, logprob_token_ids=cap * S, logprob_ranks=cap * S)
        return self.ring.layout(device_outputs, capacity)

    def build(self, pending: PendingStep, outputs: dict[str, torch.Tensor]) -> ModelRunnerOutput:
        """Host-side result of a step from its (host or device) output tensors."""
        if self.spec is not None:
            return self._build_speculative(pending, outputs)
        tokens = outputs["sampled"]
        if tokens.device.type != "cpu":
            tokens = tokens.cpu()  # the synchronous path: one blocking D2H copy
        tokens_np = tokens.numpy().copy()  # [R] int32; a copy: the host slot is reused
        index_source = pending.plan.req_id_to_index if pending.plan is not None else None
        return ModelRunnerOutput.from_token_array(
            list(pending.batch.req_ids), tokens_np, None if pending.all_produce else pending.produces_token.copy(),
            index_source, logprobs=self._sampled_logprobs(pending, outputs),
            prompt_logprobs_dict=pending.prompt_logprobs or {},
        )

    def _build_speculative(self, pending: PendingStep, outputs: dict[str, torch.Tensor]) -> ModelRunnerOutput:
        """k + 1 token slots per entry: entry i emitted its accepted drafts and one more token."""
        host = {name: (t if t.device.type == "cpu" else t.cpu()).numpy().copy() for name, t in outputs.items()}
        accepted = host["num_accepted"]  # [R] int32
        if pending.verify is not None:  # the host mirrors give back the rejected slots
            pending.verify.settle(accepted, self.requests)
        counts = np.where(pending.produces_token, accepted + 1, 0)  # [R] tokens emitted
        batch = pending.batch
        proposed, num_proposed = host["proposed"], host["num_proposed"]
        self.drafts = DraftTokenIds(list(batch.req_ids),
                                    [row[:n] for row, n in zip(proposed.tolist(), num_proposed.tolist(), strict=True)])
        index_source = pending.plan.req_id_to_index if pending.plan is not None else None
        return ModelRunnerOutput.from_token_rows(
            list(batch.req_ids), host["tokens"], counts, index_source,
            logprobs=self._sampled_logprobs(pending, outputs, counts),
            prompt_logprobs_dict=pending.prompt_logprobs or {},
        )

    def _sampled_logprobs(self, pending: PendingStep, outputs: dict[str, torch.Tensor],
                          counts: np.ndarray | None = None) -> list | None:
        """Per batch entry: one {token: Logprob} per emitted token (the token first, then the
        request's top-k), [] where it sampled nothing or asked for none; None when no entry
        asked. counts: [R] tokens emitted per entry (None: 1 where the entry produced)."""
        if "logprob_values" not in outputs:
            return None
        batch, S = pending.batch, self.slots
        if counts is None:
            counts = pending.produces_token.astype(np.int64)
        cols = batch.sampling_features.num_logprobs + 1
        host = {name: t.cpu().numpy() for name, t in outputs.items() if name.startswith("logprob")}
        wanted = self.sampling.logprobs_of(batch.idx_mapping_np)  # [R] K per entry, -1 = none
        dicts = logprob_dicts(host["logprob_values"][:, :cols], host["logprob_token_ids"][:, :cols],
                              host["logprob_ranks"])  # [R * S]
        return [[] if k < 0 else [_top_k(dicts[i * S + j], k) for j in range(n)]
                for i, (k, n) in enumerate(zip(wanted.tolist(), counts.tolist(), strict=True))]


def _top_k(d: dict, k: int) -> dict:
    """Column 0 (the sampled token) first, then the request's own top-k."""
    items = list(d.items())
    keep = dict(items[:1])
    for tok, lp in items[1:]:
        if lp.rank is not None and lp.rank <= k:
            keep.setdefault(tok, lp)
    return keep
