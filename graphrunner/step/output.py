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
from graphrunner.async_output import AsyncOutput, OutputLayout, OutputRing
from graphrunner.protocol import ModelRunnerOutput
from graphrunner.sample.logprobs import logprob_dicts
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


class StepOutputs:
    """Builds each step's `ModelRunnerOutput`, synchronously or through the output ring."""

    def __init__(self, ring: OutputRing, logprobs: LogprobBuffers, sampling: SamplingStates, max_num_reqs: int):
        self.ring = ring
        self.logprobs = logprobs
        self.sampling = sampling
        self.max_num_reqs = max_num_reqs

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
        R, cap = batch.num_reqs, self.max_num_reqs
        device_outputs = {"sampled": batch.sampled[:R]}  # [R] int32
        capacity = {"sampled": cap}
        if batch.sampling_features.wants_logprobs:
            # Whole rows (contiguous: one raw copy each); the host keeps the asked-for columns.
            lp = self.logprobs
            device_outputs["logprob_values"] = lp.values[:R]  # [R, K_all+1] float32
            device_outputs["logprob_token_ids"] = lp.token_ids[:R]  # [R, K_all+1] int32
            device_outputs["logprob_ranks"] = lp.ranks[:R]  # [R] int32
            capacity.update(logprob_values=cap, logprob_token_ids=cap, logprob_ranks=cap)
        return self.ring.layout(device_outputs, capacity)

    def build(self, pending: PendingStep, outputs: dict[str, torch.Tensor]) -> ModelRunnerOutput:
        """Host-side result of a step from its (host or device) output tensors."""
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

    def _sampled_logprobs(self, pending: PendingStep, outputs: dict[str, torch.Tensor]) -> list | None:
        """Per batch entry: [ {token: Logprob} ] for its sampled token (K+1 entries at most),
        [] where it sampled nothing or asked for none; None when no entry asked."""
        if "logprob_values" not in outputs:
            return None
        batch = pending.batch
        cols = batch.sampling_features.num_logprobs + 1
        host = {name: t.cpu().numpy() for name, t in outputs.items() if name.startswith("logprob")}
        wanted = self.sampling.logprobs_of(batch.idx_mapping_np)  # [R] K per entry, -1 = none
        dicts = logprob_dicts(host["logprob_values"][:, :cols], host["logprob_token_ids"][:, :cols],
                              host["logprob_ranks"])
        result: list[list] = []
        for i, (d, k) in enumerate(zip(dicts, wanted.tolist(), strict=True)):
            if k < 0 or not pending.produces_token[i]:
                result.append([])
                continue
            # Column 0 (the sampled token) first, then the request's own top-k.
            items = list(d.items())
            keep = dict(items[:1])
            for tok, lp in items[1:]:
                if lp.rank is not None and lp.rank <= k:
                    keep.setdefault(tok, lp)
            result.append([keep])
        return result
