"""StepBody: the one function of a step on the device.

    prepare inputs -> forward -> logits -> sample -> post-update

Everything after the per-step upload, over views of the persistent buffers, with no
host sync. The same code runs eagerly, is captured into FULL graphs, and (with the
forward swapped for the compiled pieces) runs as PIECEWISE graphs: there is no second
implementation of a step. A non-last pipeline stage stops after its layers and leaves
(hidden, residual) in the stage's output buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from graphrunner.attention.op import forward_context
from graphrunner.kernels import use_triton
from graphrunner.kernels.dcp import dcp_slot_mapping
from graphrunner.kernels.input_prep import (
    compute_logits_indices,
    compute_slot_mapping,
    post_update,
    prepare_input_ids,
    prepare_positions_seq_lens,
)
from graphrunner.limits import StepLimits
from graphrunner.sample.fused_process import refresh_counts
from graphrunner.sample.logprobs import PromptLogprobs
from graphrunner.sample.sampler import Sampler
from graphrunner.spec_decode.step import SpeculativeStep
from graphrunner.state.block_tables import BlockTables
from graphrunner.state.features import SamplingFeatures
from graphrunner.step.buffers import StepBuffers
from graphrunner.step.inputs import InputBatch


class StepBody:
    """Runs a prepared `InputBatch` on the device (see the module docstring).

    `model` is set by `load_model`; `compiled` (capture.piecewise.PiecewiseCompiled) once
    a graph mode needs the compiled model.
    """

    def __init__(self, buffers: StepBuffers, limits: StepLimits, sampler: Sampler, attn_backend: Any,
                 prompt_logprobs: PromptLogprobs, is_last_stage: bool = True,
                 spec: SpeculativeStep | None = None, pcp: Any = None,
                 dcp: tuple[int, int, int] | None = None) -> None:
        self.buffers = buffers
        self.dcp = dcp  # decode context parallelism: (size, rank, interleave) of this rank's KV share
        self.pcp = pcp  # prefill context parallelism (distributed.pcp_step), None without it
        self.spec = spec  # speculative decoding: verification and drafting inside the step
        self.limits = limits
        self.sampler = sampler
        self.attn_backend = attn_backend
        self.prompt_logprobs = prompt_logprobs
        self.is_last_stage = is_last_stage
        self.model: Any = None  # torch.nn.Module with compute_logits / attention_op_enabled
        self.compiled: Any = None  # PiecewiseCompiled, or None (eager modules only)
        self.current_batch: InputBatch | None = None  # the batch being run (debug invariant checks)
        # Lockstep DP with enable_dbo (step.microbatch.Microbatcher): an armed step's forward runs
        # as two microbatches on two streams; None without DBO.
        self.microbatch: Any = None
        # LoRA on: the slot metadata (whose `active` flag the projections read) and the compiled model
        # of the LoRA graphs (a second compile: its traces run the adapters, the plain ones none).
        self.lora = buffers.lora
        self.compiled_lora: Any = None

    @property
    def block_tables(self) -> BlockTables:
        tables = self.buffers.block_tables
        assert tables is not None, "initialize_kv_cache() before running a step"
        return tables

    def run(self, batch: InputBatch, piecewise: bool = False) -> None:
        """The step body: everything after the upload, on the device, no host sync."""
        self.prepare_inputs(batch)
        self.forward_and_sample(batch, piecewise)
        if self.is_last_stage:
            self.post_update(batch)
            if self.spec is not None:
                self.spec.propose(batch)  # the drafts the next step verifies

    def prepare_inputs(self, batch: InputBatch) -> None:
        s = self.buffers.requests
        prepare_positions_seq_lens(batch.idx_mapping, batch.query_start_loc, s.num_computed_tokens,
                                   batch.positions, batch.seq_lens)
        if self.spec is not None:
            self.spec.prepare(batch)  # drafts into the history, read below as input ids
        prepare_input_ids(batch.idx_mapping, batch.query_start_loc, batch.positions, s.all_token_ids,
                          s.prefill_len, s.last_sampled, batch.input_ids)
        self.block_tables.gather(batch.idx_mapping, batch.block_table)
        if self.dcp is None:
            compute_slot_mapping(batch.block_table, batch.query_start_loc, batch.positions, self.limits.block_size,
                                 batch.slot_mapping)
        else:  # this rank writes only its share (-1 elsewhere)
            dcp_slot_mapping(batch.block_table, batch.query_start_loc, batch.positions, self.limits.block_size,
                             self.dcp[2], self.dcp[0], self.dcp[1], batch.slot_mapping)
        if self.spec is None:
            compute_logits_indices(batch.query_start_loc, batch.logits_indices)
        if batch.pcp is not None:  # a PCP split step: this rank's rows of the global batch
            self.pcp.localize(batch)
        if self.buffers.mrope is not None:  # M-RoPE: staged prompt rows, position + delta elsewhere
            self.buffers.mrope.fill(batch)
        if self.buffers.embeds is not None:  # staged prompt / multimodal rows, token embeddings elsewhere
            self.buffers.embeds.merge(self.model, batch.input_ids)
        self.refresh_counts(batch)

    def refresh_counts(self, batch: InputBatch) -> None:
        """Rows admitted with penalties get their counts rebuilt from the history known at
        admission (positions < prefill_len), before this step samples or appends to them.
        Only the last stage samples, so only it keeps counts; a batch with such a row has
        penalties in its features (and so does the graph variant serving it)."""
        states = self.sampler.states
        if not (self.is_last_stage and batch.sampling_features.any_penalties) or states.counts is None:
            return
        assert states.all_token_ids is not None
        s = self.buffers.requests
        rows = batch.idx_mapping
        refresh_counts(states.counts, states.counts_stale, states.all_token_ids, rows, states.prompt_len,
                       s.prefill_len[rows.long()], clear=True, use_triton_kernel=use_triton(states.counts))

    def forward(self, batch: InputBatch, piecewise: bool = False, modules: bool = False) -> Any:
        """The model's layers for `batch`: hidden [T_pad, H] (or (hidden, residual) off the last stage).
        `modules`: the model's eager modules even when a compiled form exists."""
        assert self.model is not None, "load_model() before running a step"
        compiled = self.compiled
        if self.lora is not None:
            self.lora.active = batch.has_lora
            if batch.has_lora and compiled is not None:
                compiled = self.compiled_lora
        if modules:
            forward = self.model
        elif piecewise:
            forward = compiled
        elif compiled is not None:
            forward = compiled.run_compiled  # FULL graph bodies: fused kernels, no piece graphs
        else:
            forward = self.model
        args = self.model_args(batch)
        if not self.model.attention_op_enabled:
            return forward(*args)
        metadata = batch.attn_metadata if batch.pcp is None else batch.pcp.metadata
        # The attention op reads this step's metadata and caches from the context, so
        # that they are not inputs of the compiled pieces.
        with forward_context(metadata, self.buffers.kv_caches, self.attn_backend):
            return forward(*args)

    def forward_and_sample(self, batch: InputBatch, piecewise: bool = False) -> None:
        ub = self.microbatch
        out = ub.forward(self, batch) if ub is not None and ub.armed else self.forward(batch, piecewise)
        Tp = batch.num_tokens_padded
        if self.spec is not None:  # EAGLE: the target's features for the head (EAGLE-3: into their buffer)
            out = self.spec.take_features(out, Tp, self.is_last_stage)
        if not self.is_last_stage:  # PP: (hidden, residual) go on to the next stage
            stage = self.buffers.stage
            assert stage.hidden_out is not None and stage.residual_out is not None
            stage.hidden_out[:Tp].copy_(out[0])
            stage.residual_out[:Tp].copy_(out[1])
            return
        hidden = out if batch.pcp is None else self.pcp.restore(batch, out)  # [T_pad, H] in global order
        if self.prompt_logprobs.active:
            starts = self.buffers.requests.num_computed_np[batch.idx_mapping_np]  # host mirror, not yet advanced
            self.prompt_logprobs.collect(hidden, batch.req_ids, batch.query_lens_np, starts)
        lp = self.buffers.logprobs
        if self.spec is not None:
            self.spec.sample(hidden, batch, self.model.compute_logits, (lp.values, lp.token_ids, lp.ranks))
            return
        if batch.sampling_features.is_plain_greedy:  # argmax is the whole pipeline: no logits written
            self.model.greedy_tokens(hidden[batch.logits_indices], out=batch.sampled)
            return
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [R_pad, V] float32
        # The token being sampled sits at position seq_len: that keys its random noise.
        r_pad = batch.num_reqs_padded
        self.sampler(
            logits, batch.idx_mapping, batch.seq_lens, batch.sampling_features, out=batch.sampled,
            out_logprobs=lp.values[:r_pad], out_logprob_ids=lp.token_ids[:r_pad], out_ranks=lp.ranks[:r_pad],
        )

    def post_update(self, batch: InputBatch) -> None:
        """Advance request state by the step's sampled tokens (in the step body; on non-last
        PP stages after the tokens arrived from the last stage)."""
        s = self.buffers.requests
        rejected = self.spec.buffers.num_rejected[: batch.num_reqs_padded] if self.spec is not None else None
        # The penalty counts follow the history on the last stage (other stages append placeholders).
        counts = self.sampler.states.counts if self.is_last_stage else None
        post_update(batch.idx_mapping, batch.query_start_loc, batch.seq_lens, batch.sampled,
                    s.num_computed_tokens, s.prefill_len, s.last_sampled, s.all_token_ids, rejected,
                    token_counts=counts, max_new_tokens=1 + (self.spec.k if self.spec is not None else 0))

    def model_args(self, batch: InputBatch) -> tuple:
        """The model's forward arguments (plus the received stage inputs off the first stage)."""
        Tp = batch.num_tokens_padded
        positions = batch.positions if self.buffers.mrope is None else self.buffers.mrope.view(Tp)  # [T] / [T, 3]
        args: tuple = (batch.input_ids, positions, self.buffers.kv_caches, batch.attn_metadata)
        if batch.pcp is not None:  # a PCP split step runs this rank's rows
            p = batch.pcp
            Tp, args = p.num_local_padded, (p.input_ids, p.positions, self.buffers.kv_caches, p.metadata)
        stage = self.buffers.stage
        if stage.hidden_in is not None and stage.residual_in is not None:
            args += (stage.hidden_in[:Tp], stage.residual_in[:Tp])
        elif self.buffers.embeds is not None:  # the merged embeddings instead of the token table's
            args += (None, None, self.buffers.embeds.inputs_embeds[:Tp])
        return args

    @property
    def token_args(self) -> tuple[int, ...]:
        """Forward argument positions with a token dim 0 (for the piecewise compiler)."""
        if self.buffers.embeds is not None:
            return (0, 1, 6)
        return (0, 1) if self.buffers.stage.hidden_in is None else (0, 1, 4, 5)

    # ---- dummy batches: capture, profiling, idle DP replicas ------------------------------
    def dummy_batch(self, query_lens: np.ndarray, features: SamplingFeatures, num_reqs_padded: int,
                    num_tokens_padded: int) -> InputBatch:
        """Upload a batch whose every entry points at the scratch row; return its views.

        Graph batches carry static upper bounds in their host-side metadata ints, since
        a replay serves many batches (no backend may size work by them).
        """
        scratch = self.buffers.requests.scratch_row
        idx_mapping = np.full(len(query_lens), scratch, dtype=np.int32)
        self.buffers.inputs.upload(idx_mapping, query_lens, num_reqs_padded, scratch)
        batch = InputBatch.from_buffers(
            self.buffers.inputs, [f"_dummy_{i}" for i in range(len(query_lens))], idx_mapping, query_lens,
            num_reqs_padded, num_tokens_padded, features, self.limits.max_model_len,
        )
        batch.attn_metadata.max_query_len = num_tokens_padded
        return batch

    def dummy_step(self, query_lens: np.ndarray, features: SamplingFeatures) -> None:
        """Prepare, forward and sample a dummy batch (no post-update: profiling)."""
        batch = self.dummy_batch(query_lens, features, len(query_lens), int(query_lens.sum()))
        self.prepare_inputs(batch)
        self.forward_and_sample(batch)

    def reset_scratch_row(self) -> None:
        """Dummy steps advance the scratch row's counters; padded entries need them at 0."""
        r = self.buffers.requests
        row = r.scratch_row
        for t in (r.num_computed_tokens, r.prefill_len, r.last_sampled, r.num_draft):
            if t is not None:
                t[row] = 0

    def check_padding_invariants(self) -> None:
        """Debug mode, after a replay: padding is neutral (docs/architecture.md §4). Raises AssertionError."""
        batch = self.current_batch
        if batch is None:
            return
        R, Rp, T, Tp = batch.num_reqs, batch.num_reqs_padded, batch.num_tokens, batch.num_tokens_padded
        qsl = batch.query_start_loc.cpu()
        assert bool((qsl[1:] >= qsl[:-1]).all()), f"query_start_loc decreases: {qsl.tolist()}"
        assert int(qsl[R]) == T and bool((qsl[R:] == T).all()), f"padded query_start_loc != {T}: {qsl[R:].tolist()}"
        idx = batch.idx_mapping.cpu()
        scratch = self.buffers.requests.scratch_row
        assert bool((idx[R:Rp] == scratch).all()), f"padded entries point at live rows {idx[R:Rp].tolist()}"
        seq_lens = batch.seq_lens.cpu()
        assert bool((seq_lens[R:Rp] == 0).all()), f"padded seq_lens not 0: {seq_lens[R:Rp].tolist()}"
        slots = batch.slot_mapping.cpu()
        assert bool((slots[T:Tp] == -1).all()), \
            f"padded slots not -1 (a padded row would write KV): {slots[T:Tp].tolist()}"
        limit = self.block_tables.num_kv_blocks * self.limits.block_size
        low = -1 if self.dcp is not None else 0  # DCP: tokens another rank owns get -1
        assert bool(((slots[:T] >= low) & (slots[:T] < limit)).all()), f"real slots outside [{low}, {limit})"


StepFunction = Callable[[], None]
