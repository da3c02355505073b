"""ModelRunner: the API an engine uses to run one step of an LLM.

    runner = ModelRunner(config, device)
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_kv_blocks())
    while ...:
        runner.execute_model(scheduler_output)
        output = runner.sample_tokens()

A step (DESIGN.md §3): validate the scheduler's plan without touching state, apply
request-state changes as staged writes, order the batch decode-first, upload the two
per-step host arrays, then run the step body — input preparation, forward, logits,
sampling and the post-update of request state — entirely on the device over views of
persistent buffers. The step body is the same code whether it runs eagerly or, later,
from a captured graph.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from graphrunner.attention import get_attention_backend
from graphrunner.async_output import AsyncOutput, OutputLayout, OutputRing
from graphrunner.attention.op import forward_context
from graphrunner.block_table import BlockTables, compute_slot_mapping
from graphrunner.config import RunnerConfig, resolve_dtype
from graphrunner.distributed.groups import ParallelGroups
from graphrunner.distributed.runner_hooks import ParallelHooks
from graphrunner.input_batch import InputBatch, InputBuffers
from graphrunner.kernels.input_prep import (
    compute_logits_indices,
    post_update,
    prepare_input_ids,
    prepare_positions_seq_lens,
)
from graphrunner.protocol import ModelRunnerOutput, NewRequestData, SchedulerOutput
from graphrunner.sample.logprobs import (
    PromptLogprobsCollector,
    logprob_dicts,
    prompt_logprob_targets,
    prompt_logprobs,
)
from graphrunner.sample.sampler import Sampler, SamplingFeatures, SamplingStates
from graphrunner.states import RequestState
from graphrunner.step_graphs import StepGraphs
from graphrunner.validation import DecodeHint, validate_scheduler_output
from capture.descriptor import BatchExecutionDescriptor
from capture.full import FullGraph
from capture.report import CaptureRecord, CaptureReport

logger = logging.getLogger("graphrunner.runner")

_GIB = 1 << 30


_INFERENCE_MODE_GUARD = getattr(torch._C, "_InferenceMode", None)


def _inference_mode():
    """Inference mode for the per-step host path.

    `torch.inference_mode()` costs ~6 us per entry in Python; its C++ guard, which that
    context manager wraps, costs ~1 us: a fifth of the 60 us per-step budget saved.
    """
    guard = _INFERENCE_MODE_GUARD
    return guard(True) if guard is not None else torch.inference_mode()


@dataclass
class _PendingStep:
    """What `execute_model` leaves for `sample_tokens`."""

    batch: InputBatch
    descriptor: BatchExecutionDescriptor
    produces_token: np.ndarray  # [num_reqs] bool: the chunk reached the end of the known tokens
    all_produce: bool  # produces_token.all(), computed once
    # Requests whose prompt logprobs completed in this step: req_id -> vLLM's PromptLogprobs.
    prompt_logprobs: dict[str, list] | None = None


@dataclass
class _DecodePlan:
    """A uniform-decode step's host-side layout, reused while it stays valid.

    Steady decoding schedules the same requests in the same order step after step. While
    no request is admitted or removed (`epoch`), the graphs are unchanged and the upload
    of `version` is still what the device buffer holds, the next such step reuses the
    order, state rows, descriptor, sampling features and views, and skips the upload.
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
    rows_index: "slice | np.ndarray"  # idx_mapping as a slice where its rows are consecutive
    full_graph: FullGraph | None  # what replays the step (desc FULL), looked up once
    output_layout: OutputLayout | None = None  # the step's D2H copies, resolved on first use


def _as_slice(rows: np.ndarray) -> "slice | np.ndarray":
    """`rows` as a slice when they are consecutive ascending (a basic-index update is
    several times cheaper than a fancy-index one), else `rows` itself."""
    n = len(rows)
    if n and int(rows[-1]) - int(rows[0]) == n - 1 and (n == 1 or bool((np.diff(rows) == 1).all())):
        return slice(int(rows[0]), int(rows[0]) + n)
    return rows


