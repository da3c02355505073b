"""ModelRunner: the API an engine uses to run one step of an LLM.

    runner = ModelRunner(config, device)
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_kv_blocks())
    runner.capture_model()                      # optional: steps run eagerly until then
    while ...:
        runner.execute_model(scheduler_output)
        output = runner.sample_tokens()

`execute_model` and `sample_tokens` are the step, top to bottom: validate, update request
states, plan the batch, run it, advance the host mirrors, hand the output back. Each stage
is one call into the module that owns it (state/, step/); pipeline and lockstep data
parallelism (`self.pp`, `self.dp`), the KV connector (`self.kv_connector`) and speculative
decoding (inside the step body) are objects the step calls at fixed points, absent when unused.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from capture.descriptor import BatchExecutionDescriptor
from capture.full import FullGraph
from capture.report import CaptureReport
from graphrunner.attention import get_attention_backend
from graphrunner.config import RunnerConfig, kv_cache_dtype, resolve_dtype
from graphrunner.distributed.dcp_attention import wrap_for_dcp
from graphrunner.distributed.groups import ParallelGroups
from graphrunner.distributed.lockstep import LockstepDP
from graphrunner.distributed.pcp_step import make_prefill_context_parallel
from graphrunner.distributed.pipeline_stage import PipelineStage
from graphrunner.kv_cache import KVCacheShape, check_fp8_kv_device, determine_num_kv_blocks
from graphrunner.kv_transfer.base import KVConnectorWorker
from graphrunner.layers.lora.manager import LoraManager
from graphrunner.layers.lora.weights import LoraBuffers
from graphrunner.limits import StepLimits
from graphrunner.multimodal.embeds import EmbedInputs, check_request_kinds, make_embed_inputs
from graphrunner.protocol import DraftTokenIds, ModelRunnerOutput, SchedulerOutput
from graphrunner.sample.logprobs import PromptLogprobs
from graphrunner.sample.sampler import Sampler
from graphrunner.spec_decode.step import make_speculative_step
from graphrunner.state.requests import RequestState
from graphrunner.state.sampling import SamplingStates
from graphrunner.state.store import StateStore
from graphrunner.state.validation import check_field_containers, validate_scheduler_output
from graphrunner.step.body import StepBody
from graphrunner.step.buffers import LogprobBuffers, StageBuffers, StepBuffers
from graphrunner.step.graphs import StepGraphs
from graphrunner.step.inputs import InputBatch, InputBuffers
from graphrunner.step.output import DEFAULT_NUM_SLOTS, AsyncOutput, DeferredStep, OutputRing, PendingStep, StepOutputs
from graphrunner.step.plan import DecodePlan, StepPlanner
from graphrunner.structured_outputs import GrammarOutput

logger = logging.getLogger("graphrunner.runner")

_GIB = 1 << 30
_INFERENCE_MODE_GUARD = getattr(torch._C, "_InferenceMode", None)


@dataclass
class StartupTimes:
    """Where a runner's start-up went, recorded once per phase (seconds; 0 for a phase not run).

    load: building the model and reading its weights (`load_model`); compile: torch.compile of
    the pieces (`capture_model`, a warm compile cache makes it short); capture: recording the
    graphs (`capture_model`, without the compile)."""

    load: float = 0.0
    compile: float = 0.0
    capture: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def __str__(self) -> str:
        return f"load {self.load:.2f} s / compile {self.compile:.2f} s / capture {self.capture:.2f} s"


def _inference_mode() -> Any:
    """Inference mode for the per-step host path: the C++ guard that `torch.inference_mode()`
    wraps costs ~1 us per entry, the context manager ~6 us (of a 60 us per-step budget)."""
    guard = _INFERENCE_MODE_GUARD
    return guard(True) if guard is not None else torch.inference_mode()


class ModelRunner:
    """Runs steps of one model on one device over persistent, max-size buffers.

    `groups` places this runner in a TP x PP x DP world (`init_distributed`); None for a
    single process.
    """

    # A runner kind (graphrunner.pool.PoolingRunner) swaps the step body and the model it builds.
    body_class: type[StepBody] = StepBody
    is_pooling_model = False

    def __init__(self, config: RunnerConfig, device: torch.device | str, groups: ParallelGroups | None = None):
        self.config = config
        if groups is None:
            if config.parallel.world_size != 1:
                raise ValueError(
                    f"parallel config of world size {config.parallel.world_size} needs the process groups "
                    "(graphrunner.distributed.init_distributed)"
                )
            groups = ParallelGroups.single(config.parallel, device)
        self.num_kv_heads_local = config.kv_heads_per_rank()  # ValueError naming the sizes if they do not divide
        self.groups = groups
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = resolve_dtype(config.dtype, self.device)
        # The KV cache's storage dtype: the model's, or float8_e4m3fn (CacheConfig.cache_dtype).
        self.kv_cache_dtype = kv_cache_dtype(config.cache.cache_dtype, self.dtype)
        check_fp8_kv_device(self.kv_cache_dtype, self.device)
        self.model_config = config.model
        sched = config.scheduler
        self.limits = StepLimits(
            max_num_reqs=sched.max_num_seqs, max_num_tokens=sched.max_num_batched_tokens,
            max_model_len=sched.max_model_len, block_size=config.cache.block_size,
            max_num_blocks_per_req=config.max_num_blocks_per_req, vocab_size=config.model.vocab_size,
            uniform_decode_query_len=1 + config.speculative.num_speculative_tokens,
            tokens_per_block=config.tokens_per_block,
        )
        self.eos_token_ids: tuple[int, ...] = tuple(config.model.eos_token_id)

        L = self.limits
        self.state = StateStore(L.max_num_reqs, L.max_model_len, L.vocab_size, self.eos_token_ids, config.seed,
                                self.device, num_speculative_tokens=config.speculative.num_speculative_tokens)
        sampler = Sampler(self.state.sampling)
        spec = make_speculative_step(config.speculative, self.state.requests, sampler, L, groups, self.device,
                                     target_config=config.model)
        groups.check_context_parallel(has_draft_model=spec is not None and spec.drafter is not None)
        self.buffers = StepBuffers(
            inputs=InputBuffers(L.max_num_reqs, L.max_num_tokens, L.max_num_blocks_per_req, self.device),
            requests=self.state.requests, sampling=self.state.sampling,
            logprobs=LogprobBuffers.allocate(L.max_num_reqs * L.uniform_decode_query_len, self.device),
            spec=spec.buffers if spec is not None else None,
            lora=LoraBuffers(config.lora.max_loras, L.max_num_tokens, self.device) if config.lora else None,
        )
        self.lora: LoraManager | None = None  # with the model (LoRA on)
        if config.lora is not None:
            _check_lora_layout(config, groups)
        self.prompt_logprobs = PromptLogprobs()
        # Pipeline parallelism: hidden states between stages and the sampled-token broadcast,
        # outside the graphs (None for one stage). Lockstep DP joins with the graphs (below).
        self.pp = PipelineStage(groups, max_num_reqs=L.max_num_reqs, num_rows=self.state.requests.num_rows,
                                device=self.device, spec=spec) if groups.pp_size > 1 else None
        self.dp: LockstepDP | None = None
        self.ep: Any = None  # DP + EP: the MoE layers' DPComm (load_model)
        self.eplb: Any = None  # EPLB controller (distributed.eplb), with enable_eplb
        self._side_comms: Any = None  # DBO under DP + EP on CUDA: microbatch 1's communicators
        self.attn_backend = wrap_for_dcp(get_attention_backend(self.device, kernel=config.kernel), groups)  # DCP-aware
        pcp = make_prefill_context_parallel(groups.pcp, L, self.buffers.inputs, self.device)  # None without PCP
        self.body = self.body_class(self.buffers, L, sampler, self.attn_backend, self.prompt_logprobs,
                             is_last_stage=groups.pp.is_last, spec=spec, pcp=pcp,
                             dcp=getattr(self.attn_backend, "layout", None))
        self.output_ring = OutputRing(self.device, max(DEFAULT_NUM_SLOTS, groups.pp_size + 1))  # P in flight: PP
        self.outputs = StepOutputs(self.output_ring, self.buffers.logprobs, self.state.sampling, L.max_num_reqs,
                                   self.state.requests, self.buffers.spec)
        self.graphs: StepGraphs | None = None  # with the KV cache
        self.planner: StepPlanner | None = None
        self.capture_report: CaptureReport | None = None  # the last capture_model() result
        self.startup_times = StartupTimes()
        self._compile_cache: Any = None  # graphrunner.compile_cache.CompileCache, made on first use
        self._pending: PendingStep | None = None
        self._deferred: DeferredStep | None = None
        self._last_descriptor: BatchExecutionDescriptor | None = None
        self.embeds: EmbedInputs | None = None  # prompt embeddings / multimodal inputs (load_model)
        # KV connector (kv_transfer/): loads before the step's run, saves after it; None when off.
        self.kv_connector: KVConnectorWorker | None = None
        if config.kv_transfer is not None and config.parallel.world_size != 1:
            raise ValueError(f"kv_transfer_config with a parallel world of size {config.parallel.world_size} is not "
                             "supported (a KV connector serves one process)")

    # ---- set-up -----------------------------------------------------------------
    def load_model(self) -> None:
        """Build the model and load its weights (a HF folder, or dummy weights)."""
        from graphrunner.distributed.comm import TPComm
        from graphrunner.models.loader import load_model

        start = time.perf_counter()
        g, par = self.groups, self.config.parallel
        tp = TPComm.from_groups(g, expert_parallel=par.enable_expert_parallel,
                                num_redundant_experts=par.num_redundant_experts, record_expert_load=par.enable_eplb)
        model = load_model(
            self.model_config, self.config.load, attn_backend=self.attn_backend, dtype=self.dtype, device=self.device,
            tp=tp, pp_rank=g.pp_rank, pp_size=g.pp_size, kernel=self.config.kernel, model_cls=self.model_factory(),
        )
        self.body.model = model
        self.embeds = make_embed_inputs(self.model_config, self.limits.max_num_tokens, model, self.device, self.dtype,
                                        pipeline_parallel=g.pp_size > 1, num_rows=self.state.requests.num_rows)
        self.buffers.embeds = self.embeds.buffers if self.embeds is not None else None
        self.buffers.mrope = self.embeds.mrope.buffers if self.embeds is not None and self.embeds.mrope else None
        if self.buffers.mrope is not None and self.body.pcp is not None:
            raise ValueError("M-RoPE models (Qwen2.5-VL) do not support prefill context parallelism")
        self.ep = tp.dp  # DP + EP: the MoE layers' DP group (lockstep pads every step to the agreed size)
        if self.ep is not None and par.enable_dbo and self.device.type == "cuda":
            from graphrunner.distributed.comm import second_communicators

            self._side_comms = second_communicators(g, tp)
        if par.enable_eplb:
            from graphrunner.distributed.eplb import make_eplb

            self.eplb = make_eplb(model, tp, g, par.eplb_window_size, par.eplb_step_interval)
        if self.config.lora is not None:  # every projection's adapter slots, before any graph
            assert self.buffers.lora is not None, "allocated with the runner"
            self.lora = LoraManager(self.config.lora, model, self.buffers.lora, self.model_config, self.dtype,
                                    self.device)
        # Microbatches run side by side on two streams: each MoE layer call then takes its own buffers.
        if not self.config.parallel.enable_dbo:
            model.allocate_workspace(self.limits.max_num_tokens)
        if self.body.spec is not None:  # a draft model or EAGLE head, if the drafter has one
            self.body.spec.cache_dtype = self.config.cache.cache_dtype  # its KV is stored like the target's
            self.body.spec.load_draft_model(self.config.load, self.attn_backend, self.dtype, self.device, model)
        self.prompt_logprobs.compute_logits = model.compute_logits
        if self.pp is not None:
            self.buffers.stage = self.pp.allocate_buffers(self.limits.max_num_tokens, self.model_config.hidden_size,
                                                          self.dtype)
        else:
            self.buffers.stage = StageBuffers()
        self.startup_times.load = time.perf_counter() - start
        logger.info(
            "loaded %s (%.2f GiB of %s weights) on %s in %.2f s", self.model_config.name,
            sum(p.numel() * p.element_size() for p in model.parameters()) / _GIB, self.dtype, self.device,
            self.startup_times.load,
        )

    def model_factory(self) -> Any:
        """The model constructor `load_model` uses; None: the architecture's generative model."""
        return None

    @property
    def model(self) -> Any:
        return self.body.model

    @property
    def kv_cache_shape(self) -> KVCacheShape:
        """This rank's share of the KV cache (its layers and KV heads)."""
        m = self.model_config
        layers = self.model.num_local_layers if self.model is not None else m.num_hidden_layers
        return KVCacheShape(layers, self.limits.block_size, self.num_kv_heads_local, m.head_dim, self.kv_cache_dtype)

    def compile_cache_scope(self) -> Any:
        """Compilation and Triton JIT inside this block go to (and load from) the configuration's
        entry of the compile cache (`CompilationConfig.compile_cache_dir`); a no-op where it is off
        or nothing is compiled (a CPU without inductor)."""
        comp = self.config.compilation
        compiles = self.device.type == "cuda" or (comp.compile_backend == "inductor" and not comp.enforce_eager)
        if self._compile_cache is None and compiles and comp.compile_cache_dir:
            from graphrunner.compile_cache import CompileCache

            mode = "NONE" if comp.enforce_eager else (comp.cudagraph_mode or "default")
            self._compile_cache = CompileCache.for_runner(comp.compile_cache_dir, self.model_config, self.dtype,
                                                          mode, comp.compile_backend, self.device, self.groups.rank)
        return self._compile_cache.scope() if self._compile_cache is not None else contextlib.nullcontext()

    @torch.inference_mode()
    def determine_num_kv_blocks(self) -> int:
        """How many KV blocks fit: a fixed count if configured, else profile + memory budget
        (CUDA: `gpu_memory_utilization` of the device; CPU: `cpu_kv_cache_bytes`)."""
        self._require_model()
        L, spec = self.limits, self.body.spec
        with self.compile_cache_scope():  # the profile step JIT-compiles the Triton kernels
            return determine_num_kv_blocks(
                self.kv_cache_shape, self.config.cache, self.body, self.device,
                max_blocks=L.max_num_reqs * L.max_num_blocks_per_req, max_num_blocks_per_req=L.max_num_blocks_per_req,
                max_model_len=L.max_model_len, agree=self.groups.agree_min,
                extra_block_bytes=spec.draft_block_bytes(L.block_size) if spec is not None else 0,
            )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the paged KV cache (one tensor per layer) and the block tables."""
        self._require_model()
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be positive")
        shape, L = self.kv_cache_shape, self.limits
        self.buffers.kv_caches = shape.allocate(num_blocks, self.device)
        if self.eplb is not None:  # profiling's dummy steps routed tokens too
            self.eplb.step_load.zero_()
        self.buffers.block_tables = self.state.init_block_tables(L.max_num_blocks_per_req, L.block_size, num_blocks)
        if self.body.spec is not None:  # a draft model's KV lives in the same blocks
            self.buffers.draft_kv_caches = self.body.spec.attach_kv_cache(self.buffers.block_tables, num_blocks)
        if self.config.kv_transfer is not None:
            from graphrunner.kv_transfer import make_worker_connector, model_identity

            self.kv_connector = make_worker_connector(self.config.kv_transfer, shape, model_identity(self.config),
                                                      self.device)
            self.kv_connector.register_kv_caches(self.buffers.kv_caches)
        logger.info("KV cache: %d blocks x %d tokens (%.2f GiB, %s)", num_blocks, L.block_size,
                    num_blocks * shape.block_bytes / _GIB, str(shape.dtype).removeprefix("torch."))
        # A capture on first use runs on one rank alone: only where no peer joins its collectives
        # and no drafts sit in per-step buffers (step/graphs.py).
        g = self.groups
        lazy = (self.config.compilation.lazy_sampler_variants and self.body.spec is None and g.pp_size == 1
                and not g.dp_lockstep and self.body.pcp is None and self.config.lora is None)
        # Dual-batch overlap: uniform-decode steps replay FULL graphs of their two microbatches where the
        # two streams' collectives cannot share a communicator: DP + EP with the side stream's own
        # communicators, a model with no collective (TP1, no EP), or a CPU (no second stream).
        par = self.config.parallel
        ubatch_graphs = g.dp_lockstep and par.enable_dbo and (
            self._side_comms is not None or self.device.type != "cuda" or (self.ep is None and g.tp_size == 1))
        threshold = par.dbo_decode_token_threshold if ubatch_graphs else None
        self.graphs = graphs = StepGraphs(self.config.compilation, self.body, self.device,
                                          num_live=lambda: self.state.requests.num_live, name=self.model_config.name,
                                          lazy_variants=lazy, lora=self.config.lora, microbatch_threshold=threshold)
        if self.groups.dp_lockstep:  # replicas agree on every step's descriptor (one CPU all-reduce)
            self.dp = LockstepDP(self.groups, graphs, self.pp, self.device, ep=self.ep,
                                 side_comms=self._side_comms)
        self.planner = StepPlanner(self.state, self.buffers.inputs, graphs, L,
                                   self.dp.dispatch if self.dp is not None else graphs.dispatch,
                                   reuse_plans=self.dp is None, pcp=self.body.pcp, lora=self.lora)

    @torch.inference_mode()
    def capture_model(self, *, inspect_nodes: bool = False, progress: bool = True) -> CaptureReport:
        """Capture every descriptor of the dispatch table; steps dispatch to NONE until then.

        Must run on an idle runner (no live requests). `inspect_nodes` keeps each CUDA
        graph's node list for the report (kernel names, node counts) at some memory cost.
        """
        graphs = self._require_graphs()
        with self.compile_cache_scope():
            self.capture_report = report = graphs.capture(inspect_nodes=inspect_nodes, progress=progress)
        self.startup_times.compile, self.startup_times.capture = report.compile_seconds, report.total_seconds
        if self.eplb is not None:  # capture's dummy steps routed tokens too: count served steps only
            self.eplb.step_load.zero_()
        return report

    def shutdown(self) -> None:
        """Release graphs and the graph pool first, then the KV cache (lifecycle order).

        Process groups outlive this: destroy them after (`ParallelGroups.destroy`)."""
        if self.pp is not None:
            self.pp.close()
        if self.graphs is not None:
            self.graphs.release()
        self.graphs = self.planner = None
        self.dp = None
        self.buffers.kv_caches = []
        self.buffers.block_tables = self.state.block_tables = None
        self.body.model = self.body.compiled = None
        self._pending = None
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
        so = scheduler_output
        planner, state, prompt_lp = self._require_planner(), self.state, self.prompt_logprobs
        if self._pending is not None or self._deferred is not None:
            raise RuntimeError(
                "execute_model() called twice without sample_tokens() in between; call sample_tokens() to "
                "collect the pending step (the runner keeps it and stays usable)"
            )
        with _inference_mode():
            # 1. Validate the scheduler's plan; nothing changes before it passes. Steady decoding
            #    reuses the last decode step's plan, which only shortens the stages below.
            check_field_containers(so)  # before any field is read, whichever path the step takes
            plan = planner.reusable_plan(so, bool(prompt_lp.active))
            blocks = so.scheduled_cached_reqs.new_block_ids
            # count(None) compares identities in C: ~4x cheaper than any() when nothing is new.
            new_blocks = blocks.count(None) != len(blocks) and any(blocks)
            validate_scheduler_output(state, self.limits, so, plan.hint if plan is not None else None, new_blocks)
            lora = self.lora
            if lora is not None:  # new requests' adapters readable, <= max_loras of them in the step
                lora.check(so)
            elif so.scheduled_new_reqs:
                _refuse_adapters(so)
            if so.scheduled_new_reqs:
                mc = self.model_config
                check_request_kinds(so, pooling=self.is_pooling_model, prompt_embeds=mc.enable_prompt_embeds,
                                    multimodal=mc.vision is not None)
            if self.embeds is not None:
                self.embeds.validate(so, state.requests.req_id_to_index.__contains__)

            # 2. Update request states: removals, admissions, new KV blocks (staged writes, one commit).
            removed = state.update(so, steady=plan is not None, new_blocks=new_blocks)
            if lora is not None and (removed is not None or so.scheduled_new_reqs):
                lora.update(so, removed.req_ids if removed is not None else ())
            if plan is not None and new_blocks:
                planner.refresh_limits(plan)  # the plan's per-row token limits grew
            if removed is not None:  # prompt-logprob tracking and PP row generations follow the rows
                for req_id in removed.req_ids:
                    prompt_lp.remove_request(req_id)
                if self.pp is not None:
                    self.pp.rows_freed(removed.rows)
            for new in so.scheduled_new_reqs:
                prompt_lp.add_request(new)
            if self.embeds is not None:  # sources of new requests; scheduled encoder inputs encoded
                self.embeds.update(so)

            # 3. Nothing scheduled: an idle lockstep-DP replica still joins its peers' collectives.
            kv_connector = self.kv_connector
            if so.total_num_scheduled_tokens == 0:
                if kv_connector is not None:
                    kv_connector.no_forward(so)
                if self.dp is not None:
                    # A dummy step writes the per-step output buffers an in-flight copy may still read.
                    self.output_ring.guard_next_step()
                    if self.dp.idle_step() and self.eplb is not None:
                        self.eplb.step()
                return

            # KV connector loads land in the paged cache before any graph of the step replays.
            if kv_connector is not None:
                kv_connector.pre_forward(so)

            # 4. Plan the batch: order decode-first, dispatch (agreed under lockstep DP), upload.
            batch, desc = planner.prepare(so, plan, prompt_lp.needs_eager)
            if self.embeds is not None:  # this batch's prompt / multimodal rows into inputs_embeds
                self.embeds.stage(batch, state.requests.num_computed_np)

            # 5. Structured outputs: sampling waits for the grammar masks, which come with
            #    sample_tokens; a split step runs its forward graph now, meanwhile. A grammar
            #    row implies the logit-bias feature: the cheap gate first.
            features = batch.sampling_features
            masked = state.sampling.masked_features(batch.idx_mapping_np, features) if features.any_logit_bias else None
            if masked is not None:
                pair = self._require_graphs().split_pair(desc, masked)
                if pair is not None:
                    self.body.current_batch = batch
                    self.output_ring.guard_next_step()
                    pair[0].replay()
                self._deferred = DeferredStep(batch, desc, plan, pair[1] if pair is not None else None)
                return

            # 6. Run it and advance the host mirrors.
            self._run(batch, desc, plan)

    def _run(self, batch: InputBatch, desc: BatchExecutionDescriptor, plan: DecodePlan | None,
             sampling_graph: FullGraph | None = None) -> None:
        """Run a planned step and leave it pending: PP receive, the run (FULL graph replay, or the
        step body through PIECEWISE graphs or eagerly), host mirrors, PP send."""
        planner, graphs, requests = self._require_planner(), self._require_graphs(), self.state.requests
        self.body.current_batch = batch
        self.output_ring.guard_next_step()  # the step overwrites `sampled`, which a copy may still read
        if self.pp is not None:
            self.pp.receive(batch, requests)  # hidden states and due tokens, outside graphs
        current = planner.plan if planner.plan is not None and planner.plan.batch is batch else None
        try:
            if sampling_graph is not None:
                sampling_graph.replay()
            else:
                graph = graphs.run(desc, batch, current.full_graph if current is not None else None)
                if current is not None and current.full_graph is None:  # captured on first use
                    current.full_graph = graph
        except RuntimeError as e:  # under TP/PP/DP: a CollectiveError naming this rank
            self.groups.raise_step_failure(e)
        if self.kv_connector is not None:  # the KV the step computed, saved outside the graphs
            self.kv_connector.post_forward()
        if self.eplb is not None:  # outside the graphs: the step's expert load; every interval a rebalance
            with self.groups.exchange("EPLB rebalance (expert weights between the EP ranks)"):
                self.eplb.step()
        produces, all_produce, verify = planner.advance(batch, plan)
        if self.pp is not None:  # send on; exchange the sampled tokens
            positions = requests.num_computed_np[batch.idx_mapping_np] if self.pp.defers_tokens else None
            self.pp.send(batch, produces, self.body.post_update, positions)
        prompt_lp = self.prompt_logprobs
        done = prompt_lp.take_done() if prompt_lp.done else None  # prompt logprobs completed this step
        self._pending = PendingStep(batch, desc, produces, all_produce, done, current, verify)
        self._last_descriptor = desc

    def sample_tokens(self, async_output: bool = False,
                      grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput | AsyncOutput:
        """The step's sampled tokens.

        grammar_output: the step's grammar masks (structured outputs, vLLM's shape: with speculation
        1 + its drafts rows per request). A step with structured-output requests runs here, after its
        masks are uploaded (a request the output does not list samples unconstrained); other steps ran
        in execute_model and ignore it. A bad layout raises ValueError and the step stays deferred.

        async_output=False: a `ModelRunnerOutput` (one blocking D2H copy).
        async_output=True: an `AsyncOutput` at once; `.get()` waits for the step's D2H copy
        (on the output copy stream) and returns the `ModelRunnerOutput`. At most 3 outputs may
        be unresolved at a time. Without a pending step the output is empty.
        """
        deferred = self._deferred
        if deferred is not None:  # a structured-output step: its masks first, then the run
            batch = deferred.batch
            self.state.write_grammar(batch.idx_mapping_np, batch.req_ids, batch.query_lens_np, grammar_output)
            self._deferred = None
            with _inference_mode():
                self._run(batch, deferred.descriptor, deferred.plan, deferred.sampling_graph)
        pending, self._pending = self._pending, None
        if pending is None:
            empty = ModelRunnerOutput.empty()
            return AsyncOutput.ready(empty) if async_output else empty
        if self.pp is not None and self.pp.defers_tokens:  # pipelined PP, a non-last stage: the last stage's tokens
            return self.pp.output(pending, self.outputs.build, self.state.requests, async_output)
        return self.outputs.collect(pending, async_output)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The last taken step's drafts (None without speculation, or once taken): a scheduler
        may place them in `scheduled_spec_decode_tokens`, or -1 placeholders read on the device."""
        drafts, self.outputs.drafts = self.outputs.drafts, None
        return drafts

    # ---- what engines and tools read -------------------------------------------------
    @property
    def input_buffers(self) -> InputBuffers:
        return self.buffers.inputs

    @property
    def req_states(self) -> RequestState:
        return self.state.requests

    @property
    def sampling_states(self) -> SamplingStates:
        return self.state.sampling

    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def uniform_decode_query_len(self) -> int:
        return self.limits.uniform_decode_query_len

    @property
    def num_kv_blocks(self) -> int:
        return self.state.block_tables.num_kv_blocks if self.state.block_tables is not None else 0

    @property
    def last_descriptor(self) -> BatchExecutionDescriptor | None:
        """The descriptor the last executed step ran with (None before the first step)."""
        return self._last_descriptor

    def grammar_block(self, num_rows: int, words: int) -> torch.Tensor:
        """[num_rows, words] int32 host memory (pinned on CUDA) to fill with the next step's
        `GrammarOutput` masks (pass it as `pinned`): uploaded with their placement in one copy,
        without a host copy. Valid until the block after next is taken (the runner reuses it)."""
        return self.state.sampling.grammar_block(num_rows, words)

    # ---- helpers ----------------------------------------------------------------
    def _require_model(self) -> None:
        if self.body.model is None:
            raise RuntimeError("call load_model() first")

    def _require_graphs(self) -> StepGraphs:
        if self.graphs is None:  # graphs exist once the model and the KV cache do
            self._require_model()
            raise RuntimeError("call initialize_kv_cache(num_blocks) first")
        return self.graphs

    def _require_planner(self) -> StepPlanner:
        if self.planner is None:
            self._require_graphs()
            raise RuntimeError("call initialize_kv_cache(num_blocks) first")
        return self.planner


def _refuse_adapters(so: SchedulerOutput) -> None:
    """A runner without LoRA: a new request naming an adapter is an error, not the base model."""
    for new in so.scheduled_new_reqs:
        if new.lora_request is not None:
            raise ValueError(f"request {new.req_id!r}: lora_request={new.lora_request} needs a runner with LoRA on "
                             "(RunnerConfig.lora, LLM(enable_lora=True))")


def _check_lora_layout(config: RunnerConfig, groups: ParallelGroups) -> None:
    """LoRA serves one process or tensor parallelism; ValueError naming what it does not serve."""
    p = config.parallel
    refused = [(groups.pp_size > 1, f"pipeline_parallel_size={groups.pp_size}"),
               (groups.dp_lockstep, "data_parallel_lockstep=True"),
               (p.prefill_context_parallel_size > 1,
                f"prefill_context_parallel_size={p.prefill_context_parallel_size}"),
               (bool(p.enable_dbo), "enable_dbo=True")]
    for bad, what in refused:
        if bad:
            raise ValueError(f"enable_lora=True with {what} is not supported (LoRA serves one process or "
                             "tensor parallelism)")


__all__ = ["ModelRunner", "StartupTimes"]
