"""Constrained decode steps in two graphs: the forward at once, sampling when the masks arrive.

A structured-output step cannot sample before the engine has advanced each request's grammar
by the previous token and computed its next-token mask (on the host: ~0.7 ms for 64 JSON
requests of a 152k vocabulary). Run as one graph, the step waits for those masks and the
forward waits with it. Split, the forward graph (`forward_part`: inputs, layers, final hidden
states into a persistent buffer) replays from `execute_model`, so the GPU computes the layers
while the host computes the masks; `sample_tokens(grammar_output)` uploads the masks and
replays the sampling graph (`sample_part`: logits, masks applied in place, the greedy or
sampled variant, post-update).

Which steps: FULL uniform single-token decode descriptors of a single-stage runner without
speculation or context parallelism, for batches whose only features beyond greedy / plain
sampling are token masks (allowed ids, grammars: `SamplingStates.features_after_masks`). Any
other constrained step runs whole after its masks, as before. The pairs are captured at
start-up when the runner is built with `CompilationConfig.structured_output_graphs`
(the reference engine turns it on when it can compile grammars): one forward graph per
decode descriptor and two small sampling graphs.
"""

from __future__ import annotations

import torch

from capture.descriptor import BatchExecutionDescriptor
from graphrunner.sample.bitmask import apply_bitmasks_inplace
from graphrunner.state.features import SamplingFeatures
from graphrunner.step.body import StepBody
from graphrunner.step.inputs import InputBatch

__all__ = ["SplitStep"]


class SplitStep:
    """The two halves of a constrained decode step, over one persistent hidden-state buffer."""

    def __init__(self, body: StepBody) -> None:
        self.body = body
        self.hidden: torch.Tensor | None = None  # [max_num_reqs, H] model dtype: the forward's last hidden states

    def serves(self, desc: BatchExecutionDescriptor) -> bool:
        """Whether this runner's steps of `desc` can be split (see the module docstring)."""
        body = self.body
        # Single-stage only: the forward graph replays from execute_model, before the runner's
        # `PipelineStage.receive` (run in `ModelRunner._run`), which is where a PP stage's inputs arrive (the
        # previous stage's hidden states; a pipelined stage's due input tokens). Every PP stage is excluded
        # (the last one receives): tests/distributed/test_dist_pp_structured.py.
        single_stage = body.is_last_stage and body.buffers.stage.hidden_in is None
        return (desc.is_full and desc.uniform_token_count == 1 and single_stage and body.spec is None
                and body.pcp is None)

    def forward_part(self, batch: InputBatch) -> None:
        """Inputs and layers; the hidden states land in `self.hidden` (graph A)."""
        body = self.body
        body.prepare_inputs(batch)
        out = body.forward(batch)  # [T_pad, H]
        if self.hidden is None or self.hidden.shape[0] < out.shape[0]:  # first (warm-up) run: outside any graph
            rows = max(out.shape[0], body.limits.max_num_reqs)
            self.hidden = torch.empty(rows, out.shape[1], dtype=out.dtype, device=out.device)
        self.hidden[: out.shape[0]].copy_(out)

    def sample_part(self, batch: InputBatch, features: SamplingFeatures) -> None:
        """Logits, token masks in place, the sampler's greedy or sampled path, post-update (graph B)."""
        body = self.body
        assert self.hidden is not None, "forward_part runs first"
        assert not features.wants_logprobs, "the masks overwrite the raw logits that logprobs need"
        logits = body.model.compute_logits(self.hidden[batch.logits_indices])  # [R_pad, V] float32
        states = body.sampler.states
        assert states.allowed_mask is not None and states.grammar_mask is not None
        apply_bitmasks_inplace(logits, batch.idx_mapping, None, states.use_allowed, states.allowed_mask,
                               states.use_grammar, states.grammar_mask)
        body.sampler(logits, batch.idx_mapping, batch.seq_lens, features, out=batch.sampled)
        body.post_update(batch)