class ModelRunner:
    """Runs steps of one model on one device over persistent, max-size buffers.

    `groups` places this runner in a TP x PP x DP world (`init_distributed`); None for a
    single process.
    """

    def __init__(self, config: RunnerConfig, device: torch.device | str, groups: ParallelGroups | None = None):
        self.config = config
        if groups is None:
            if config.parallel.world_size != 1:
                raise ValueError(
                    f"parallel config of world size {config.parallel.world_size} needs the process groups "
                    "(graphrunner.distributed.init_distributed)"
                )
            groups = ParallelGroups.single(config.parallel, device)
        self.groups = groups
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_config = config.model
        self.vocab_size = config.model.vocab_size
        self.max_model_len = config.scheduler.max_model_len
        self.max_num_reqs = config.scheduler.max_num_seqs
        self.max_num_tokens = config.scheduler.max_num_batched_tokens
        self.block_size = config.cache.block_size
        self.max_num_blocks_per_req = config.max_num_blocks_per_req
        self.eos_token_ids: tuple[int, ...] = tuple(config.model.eos_token_id)
        self.uniform_decode_query_len = 1 + config.speculative.num_speculative_tokens

        self.req_states = RequestState(self.max_num_reqs, self.max_model_len, self.device)
        self.sampling_states = SamplingStates(
            self.req_states.num_rows, self.device, base_seed=config.seed, vocab_size=self.vocab_size,
            all_token_ids=self.req_states.all_token_ids,
        )
        self.sampler = Sampler(self.sampling_states)
        # Sampled-token logprobs, column 0 = the sampled token, then the top-K (K = the
        # all-features variant's). Persistent so captured graphs write them in place.
        logprob_cols = SamplingFeatures.all_on().num_logprobs + 1
        self.logprob_values = torch.zeros(self.max_num_reqs, logprob_cols, dtype=torch.float32, device=self.device)
        self.logprob_token_ids = torch.zeros(self.max_num_reqs, logprob_cols, dtype=torch.int32, device=self.device)
        self.logprob_ranks = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=self.device)
        # Requests still in their prompt that asked for prompt logprobs: req_id -> (prompt
        # token ids, collector). Their prefill steps run outside FULL graphs (they need the
        # hidden states of every prompt position); completed results wait in _prompt_lp_done.
        self._prompt_lp: dict[str, tuple[list[int], PromptLogprobsCollector]] = {}
        self._prompt_lp_done: dict[str, list] = {}
        self.input_buffers = InputBuffers(self.max_num_reqs, self.max_num_tokens, self.max_num_blocks_per_req, self.device)
        self.attn_backend = get_attention_backend(self.device)

        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.block_tables: BlockTables | None = None
        self.num_kv_blocks = 0
        self.graphs: StepGraphs | None = None
        self.capture_report: CaptureReport | None = None  # the last capture_model() result
        self._pending: _PendingStep | None = None
        self._plan: _DecodePlan | None = None  # the last uniform-decode step's layout
        self.output_ring = OutputRing(self.device)  # pinned slots + copy stream of async outputs
        self._last_descriptor: BatchExecutionDescriptor | None = None
        self._current_batch: InputBatch | None = None
        self._piecewise = None  # PiecewiseCompiled (compiled model) once the graph mode needs it
        self.parallel = ParallelHooks(self, groups)
        if config.model.num_key_value_heads % groups.tp_size:
            raise ValueError(
                f"num_key_value_heads={config.model.num_key_value_heads} is not divisible by "
                f"tensor_parallel_size={groups.tp_size}"
            )
        self.num_kv_heads_local = config.model.num_key_value_heads // groups.tp_size

    # ---- set-up -----------------------------------------------------------------
    def load_model(self) -> None:
        """Build the model and load its weights (a HF folder, or dummy weights)."""
        from graphrunner.distributed.comm import TPComm
        from graphrunner.models.loader import load_model

        start = time.perf_counter()
        g = self.groups
        self.model = load_model(
            self.model_config, self.config.load, attn_backend=self.attn_backend, dtype=self.dtype, device=self.device,
            tp=TPComm.from_groups(g), pp_rank=g.pp_rank, pp_size=g.pp_size,
        )
        self.parallel.allocate_buffers(self.model_config.hidden_size, self.dtype)
        logger.info(
            "loaded %s (%.2f GiB of %s weights) on %s in %.2f s",
            self.model_config.name,
            sum(p.numel() * p.element_size() for p in self.model.parameters()) / _GIB,
            self.dtype,
            self.device,
            time.perf_counter() - start,
        )

    @property
    def num_local_layers(self) -> int:
        """Decoder layers this rank holds (all of them without pipeline parallelism)."""
        return self.model.num_local_layers if self.model is not None else self.model_config.num_hidden_layers

    @property
    def kv_block_bytes(self) -> int:
        m = self.model_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_local_layers * self.block_size * self.num_kv_heads_local * m.head_dim * elem

    def _allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        m = self.model_config
        shape = (2, num_blocks, self.block_size, self.num_kv_heads_local, m.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_local_layers)]

    @torch.inference_mode()
    def determine_num_kv_blocks(self) -> int:
        """How many KV blocks fit: a fixed count if configured, else profile + memory budget.

        On CUDA a profile run at the largest batch measures peak activation memory; the
        cache gets `gpu_memory_utilization` of the device minus everything else in use.
        On CPU the cache gets `cpu_kv_cache_bytes`.
        """
        self._require_model()
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        if self.device.type != "cuda":
            num_blocks = cache.cpu_kv_cache_bytes // self.kv_block_bytes
        else:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._profile_run()
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            current = torch.cuda.memory_allocated(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * cache.gpu_memory_utilization - (total - free) - (peak - current)
            num_blocks = int(budget // self.kv_block_bytes)
            logger.info(
                "KV cache budget %.2f GiB (%d blocks of %d tokens); activation peak %.2f GiB",
                max(budget, 0) / _GIB, num_blocks, self.block_size, (peak - current) / _GIB,
            )
        # More blocks than max_num_seqs full-length requests can ever hold would be dead memory.
        num_blocks = min(num_blocks, self.max_num_reqs * self.max_num_blocks_per_req)
        # Every rank of a replica serves one scheduler: they must agree on the cache size.
        num_blocks = self.parallel.agree_num_kv_blocks(num_blocks)
        if num_blocks < self.max_num_blocks_per_req:
            raise RuntimeError(
                f"only {num_blocks} KV blocks fit, fewer than the {self.max_num_blocks_per_req} one request of "
                f"max_model_len={self.max_model_len} needs; lower max_model_len or raise the memory budget"
            )
        return int(num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the paged KV cache (one tensor per layer) and the block tables."""
        self._require_model()
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be positive")
        self.kv_caches = self._allocate_kv_caches(num_blocks)
        self.num_kv_blocks = num_blocks
        self.block_tables = BlockTables(
            self.req_states.num_rows, self.max_num_blocks_per_req, self.block_size, num_blocks, self.device
        )
        logger.info(
            "KV cache: %d blocks x %d tokens (%.2f GiB)", num_blocks, self.block_size, num_blocks * self.kv_block_bytes / _GIB
        )
        self.graphs = StepGraphs(self)
        self._setup_piecewise()

    @torch.inference_mode()
    def capture_model(self, *, inspect_nodes: bool = False, progress: bool = True) -> CaptureReport:
        """Capture every descriptor of the dispatch table; steps dispatch to NONE until then.

        Must run on an idle runner (no live requests). `inspect_nodes` keeps each CUDA
        graph's node list for the report (kernel names, node counts) at some memory cost.
        """
        self._require_kv_cache()
        assert self.graphs is not None
        self.capture_report = self.graphs.capture(inspect_nodes=inspect_nodes, progress=progress)
        return self.capture_report

    def shutdown(self) -> None:
        """Release graphs and the graph pool first, then the KV cache (lifecycle order).

        Process groups outlive this: destroy them after (`ParallelGroups.destroy`)."""
        self.parallel.close()
        if self.graphs is not None:
            self.graphs.release()
        self.graphs = None
        self.kv_caches = []
        self.block_tables = None
        self.model = None
        self._pending = None
        self._plan = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- the step ---------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Run one step. Tokens are kept on the device until `sample_tokens()`.

        Invalid input raises ValueError before any state changes, so the runner keeps
        serving the other requests. Nothing here waits for the device: with async
        scheduling the engine calls this for step N + 1 while step N still runs (the
        next input token of every request is read on the device from `last_sampled`).
        """
        self._require_kv_cache()
        if self._pending is not None:
            raise RuntimeError("execute_model() called twice without sample_tokens() in between")
        with _inference_mode():
            self._execute(scheduler_output)

    def _execute(self, so: SchedulerOutput) -> None:
        plan = self._reusable_plan(so)
        if plan is not None and plan.hint.all_decode:
            self._execute_steady_decode(so, plan)
            return
        validate_scheduler_output(self, so, plan.hint if plan is not None else None)
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            self.parallel.idle_step()  # DP: an idle replica still joins the step's collectives
            return
        if plan is not None and any(so.scheduled_cached_reqs.new_block_ids):
            plan.hint.set_limit(self._token_limits(plan.hint.rows))
        batch, desc = self._prepare_batch(so, plan)
        self._current_batch = batch
        # The step overwrites `sampled`, which the last async output copy may still read.
        self.output_ring.guard_next_step()
        self.parallel.before_forward(batch.num_tokens_padded)  # PP: receive (outside graphs)
        if desc.is_full:
            assert self.graphs is not None
            self.graphs.replay_full(desc, batch.sampling_features)
        else:
            self._run_step(batch, piecewise=desc.is_piecewise)
        s = self.req_states
        idx = batch.idx_mapping_np
        if plan is not None and plan.hint.all_decode:
            s.num_computed_np[idx] += self.uniform_decode_query_len  # rows are distinct: no lost updates
            self.parallel.after_forward(batch, plan.all_produce)  # PP: send on, exchange sampled tokens
            self._pending = _PendingStep(batch, desc, plan.all_produce, True)
        else:
            nc_after = s.num_computed_np[idx] + batch.query_lens_np
            produces = nc_after >= s.prefill_len_np[idx]
            self.parallel.after_forward(batch, produces)  # PP: send on, exchange sampled tokens
            s.num_computed_np[idx] = nc_after
            self._pending = _PendingStep(batch, desc, produces, bool(produces.all()))
            if self._prompt_lp_done:
                self._pending.prompt_logprobs, self._prompt_lp_done = self._prompt_lp_done, {}
            if self._plan is not None and self._plan.batch is batch:
                self._plan.hint.all_decode = bool(produces.all())
        self._last_descriptor = desc

    def _execute_steady_decode(self, so: SchedulerOutput, plan: _DecodePlan) -> None:
        """`_execute` for a repeat of the last all-decode batch (see `_DecodePlan`).

        The same checks and effects as the general path, minus what the plan already
        knows: no admissions or removals, no reordering, no dispatch, no upload unless
        another layout was uploaded since, no host metadata a FULL graph ignores. This
        is the step that runs thousands of times per request: its host time is the
        runner's overhead per decoded token.
        """
        cached = so.scheduled_cached_reqs
        blocks = cached.new_block_ids
        # count(None) compares identities in C: ~4x cheaper than any() when nothing is new.
        new_blocks = blocks.count(None) != len(blocks) and any(blocks)
        validate_scheduler_output(self, so, plan.hint, new_blocks)
        if new_blocks:
            self._append_cached_blocks(cached)
            plan.hint.set_limit(self._token_limits(plan.hint.rows))
        self.req_states.apply_staged_writes()
        self.sampling_states.apply_staged_writes()
        self.block_tables.apply_staged_writes()
        batch = plan.batch
        if plan.upload_version != self.input_buffers.version:
            self.input_buffers.upload(plan.idx_mapping, plan.query_lens, batch.num_reqs_padded, self.req_states.scratch_row)
            plan.upload_version = self.input_buffers.version
        self._current_batch = batch
        q = self.uniform_decode_query_len
        num_computed = self.req_states.num_computed_np
        self.output_ring.guard_next_step()  # the step overwrites `sampled`, which a copy may still read
        self.parallel.before_forward(batch.num_tokens_padded)
        if plan.full_graph is not None:
            plan.full_graph.replay()
        else:
            batch.attn_metadata.max_seq_len = int(num_computed[plan.idx_mapping].max()) + q
            self._run_step(batch, piecewise=plan.desc.is_piecewise)
        num_computed[plan.rows_index] += q  # rows are distinct: no lost updates
        self.parallel.after_forward(batch, plan.all_produce)
        self._pending = _PendingStep(batch, plan.desc, plan.all_produce, True)
        self._last_descriptor = plan.desc

    @property
    def last_descriptor(self) -> BatchExecutionDescriptor | None:
        """The descriptor the last executed step ran with (None before the first step)."""
        return self._last_descriptor

    def sample_tokens(self, async_output: bool = False) -> ModelRunnerOutput | AsyncOutput:
        """The step's sampled tokens.

        async_output=False: a `ModelRunnerOutput` (one blocking D2H copy).
        async_output=True: an `AsyncOutput` at once; the tokens are copied D2H on the
        output copy stream after the step, and `.get()` waits for that copy only and
        returns the `ModelRunnerOutput`. At most `output_ring.num_slots` (3) outputs may
        be unresolved at a time: resolve step N before sampling step N + 3.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            empty = ModelRunnerOutput.empty()
            return AsyncOutput.ready(empty) if async_output else empty
        plan = self._plan
        if plan is not None and plan.batch is pending.batch:
            # Steady decoding: the same output tensors every step, their copies resolved once.
            if plan.output_layout is None:
                plan.output_layout = self._output_layout(pending.batch)
            layout = plan.output_layout
        else:
            layout = self._output_layout(pending.batch)
        if async_output:
            return self.output_ring.launch_layout(layout, partial(self._build_output, pending))
        return self._build_output(pending, layout.tensors)

    def _output_layout(self, batch: InputBatch) -> OutputLayout:
        """What a step copies to the host: its sampled tokens (and the logprob rows it asked for)."""
        R = batch.num_reqs
        device_outputs = {"sampled": batch.sampled[:R]}  # [R] int32
        capacity = {"sampled": self.max_num_reqs}
        if batch.sampling_features.wants_logprobs:
            # Whole rows (contiguous: one raw copy each); the host keeps the asked-for columns.
            device_outputs["logprob_values"] = self.logprob_values[:R]  # [R, K_all+1] float32
            device_outputs["logprob_token_ids"] = self.logprob_token_ids[:R]  # [R, K_all+1] int32
            device_outputs["logprob_ranks"] = self.logprob_ranks[:R]  # [R] int32
            capacity.update(logprob_values=self.max_num_reqs, logprob_token_ids=self.max_num_reqs,
                            logprob_ranks=self.max_num_reqs)
        return self.output_ring.layout(device_outputs, capacity)

    def _build_output(self, pending: _PendingStep, outputs: dict[str, torch.Tensor]) -> ModelRunnerOutput:
        """Host-side result of a step from its (host or device) output tensors."""
        batch = pending.batch
        tokens = outputs["sampled"]
        if tokens.device.type != "cpu":
            tokens = tokens.cpu()  # the synchronous path: one blocking D2H copy
        tokens_np = tokens.numpy().copy()  # [R] int32; a copy: the host slot is reused
        plan = self._plan
        index_source = plan.req_id_to_index if plan is not None and plan.batch is batch else None
        return ModelRunnerOutput.from_token_array(
            list(batch.req_ids), tokens_np, None if pending.all_produce else pending.produces_token.copy(),
            index_source, logprobs=self._sampled_logprobs(pending, outputs),
            prompt_logprobs_dict=pending.prompt_logprobs or {},
        )

    def _sampled_logprobs(self, pending: _PendingStep, outputs: dict[str, torch.Tensor]) -> list | None:
        """Per batch entry: [ {token: Logprob} ] for its sampled token (K+1 entries at most),
        [] where it sampled nothing or asked for none; None when no entry asked."""
        if "logprob_values" not in outputs:
            return None
        batch = pending.batch
        cols = pending.batch.sampling_features.num_logprobs + 1
        host = {name: t.cpu().numpy() for name, t in outputs.items() if name.startswith("logprob")}
        host["logprob_values"] = host["logprob_values"][:, :cols]
        host["logprob_token_ids"] = host["logprob_token_ids"][:, :cols]
        wanted = self.sampling_states.logprobs_of(batch.idx_mapping_np)  # [R] K per entry, -1 = none
        dicts = logprob_dicts(host["logprob_values"], host["logprob_token_ids"], host["logprob_ranks"])
        result = []
        for i, (d, k) in enumerate(zip(dicts, wanted.tolist())):
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

    def _update_states(self, so: SchedulerOutput) -> None:
        assert self.block_tables is not None
        if so.finished_req_ids or so.preempted_req_ids:
            for req_id in so.finished_req_ids | so.preempted_req_ids:
                row = self.req_states.remove_request(req_id)
                self._prompt_lp.pop(req_id, None)  # a preempted prompt restarts from token 0
                if row is not None:
                    self.block_tables.clear_row(row)
                    self.parallel.on_row_freed(row)
        for new in so.scheduled_new_reqs:
            self._add_request(new)
        cached = so.scheduled_cached_reqs
        if any(cached.new_block_ids):
            self._append_cached_blocks(cached)
        self.req_states.apply_staged_writes()
        self.sampling_states.apply_staged_writes()
        self.block_tables.apply_staged_writes()

    def _append_cached_blocks(self, cached) -> None:
        """Stage the new KV blocks of running requests (`scheduled_cached_reqs.new_block_ids`)."""
        assert self.block_tables is not None
        index = self.req_states.req_id_to_index
        for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids):
            if new_block_ids:
                self.block_tables.append_block_ids(index[req_id], new_block_ids, overwrite=False)

    def _add_request(self, new: NewRequestData) -> None:
        assert self.block_tables is not None
        row = self.req_states.add_request(new.req_id, new.all_token_ids, new.num_computed_tokens)
        self.sampling_states.add_request(
            row, new.req_id, new.sampling_params, self.vocab_size,
            prompt_len=len(new.prompt_token_ids), eos_ids=self.eos_token_ids,
        )
        k = new.sampling_params.prompt_logprobs
        # A request resumed after its prompt finished already delivered them.
        if k is not None and not new.output_token_ids and len(new.prompt_token_ids) > 1:
            prompt = list(new.prompt_token_ids)
            self._prompt_lp[new.req_id] = (prompt, PromptLogprobsCollector(len(prompt), k))
        self.block_tables.append_block_ids(row, new.block_ids, overwrite=True)

    def _graphs_key(self) -> tuple[int, int, bool]:
        assert self.graphs is not None
        return id(self.graphs), self.graphs.generation, self.graphs.captured

    def _reusable_plan(self, so: SchedulerOutput) -> _DecodePlan | None:
        """The last decode plan if `so` schedules exactly its requests, in its order, as decodes."""
        plan = self._plan
        if plan is None or so.scheduled_new_reqs or so.finished_req_ids or so.preempted_req_ids:
            return None
        if self._prompt_lp:  # such steps must not take a FULL graph (see _prepare_batch)
            return None
        if plan.epoch != self.req_states.epoch or plan.graphs_key != self._graphs_key():
            return None
        nst = so.num_scheduled_tokens
        if len(nst) != len(plan.req_ids) or so.scheduled_cached_reqs.req_ids != plan.req_ids:
            return None
        if list(nst) != plan.req_ids:
            return None
        q = self.uniform_decode_query_len
        if so.total_num_scheduled_tokens != q * len(nst) or list(nst.values()).count(q) != len(nst):
            return None
        return plan

    def _prepare_batch(
        self, so: SchedulerOutput, plan: _DecodePlan | None = None
    ) -> tuple[InputBatch, BatchExecutionDescriptor]:
        """Order decode-first, dispatch, upload idx_mapping and query_start_loc, return the views."""
        s = self.req_states
        if plan is not None:
            # Steady decoding: same order, rows, descriptor and features; the device
            # still holds this layout unless something uploaded since.
            batch = plan.batch
            if plan.upload_version != self.input_buffers.version:
                self.input_buffers.upload(plan.idx_mapping, plan.query_lens, batch.num_reqs_padded, s.scratch_row)
                plan.upload_version = self.input_buffers.version
            q = self.uniform_decode_query_len
            batch.attn_metadata.max_seq_len = int(s.num_computed_np[plan.idx_mapping].max()) + q
            return batch, plan.desc

        nst = so.num_scheduled_tokens
        keys = list(nst)
        lens = np.fromiter(nst.values(), dtype=np.int32, count=len(keys))
        if len(lens) > 1 and bool((lens[1:] < lens[:-1]).any()):
            # Stable sort on query length: decodes (1 token) first, then prefill chunks.
            order = np.argsort(lens, kind="stable")
            req_ids = [keys[i] for i in order.tolist()]
            query_lens = lens[order]
        else:
            req_ids, query_lens = keys, lens
        index = s.req_id_to_index
        idx_mapping = np.fromiter(map(index.__getitem__, req_ids), dtype=np.int32, count=len(req_ids))
        num_reqs, num_tokens = len(req_ids), int(query_lens.sum())
        q = self.uniform_decode_query_len
        uniform = q if num_tokens == num_reqs * q and bool((query_lens == q).all()) else None
        if uniform is not None and self._prompt_lp and not self._prompt_lp.keys().isdisjoint(req_ids):
            uniform = None  # prompt logprobs read every position's hidden state: no FULL graph
        assert self.graphs is not None
        desc = self.parallel.dispatch(num_reqs, num_tokens, uniform)
        # FULL pads tokens and requests; PIECEWISE tokens only; NONE nothing (DESIGN.md §4.3).
        num_reqs_padded = desc.num_reqs if desc.is_full else num_reqs
        num_tokens_padded = desc.num_tokens
        self.input_buffers.upload(idx_mapping, query_lens, num_reqs_padded, s.scratch_row)
        max_seq_len = int((s.num_computed_np[idx_mapping] + query_lens).max())
        batch = InputBatch.from_buffers(
            self.input_buffers,
            req_ids,
            idx_mapping,
            query_lens,
            num_reqs_padded,
            num_tokens_padded,
            self.sampling_states.features(idx_mapping),
            max_seq_len,
        )
        # DP replicas agree on each step's descriptor anew: no reusable plan there.
        if uniform is not None and self.groups.dp_size == 1:
            rows = idx_mapping.astype(np.int64)
            rows_index = _as_slice(idx_mapping)
            hint = DecodeHint(rows, self._token_limits(rows), all_decode=False,
                              rows_index=rows_index if isinstance(rows_index, slice) else None)
            self._plan = _DecodePlan(
                req_ids=req_ids, hint=hint,
                idx_mapping=idx_mapping, query_lens=query_lens,
                desc=desc, batch=batch, epoch=s.epoch, graphs_key=self._graphs_key(),
                upload_version=self.input_buffers.version,
                req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                all_produce=np.ones(num_reqs, dtype=bool),
                rows_index=rows_index,
                full_graph=self.graphs.full_graph(desc, batch.sampling_features) if desc.is_full else None,
            )
        else:
            self._plan = None
        return batch, desc

    def _token_limits(self, rows: np.ndarray) -> np.ndarray:
        """[R] int64: the most tokens each row may hold (its blocks, capped by max_model_len)."""
        assert self.block_tables is not None
        held = self.block_tables.num_blocks[rows].astype(np.int64) * self.block_size
        return np.minimum(held, self.max_model_len)

    def _run_step(self, batch: InputBatch, piecewise: bool = False) -> None:
        """The step body: everything after the upload, on the device, no host sync.

        The same code is the eager path, the body FULL graphs capture, and (with the
        forward swapped for the compiled pieces) the PIECEWISE path.
        """
        self._prepare_inputs(batch)
        self._forward_and_sample(batch, piecewise)
        if not self.parallel.run_stage_only():
            self.post_update(batch)

    def post_update(self, batch: InputBatch) -> None:
        """Advance request state by the step's sampled tokens (in the step body; on non-last
        PP stages after the tokens arrived from the last stage)."""
        s = self.req_states
        post_update(batch.idx_mapping, batch.query_start_loc, batch.seq_lens, batch.sampled,
                    s.num_computed_tokens, s.prefill_len, s.last_sampled, s.all_token_ids)

    def _prepare_inputs(self, batch: InputBatch) -> None:
        assert self.block_tables is not None
        s = self.req_states
        prepare_positions_seq_lens(batch.idx_mapping, batch.query_start_loc, s.num_computed_tokens,
                                   batch.positions, batch.seq_lens)
        prepare_input_ids(batch.idx_mapping, batch.query_start_loc, batch.positions, s.all_token_ids,
                          s.prefill_len, s.last_sampled, batch.input_ids)
        self.block_tables.gather(batch.idx_mapping, batch.block_table)
        compute_slot_mapping(batch.block_table, batch.query_start_loc, batch.positions, self.block_size,
                             batch.slot_mapping)
        compute_logits_indices(batch.query_start_loc, batch.logits_indices)

    def _forward_and_sample(self, batch: InputBatch, piecewise: bool = False) -> None:
        assert self.model is not None
        if piecewise:
            forward = self._piecewise
        elif self._piecewise is not None:
            forward = self._piecewise.run_compiled  # FULL graph bodies: fused kernels, no piece graphs
        else:
            forward = self.model
        args = self._model_args(batch)
        if self.model.attention_op_enabled:
            # The attention op reads this step's metadata and caches from the context,
            # so that they are not inputs of the compiled pieces.
            with forward_context(batch.attn_metadata, self.kv_caches, self.attn_backend):
                hidden = forward(*args)  # [T_pad, H]
        else:
            hidden = forward(*args)  # [T_pad, H]
        if self.parallel.run_stage_only():  # PP, not the last stage: (hidden, residual) go on
            self.parallel.stage_output(hidden, batch.num_tokens_padded)
            return
        if self._prompt_lp:
            self._collect_prompt_logprobs(batch, hidden)
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [R_pad, V] float32
        # The token being sampled sits at position seq_len: that keys its random noise.
        r_pad = batch.num_reqs_padded
        self.sampler(
            logits, batch.idx_mapping, batch.seq_lens, batch.sampling_features, out=batch.sampled,
            out_logprobs=self.logprob_values[:r_pad], out_logprob_ids=self.logprob_token_ids[:r_pad],
            out_ranks=self.logprob_ranks[:r_pad],
        )

    def _model_args(self, batch: InputBatch) -> tuple:
        """The model's forward arguments for `batch` (plus the PP stage inputs off the first stage)."""
        return (batch.input_ids, batch.positions, self.kv_caches, batch.attn_metadata,
                *self.parallel.model_extra_args(batch.num_tokens_padded))

    def run_dummy_step(self, desc: BatchExecutionDescriptor) -> None:
        """An idle DP replica's step: the agreed descriptor over scratch entries only.

        Runs the same graph / compiled / eager body (and PP exchange) as a real step of
        that shape, so every collective inside it matches the busy replicas'.
        """
        query_lens = self._capture_query_lens(desc)
        num_reqs_padded = desc.num_reqs if desc.num_reqs is not None else len(query_lens)
        batch = self._dummy_batch(query_lens, SamplingFeatures(), num_reqs_padded, desc.num_tokens)
        self._current_batch = batch
        self.parallel.before_forward(batch.num_tokens_padded)
        if desc.is_full:
            assert self.graphs is not None
            self.graphs.replay_full(desc, batch.sampling_features)
        else:
            self._run_step(batch, piecewise=desc.is_piecewise)
        self.parallel.after_forward(batch, None)
        self._current_batch = None
        self.reset_scratch_row()

    def _collect_prompt_logprobs(self, batch: InputBatch, hidden: torch.Tensor) -> None:
        """Prompt logprobs of this step's prefill chunks (eager; never inside a FULL graph).

        hidden: [T_pad, H]. Entry i's tokens sit at rows query_start_loc[i].. of hidden and
        at positions num_computed.. of its request (host mirror, not yet advanced).
        """
        offsets = np.concatenate(([0], np.cumsum(batch.query_lens_np)))
        for i, req_id in enumerate(batch.req_ids):
            entry = self._prompt_lp.get(req_id)
            if entry is None:
                continue
            prompt, collector = entry
            start = int(self.req_states.num_computed_np[batch.idx_mapping_np[i]])
            targets = prompt_logprob_targets(prompt, start, int(batch.query_lens_np[i]), len(prompt))
            if targets:
                first = int(offsets[i])
                target_ids = torch.tensor(targets, dtype=torch.int64, device=hidden.device)
                tensors = prompt_logprobs(hidden[first : first + len(targets)], target_ids, collector.num_logprobs,
                                          compute_logits=self.model.compute_logits)
                collector.add_chunk(start, tensors)
            if collector.done:
                self._prompt_lp_done[req_id] = collector.result()
                del self._prompt_lp[req_id]

    # ---- profiling --------------------------------------------------------------
    def _profile_run(self) -> None:
        """Run the largest forward and the largest sampling batch on scratch state.

        All dummy entries point at the scratch row (whose block table is all block 0)
        over a one-block temporary cache, so nothing live is touched.
        """
        real_caches = self.kv_caches
        self.kv_caches = self._allocate_kv_caches(1)
        real_tables = self.block_tables
        self.block_tables = BlockTables(self.req_states.num_rows, self.max_num_blocks_per_req, self.block_size, 1, self.device)
        try:
            per_req = min(self.max_num_tokens, self.max_model_len)
            num_reqs = min(-(-self.max_num_tokens // per_req), self.max_num_reqs)
            query_lens = np.full(num_reqs, per_req, dtype=np.int32)
            query_lens[-1] = self.max_num_tokens - per_req * (num_reqs - 1)
            self._dummy_step(query_lens, SamplingFeatures())
            decodes = np.ones(min(self.max_num_reqs, self.max_num_tokens), dtype=np.int32)
            self._dummy_step(decodes, SamplingFeatures.all_on())
        finally:
            self.kv_caches = real_caches
            self.block_tables = real_tables
            self.reset_scratch_row()

    def _dummy_step(self, query_lens: np.ndarray, features: SamplingFeatures) -> None:
        batch = self._dummy_batch(query_lens, features, len(query_lens), int(query_lens.sum()))
        self._prepare_inputs(batch)
        self._forward_and_sample(batch)

    def _dummy_batch(
        self, query_lens: np.ndarray, features: SamplingFeatures, num_reqs_padded: int, num_tokens_padded: int
    ) -> InputBatch:
        """Upload a batch whose every entry points at the scratch row; return its views.

        Graph batches carry static upper bounds in their host-side metadata ints, since
        a replay serves many batches (no backend may size work by them).
        """
        scratch = self.req_states.scratch_row
        idx_mapping = np.full(len(query_lens), scratch, dtype=np.int32)
        self.input_buffers.upload(idx_mapping, query_lens, num_reqs_padded, scratch)
        batch = InputBatch.from_buffers(
            self.input_buffers, [f"_dummy_{i}" for i in range(len(query_lens))], idx_mapping, query_lens,
            num_reqs_padded, num_tokens_padded, features, self.max_model_len,
        )
        batch.attn_metadata.max_query_len = num_tokens_padded
        return batch

    def reset_scratch_row(self) -> None:
        """Dummy steps advance the scratch row's counters; padded entries need them at 0."""
        row = self.req_states.scratch_row
        for t in (self.req_states.num_computed_tokens, self.req_states.prefill_len, self.req_states.last_sampled):
            t[row] = 0

    # ---- graph hooks (called by StepGraphs) -----------------------------------------
    def _capture_query_lens(self, desc: BatchExecutionDescriptor) -> np.ndarray:
        """Query lengths of the dummy batch a descriptor is captured with."""
        if desc.uniform_token_count is not None:
            return np.full(desc.num_reqs, desc.uniform_token_count, dtype=np.int32)
        num_reqs = desc.num_reqs if desc.num_reqs is not None else min(desc.num_tokens, self.max_num_reqs)
        # Spread tokens evenly so no dummy entry outgrows max_model_len or its block-table row.
        lens = np.full(num_reqs, desc.num_tokens // num_reqs, dtype=np.int32)
        lens[: desc.num_tokens % num_reqs] += 1
        return lens

    def make_full_step(self, desc: BatchExecutionDescriptor, features: SamplingFeatures):
        """The step function a FULL graph captures for `desc`: views fixed at padded sizes."""
        query_lens = self._capture_query_lens(desc)
        batch = self._dummy_batch(query_lens, features, desc.num_reqs, desc.num_tokens)

        def step() -> None:
            self._run_step(batch)

        return step

    def static_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor a captured step reads or writes, by name (debug address checks)."""
        ib, s = self.input_buffers, self.req_states
        tensors = {
            "packed_host_inputs": ib.packed, "input_ids": ib.input_ids, "positions": ib.positions,
            "slot_mapping": ib.slot_mapping, "seq_lens": ib.seq_lens, "logits_indices": ib.logits_indices,
            "block_table": ib.block_table, "sampled": ib.sampled, "all_token_ids": s.all_token_ids,
            "num_computed_tokens": s.num_computed_tokens, "prefill_len": s.prefill_len,
            "last_sampled": s.last_sampled, "logprob_values": self.logprob_values,
            "logprob_token_ids": self.logprob_token_ids, "logprob_ranks": self.logprob_ranks,
        }
        if self.block_tables is not None:
            tensors["block_tables.table"] = self.block_tables.table
        for i, cache in enumerate(self.kv_caches):
            tensors[f"kv_cache[{i}]"] = cache
        return tensors

    def check_padding_invariants(self) -> None:
        """Debug mode, after a replay: padding is neutral (DESIGN.md §4.2). Raises AssertionError."""
        batch = self._current_batch
        if batch is None:
            return
        R, Rp, T, Tp = batch.num_reqs, batch.num_reqs_padded, batch.num_tokens, batch.num_tokens_padded
        qsl = batch.query_start_loc.cpu()
        assert bool((qsl[1:] >= qsl[:-1]).all()), f"query_start_loc decreases: {qsl.tolist()}"
        assert int(qsl[R]) == T and bool((qsl[R:] == T).all()), f"padded query_start_loc != {T}: {qsl[R:].tolist()}"
        idx = batch.idx_mapping.cpu()
        scratch = self.req_states.scratch_row
        assert bool((idx[R:Rp] == scratch).all()), f"padded entries point at live rows {idx[R:Rp].tolist()}"
        seq_lens = batch.seq_lens.cpu()
        assert bool((seq_lens[R:Rp] == 0).all()), f"padded seq_lens not 0: {seq_lens[R:Rp].tolist()}"
        slots = batch.slot_mapping.cpu()
        assert bool((slots[T:Tp] == -1).all()), f"padded slots not -1 (a padded row would write KV): {slots[T:Tp].tolist()}"
        limit = self.num_kv_blocks * self.block_size
        assert bool(((slots[:T] >= 0) & (slots[:T] < limit)).all()), f"real slots outside [0, {limit})"

    def _setup_piecewise(self) -> None:
        """The compile-once model: attention becomes an opaque op the compiler splits at.

        PIECEWISE graphs replay its pieces per token count; FULL graphs capture its
        compiled (fused) kernels inside the whole-step graph. Eager mode keeps the
        plain module.
        """
        from capture.piecewise import PiecewiseCompiled

        assert self.model is not None and self.graphs is not None
        self._piecewise = None
        mode = self.graphs.mode
        use_compiled = mode.has_piecewise_graphs or mode.has_full_graphs
        self.model.use_attention_op(use_compiled)
        if use_compiled:
            comp = self.config.compilation
            self._piecewise = PiecewiseCompiled(
                self.model,
                [torch.ops.graphrunner.unified_attention],
                token_args=self.parallel.token_args,  # input_ids, positions (+ PP stage inputs): [T_pad]
                compile_backend=comp.compile_backend,
                device=self.device,
                check_addresses=comp.debug_cudagraphs,
                name=self.model_config.name,
            )

    @property
    def has_compiled_model(self) -> bool:
        return self._piecewise is not None

    def compile_piecewise(self) -> float:
        """Trace and compile the pieces once (symbolic token count); returns seconds."""
        assert self._piecewise is not None
        start = time.perf_counter()
        lens = np.ones(min(self.max_num_reqs, self.max_num_tokens), dtype=np.int32)
        batch = self._dummy_batch(lens, SamplingFeatures(), len(lens), int(lens.sum()))
        self._prepare_inputs(batch)
        with forward_context(batch.attn_metadata, self.kv_caches, self.attn_backend):
            self._piecewise.run_compiled(*self._model_args(batch))
        self.reset_scratch_row()
        return time.perf_counter() - start

    def capture_piecewise_size(self, desc: BatchExecutionDescriptor, pool, label: str) -> CaptureRecord:
        """Capture the pieces for one padded token count (the first call also compiles)."""
        assert self._piecewise is not None
        query_lens = self._capture_query_lens(desc)
        batch = self._dummy_batch(query_lens, SamplingFeatures(), len(query_lens), desc.num_tokens)
        self._prepare_inputs(batch)
        reserved = pool.reserved_bytes()
        start = time.perf_counter()
        with forward_context(batch.attn_metadata, self.kv_caches, self.attn_backend):
            self._piecewise.capture(*self._model_args(batch), pool=pool.handle, stream=pool.stream)
        return CaptureRecord(label, time.perf_counter() - start, pool.reserved_bytes() - reserved)

    def release_piecewise(self) -> None:
        if getattr(self, "_piecewise", None) is not None:
            self._piecewise.release()

    # ---- helpers ----------------------------------------------------------------
    def _require_model(self) -> None:
        if self.model is None:
            raise RuntimeError("call load_model() first")

    def _require_kv_cache(self) -> None:
        self._require_model()
        if self.block_tables is None:
            raise RuntimeError("call initialize_kv_cache(num_blocks) first")
