"""StepGraphs: the dispatch table, graph pool, captured graphs and capture loop of a runner.

Two questions per step — which descriptor does this batch get (`dispatch`), and which
captured graph serves it (`full_graph`) — and one at start-up: `capture()`. It receives
what it uses: the step body (the function FULL graphs capture and the compiled model
PIECEWISE graphs replay), the step buffers (their static tensors, for debug address
checks) and the limits; it never sees the runner.

FULL graphs are keyed by (descriptor, sampling variant): the sampler's code path is
static inside a graph, so a greedy-only batch replays a graph that skips the random
sampling pipeline, a plain random-sampling batch (temperature / top-k / top-p / min-p)
one that skips penalties, bias, allowed ids, min_tokens and logprobs, and any other
batch the one with every feature on.

With `lazy_variants` the all-features graphs are not captured up front: the first step that
needs one captures it, between the step's upload and its run (outside any running graph),
then re-uploads its own inputs and replays it. The capture's dummy step touches only the
scratch row, the per-step buffers the run rewrites anyway, and the KV blocks of the scratch
row's table, which are saved and restored around it; the output ring has already made the
step wait for the previous step's D2H copy. Layouts where a capture would have to be
collective across ranks or where drafts live in per-step buffers (PP, lockstep DP,
speculation) capture every variant up front.

With LoRA on (`lora`), the table also holds descriptors with `has_lora`: they are captured with
the adapters' kernels (the body's LoRA compile, the projections' `active` flag set), the plain
ones without; a LoRA graph is captured with slot metadata that gives no row an adapter (the
kernels are recorded all the same; their work is decided at replay by the metadata).

With dual-batch overlap (`microbatch_threshold`: lockstep DP with `enable_dbo`), every uniform-decode
FULL descriptor of at least that many tokens and two requests has a `microbatched` twin, captured with
the others: the same step as two microbatches on two streams (step/microbatch.py). A step replays the
twin when the DP replicas agreed to microbatch it (`microbatch_twin`).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from capture.descriptor import BatchExecutionDescriptor
from capture.dispatch import DispatchTable
from capture.full import FullGraph
from capture.jit_events import count_triton_jit
from capture.modes import AttentionCGSupport, CUDAGraphMode, resolve_mode
from capture.pool import GraphPool
from capture.report import CaptureRecord, CaptureReport
from graphrunner.attention.op import forward_context
from graphrunner.config import CompilationConfig, LoRAConfig
from graphrunner.state.features import SamplingFeatures
from graphrunner.step.body import StepBody
from graphrunner.step.inputs import InputBatch
from graphrunner.step.split import SplitStep

logger = logging.getLogger("graphrunner.capture")

GREEDY = SamplingFeatures()
SAMPLED = SamplingFeatures.sampled_only()
ALL_FEATURES = SamplingFeatures.all_on()
SAMPLING_VARIANTS = (GREEDY, SAMPLED, ALL_FEATURES)
VARIANT_NAMES = {GREEDY: "greedy", SAMPLED: "sampled", ALL_FEATURES: "all"}


def sampling_variant(features: SamplingFeatures) -> SamplingFeatures:
    """The captured variant that serves a batch. Each variant's stages are exact
    identities for rows that do not use them, so a wider variant gives the same tokens:
    SAMPLED serves any batch without penalties / bias / allowed ids / min_tokens /
    logprobs, ALL_FEATURES serves every batch."""
    if features == GREEDY:  # the common case first: a compare with the constant
        return GREEDY
    return SAMPLED if features.is_plain_sampling else ALL_FEATURES


def variant_name(features: SamplingFeatures) -> str:
    return VARIANT_NAMES[features]


def attention_cg_support(device: torch.device, attn_backend: Any) -> AttentionCGSupport:
    """What the attention backend allows inside FULL graphs.

    On a CPU FULL graphs are emulated by re-running the step, so any backend qualifies.
    On CUDA only a backend that declares graph safety does (the torch reference syncs
    with the host).
    """
    if device.type != "cuda":
        return AttentionCGSupport.ALWAYS
    declared = getattr(attn_backend, "cudagraph_support", None)
    if declared is not None:
        return AttentionCGSupport.parse(declared)
    return AttentionCGSupport.ALWAYS if getattr(attn_backend, "name", "") == "triton" else AttentionCGSupport.NEVER


class StepGraphs:
    """Dispatch table + pool + FULL graphs (+ the PIECEWISE model's captured sizes).

    `num_live` reports the live requests (capture needs an idle runner); `name` labels
    the compiled model in logs.
    """

    def __init__(self, comp: CompilationConfig, body: StepBody, device: torch.device, *,
                 num_live: Callable[[], int], name: str = "model", lazy_variants: bool = False,
                 lora: LoRAConfig | None = None, microbatch_threshold: int | None = None) -> None:
        self.body = body
        # Variants captured by capture(); the rest on first use (module docstring).
        self.eager_variants: tuple[SamplingFeatures, ...] = (GREEDY, SAMPLED) if lazy_variants else SAMPLING_VARIANTS
        self.captured_on_first_use = 0  # lazy variants captured by steps since the last capture()
        self.device = device
        self.num_live = num_live
        self.name = name
        self.compile_backend = comp.compile_backend
        limits = body.limits
        self.resolution = resolve_mode(
            comp.cudagraph_mode,
            attention_cg_support(device, body.attn_backend),
            enforce_eager=comp.enforce_eager,
            backend=f"attention backend {getattr(body.attn_backend, 'name', '?')!r}",
        )
        self.mode: CUDAGraphMode = self.resolution.mode
        self.table = DispatchTable(
            self.resolution,
            list(comp.cudagraph_capture_sizes) if comp.cudagraph_capture_sizes else None,
            max_num_reqs=limits.max_num_reqs,
            max_num_batched_tokens=limits.max_num_tokens,
            uniform_decode_query_len=limits.uniform_decode_query_len,
            enable_lora=lora is not None,
            lora_capture_sizes=lora.lora_capture_sizes if lora is not None else None,
        )
        self.debug = comp.debug_cudagraphs
        # desc -> its microbatched twin (module docstring); empty without dual-batch overlap
        self.twins: dict[BatchExecutionDescriptor, BatchExecutionDescriptor] = {} if microbatch_threshold is None else {
            d: dataclasses.replace(d, microbatched=True) for d in self.table.descriptors
            if d.is_uniform_decode and not d.has_lora and d.num_reqs is not None and d.num_reqs >= 2
            and d.num_tokens >= microbatch_threshold
        }
        self.pool: GraphPool | None = None
        self.full_graphs: dict[tuple[BatchExecutionDescriptor, SamplingFeatures], FullGraph] = {}
        # Structured-output decode steps in two graphs (step/split.py): key (desc, None) is the
        # forward graph, (desc, GREEDY | SAMPLED) the sampling graphs.
        self.split = SplitStep(body) if comp.structured_output_graphs else None
        self.split_graphs: dict[tuple[BatchExecutionDescriptor, SamplingFeatures | None], FullGraph] = {}
        self.captured = False
        self.generation = 0  # bumped by every capture and release: plans holding graphs compare it
        self._setup_compiled()

    # ---- per step -----------------------------------------------------------------
    def dispatch(self, num_reqs: int, num_tokens: int, uniform_token_count: int | None,
                 force_eager: bool = False, has_lora: bool = False) -> BatchExecutionDescriptor:
        """The plan of a step: NONE with real sizes until capture has run, or when the step
        must run eagerly (`force_eager`: it reads hidden states no graph keeps). `has_lora`: the
        batch has adapter rows (LoRA graphs only)."""
        if force_eager or not self.captured:
            return BatchExecutionDescriptor(CUDAGraphMode.NONE, num_tokens, num_reqs, has_lora=has_lora)
        return self.table.dispatch(num_reqs, num_tokens, uniform_token_count, has_lora)

    def microbatch_twin(self, desc: BatchExecutionDescriptor) -> BatchExecutionDescriptor | None:
        """The captured microbatched twin of an agreed FULL descriptor; None: microbatch eagerly."""
        return self.twins.get(desc) if self.captured else None

    def full_graph(self, desc: BatchExecutionDescriptor, features: SamplingFeatures) -> FullGraph | None:
        """The captured FULL graph that serves `desc` for a batch needing `features`; None for a
        variant captured on first use and not used yet (`run` captures it)."""
        return self.full_graphs.get((desc, sampling_variant(features)))

    def replay_full(self, desc: BatchExecutionDescriptor, features: SamplingFeatures) -> None:
        graph = self.full_graph(desc, features)
        assert graph is not None, f"{desc}[{variant_name(sampling_variant(features))}] is not captured"
        graph.replay()

    def split_pair(self, desc: BatchExecutionDescriptor,
                   features_after_masks: SamplingFeatures) -> tuple[FullGraph, FullGraph] | None:
        """(forward graph, sampling graph) for a constrained step of `desc` whose features, once its
        token masks are applied, are plain greedy or plain sampling; None: run the step whole."""
        variant = sampling_variant(features_after_masks)
        if variant is ALL_FEATURES or (desc, None) not in self.split_graphs:
            return None
        return self.split_graphs[(desc, None)], self.split_graphs[(desc, variant)]

    def run(self, desc: BatchExecutionDescriptor, batch: InputBatch,
            graph: FullGraph | None = None) -> FullGraph | None:
        """Run a prepared batch as `desc` says: replay its FULL graph, or the body (PIECEWISE / eager).
        Returns the FULL graph replayed (None otherwise), so that a plan may keep one captured on first use."""
        if graph is not None:  # FULL, looked up by the caller (a steady-decode plan holds it)
            graph.replay()
        elif desc.is_full:
            graph = self.full_graph(desc, batch.sampling_features)
            if graph is None:
                graph = self.capture_on_first_use(desc, batch)
            graph.replay()
        else:
            self.body.run(batch, piecewise=desc.is_piecewise)
        return graph

    # ---- start-up -----------------------------------------------------------------
    def capture(self, *, inspect_nodes: bool = False, progress: bool = True) -> CaptureReport:
        """Capture every descriptor of the table: largest first, PIECEWISE before FULL.

        All or nothing: if any graph fails (out of device memory, most likely), every graph
        captured so far is released with the pool, `captured` stays False so steps keep
        running eagerly (dispatch NONE), and the error names the graph being captured; an
        out-of-memory error is re-raised as `torch.OutOfMemoryError` with the pool's figures.
        Capture may be tried again (with fewer sizes, say).
        """
        if self.num_live():
            raise RuntimeError(
                f"capture_model() needs an idle runner; {self.num_live()} requests are live "
                "(capture runs dummy steps that write KV block 0)"
            )
        report = CaptureReport(mode=self.mode.name, device=str(self.device))
        descriptors = [d for d in self.table.descriptors if not d.is_eager]
        if not descriptors:
            logger.warning("cudagraph mode %s: nothing to capture; every step runs eagerly", self.mode.name)
            return report
        self.release()
        self.pool = GraphPool(self.device)
        work: list[tuple[BatchExecutionDescriptor, SamplingFeatures | None]] = [
            (d, None) for d in descriptors if d.is_piecewise
        ]
        work += [(d, v) for d in descriptors if d.is_full for v in self.eager_variants]
        work += [(twin, v) for twin in self.twins.values() for v in self.eager_variants]
        if self.split is not None:  # the split pairs last: (desc, None) stands for the pair
            work += [(d, None) for d in descriptors if not d.has_lora and self.split.serves(d)]
        free_before = self.pool.free_bytes()
        start = time.perf_counter()
        if self.device.type == "cuda":  # garbage's device memory back before the pool takes its own (CPU: none)
            gc.collect()
            torch.cuda.empty_cache()
        try:
            if self.body.compiled is not None:
                report.compile_seconds = self.compile_pieces()
            self._capture_all(work, report, inspect_nodes, progress, free_before)
        except BaseException:
            self._abandon_capture()
            raise
        self.captured = True
        self.generation += 1
        self.captured_on_first_use = 0
        report.total_seconds = time.perf_counter() - start - report.compile_seconds
        report.free_memory_delta_bytes = free_before - self.pool.free_bytes()
        logger.info("captured %d graphs in %.2f s (%s)", report.num_graphs, report.total_seconds, self.mode.name)
        return report

    def capture_on_first_use(self, desc: BatchExecutionDescriptor, batch: InputBatch) -> FullGraph:
        """Capture the variant `batch` needs at `desc` in the middle of a step, after its upload:
        the KV blocks the dummy step writes are restored and the batch's inputs uploaded again
        (module docstring). Other graphs stay valid: `generation` (a recapture) is unchanged."""
        assert self.pool is not None and self.captured, "lazy capture after capture()"
        variant = sampling_variant(batch.sampling_features)
        label = f"{desc}[{variant_name(variant)}]"
        body = self.body
        kv = [*body.buffers.kv_caches, *body.buffers.draft_kv_caches]
        requests = body.buffers.requests
        blocks = torch.from_numpy(np.unique(body.block_tables.table_np[requests.scratch_row])).to(self.device).long()
        saved = [cache[:, blocks].clone() for cache in kv]  # [2, n, block_size, heads, dim] each
        start = time.perf_counter()
        try:
            record = self._capture_one(desc, variant, label, inspect_nodes=False)
        finally:
            for cache, old in zip(kv, saved, strict=True):
                cache[:, blocks] = old
            body.reset_scratch_row()
            body.buffers.inputs.upload(batch.idx_mapping_np, batch.query_lens_np, batch.num_reqs_padded,
                                       requests.scratch_row)
        self.captured_on_first_use += 1
        logger.info("captured %s on first use in %.2f s", record.key, time.perf_counter() - start)
        return self.full_graphs[(desc, variant)]

    def _capture_all(self, work: list[tuple[BatchExecutionDescriptor, SamplingFeatures | None]],
                     report: CaptureReport, inspect_nodes: bool, progress: bool, free_before: int) -> None:
        """The capture loop; a failure names the graph (descriptor[variant]) it was capturing."""
        assert self.pool is not None
        # A GC pass during capture would walk (and time) every frozen object. A caller that froze
        # its heap already (gc.freeze at start-up) keeps its freeze: unfreeze would undo it.
        froze = gc.get_freeze_count() == 0
        if froze:
            gc.freeze()
        bar = _progress(work, progress)
        try:
            for i, (desc, variant) in enumerate(bar):
                label = str(desc) if variant is None else f"{desc}[{variant_name(variant)}]"
                label += "[split]" if variant is None and desc.is_full else ""
                if hasattr(bar, "set_postfix_str"):
                    bar.set_postfix_str(f"{label} free={self.pool.free_bytes() / (1 << 30):.1f}GiB")
                try:
                    with count_triton_jit() as jit:
                        record = self._capture_one(desc, variant, label, inspect_nodes)
                    record.jit_kernels = jit[0]
                    report.records.append(record)
                except torch.OutOfMemoryError as e:
                    raise torch.OutOfMemoryError(self._oom_message(label, i, len(work), report, free_before)) from e
                except Exception as e:
                    note = f"while capturing graph {i + 1} of {len(work)}, {label}; every graph was released"
                    logger.error("capture_model() failed %s: %s", note, e)
                    if hasattr(e, "add_note"):  # Python >= 3.11
                        e.add_note(note)
                    raise
                self.body.reset_scratch_row()
        finally:
            if froze:
                gc.unfreeze()
            if hasattr(bar, "close"):
                bar.close()

    def _oom_message(self, label: str, index: int, total: int, report: CaptureReport, free_before: int) -> str:
        """What capture knew when it ran out of memory: the graph, the pool and the device."""
        assert self.pool is not None
        gib = float(1 << 30)
        device = f"device free {self.pool.free_bytes() / gib:.2f} GiB"
        if self.device.type == "cuda":
            device += f" of {torch.cuda.mem_get_info(self.device)[1] / gib:.2f} GiB"
        return (
            f"capture_model(): out of device memory capturing graph {index + 1} of {total}, {label} "
            f"({self.mode.name}): {device} ({free_before / gib:.2f} GiB before capture), "
            f"reserved by torch {self.pool.reserved_bytes() / gib:.2f} GiB, graph pool grown by "
            f"{report.pool_bytes / gib:.2f} GiB over the {len(report.records)} graphs captured before it. "
            "Every graph was released and steps run eagerly (dispatch NONE). Capture fewer sizes "
            "(cudagraph_capture_sizes), a mode with fewer graphs (cudagraph_mode), or leave the pool more "
            "room (a lower gpu_memory_utilization or num_kv_blocks)."
        )

    def _abandon_capture(self) -> None:
        """After a failed capture: no graph survives to replay, the scratch row is neutral again."""
        self.release()
        self.body.reset_scratch_row()
        if self.device.type == "cuda":  # the released graphs' device memory back (CPU: none to return)
            gc.collect()
            torch.cuda.empty_cache()

    def _capture_one(self, desc: BatchExecutionDescriptor, variant: SamplingFeatures | None, label: str,
                     inspect_nodes: bool) -> CaptureRecord:
        assert self.pool is not None
        if variant is None and desc.is_full:
            return self._capture_split(desc, label, inspect_nodes)
        if variant is None:
            return self.capture_pieces(desc, label)
        graph = FullGraph(
            label,
            self.make_full_step(desc, variant),
            self.pool,
            static_tensors=self.body.buffers.static_tensors,
            check_invariants=self.body.check_padding_invariants,
            debug=self.debug,
        )
        try:
            record = graph.capture(inspect_nodes=inspect_nodes)
        except BaseException:
            graph.release()  # a half-captured graph never replays
            raise
        self.full_graphs[(desc, variant)] = graph
        return record

    def _capture_split(self, desc: BatchExecutionDescriptor, label: str, inspect_nodes: bool) -> CaptureRecord:
        """The forward graph and the two sampling graphs of a split constrained step (one record)."""
        assert self.pool is not None and self.split is not None and desc.num_reqs is not None
        split = self.split
        batch = self.body.dummy_batch(self.capture_query_lens(desc), GREEDY, desc.num_reqs, desc.num_tokens)
        steps: list[tuple[SamplingFeatures | None, Callable[[], None]]] = [(None, lambda: split.forward_part(batch))]
        steps += [(v, functools.partial(split.sample_part, batch, v)) for v in (GREEDY, SAMPLED)]
        records = []
        for variant, step in steps:
            name = "forward" if variant is None else f"{variant_name(variant)} after masks"
            graph = FullGraph(f"{desc}[split {name}]", step, self.pool, static_tensors=self.body.buffers.static_tensors,
                              debug=self.debug)
            try:
                records.append(graph.capture(inspect_nodes=inspect_nodes))
            except BaseException:
                graph.release()
                raise
            self.split_graphs[(desc, variant)] = graph
        return CaptureRecord(label, sum(r.seconds for r in records), sum(r.pool_bytes for r in records),
                             None, {})

    def release(self) -> None:
        """Drop every graph and the pool (before process groups go; lifecycle rule)."""
        for graph in [*self.full_graphs.values(), *self.split_graphs.values()]:
            graph.release()
        self.full_graphs.clear()
        self.split_graphs.clear()
        if self.body.compiled is not None:
            self.body.compiled.release()
        if self.body.compiled_lora is not None:
            self.body.compiled_lora.release()
        if self.pool is not None:
            self.pool.release()
            self.pool = None
        self.captured = False
        self.generation += 1

    # ---- what is captured ---------------------------------------------------------------
    def capture_query_lens(self, desc: BatchExecutionDescriptor) -> np.ndarray:
        """Query lengths of the dummy batch a descriptor is captured (or a DP idle step run) with."""
        if desc.uniform_token_count is not None and desc.num_reqs is not None:
            return np.full(desc.num_reqs, desc.uniform_token_count, dtype=np.int32)
        max_num_reqs = self.body.limits.max_num_reqs
        num_reqs = desc.num_reqs if desc.num_reqs is not None else min(desc.num_tokens, max_num_reqs)
        # Spread tokens evenly so no dummy entry outgrows max_model_len or its block-table row.
        lens = np.full(num_reqs, desc.num_tokens // num_reqs, dtype=np.int32)
        lens[: desc.num_tokens % num_reqs] += 1
        return lens

    def make_full_step(self, desc: BatchExecutionDescriptor, features: SamplingFeatures) -> Callable[[], None]:
        """The step function a FULL graph captures for `desc`: views fixed at padded sizes."""
        assert desc.num_reqs is not None, f"a FULL descriptor pads requests: {desc}"
        batch = self.body.dummy_batch(self.capture_query_lens(desc), features, desc.num_reqs, desc.num_tokens)
        body = self.body
        self._lora_dummy(batch, desc)
        if desc.microbatched:
            ub = body.microbatch
            assert ub is not None, "a microbatched graph needs the body's Microbatcher (lockstep DP with DBO)"

            def microbatched_step() -> None:
                ub.arm(desc.num_tokens // 2, static=True)  # uniform: the cut after num_reqs // 2 requests
                body.run(batch)

            return microbatched_step

        def step() -> None:
            body.run(batch)

        return step

    def _setup_compiled(self) -> None:
        """The compile-once model: attention becomes an opaque op the compiler splits at.

        PIECEWISE graphs replay its pieces per token count; FULL graphs capture its
        compiled (fused) kernels inside the whole-step graph. Eager mode keeps the
        plain module.
        """
        from capture.piecewise import PiecewiseCompiled

        body = self.body
        body.compiled = None
        use_compiled = self.mode.has_piecewise_graphs or self.mode.has_full_graphs
        body.model.use_attention_op(use_compiled)
        if body.spec is not None:
            body.spec.setup_compiled(use_compiled, self.compile_backend, self.device)
        if use_compiled:
            body.compiled = PiecewiseCompiled(
                body.model,
                [torch.ops.graphrunner.unified_attention],
                token_args=body.token_args,  # input_ids, positions (+ PP stage inputs): [T_pad]
                compile_backend=self.compile_backend,
                device=self.device,
                check_addresses=self.debug,
                name=self.name,
            )
            if body.lora is not None:  # the LoRA graphs' compile: traced with the adapters active
                body.compiled_lora = PiecewiseCompiled(
                    body.model, [torch.ops.graphrunner.unified_attention], token_args=body.token_args,
                    compile_backend=self.compile_backend, device=self.device, check_addresses=self.debug,
                    name=f"{self.name}+lora",
                )

    def _lora_dummy(self, batch: InputBatch, desc: BatchExecutionDescriptor) -> None:
        """A dummy batch of a LoRA descriptor: flagged, with metadata that gives no row an adapter."""
        lora = self.body.lora
        if desc.has_lora and lora is not None:
            batch.has_lora = True
            lora.clear(batch.num_tokens_padded)

    def compile_pieces(self) -> float:
        """Trace and compile the pieces once (symbolic token count); returns seconds."""
        body = self.body
        start = time.perf_counter()
        limits = body.limits
        lens = np.ones(min(limits.max_num_reqs, limits.max_num_tokens), dtype=np.int32)
        batch = body.dummy_batch(lens, SamplingFeatures(), len(lens), int(lens.sum()))
        body.prepare_inputs(batch)
        if body.lora is not None:  # the plain compile never sees the adapters (a LoRA step may have run last)
            body.lora.active = False
        with forward_context(batch.attn_metadata, body.buffers.kv_caches, body.attn_backend):
            out = body.compiled.run_compiled(*body.model_args(batch))
            if body.compiled_lora is not None and body.lora is not None:
                body.lora.clear(batch.num_tokens_padded)
                body.lora.active = True
                try:
                    body.compiled_lora.run_compiled(*body.model_args(batch))
                finally:
                    body.lora.active = False
        if body.spec is not None and body.is_last_stage:
            body.spec.take_features(out, batch.num_tokens_padded, True)  # what an EAGLE head drafts from
            body.spec.propose(batch)  # compiles a draft model, outside any graph capture
        body.reset_scratch_row()
        return time.perf_counter() - start

    def capture_pieces(self, desc: BatchExecutionDescriptor, label: str) -> CaptureRecord:
        """Capture the pieces for one padded token count (the first call also compiles)."""
        body, pool = self.body, self.pool
        assert pool is not None
        query_lens = self.capture_query_lens(desc)
        batch = body.dummy_batch(query_lens, SamplingFeatures(), len(query_lens), desc.num_tokens)
        body.prepare_inputs(batch)
        compiled = body.compiled
        if desc.has_lora and body.lora is not None:
            self._lora_dummy(batch, desc)
            compiled = body.compiled_lora
        if body.lora is not None:
            body.lora.active = desc.has_lora
        reserved = pool.reserved_bytes()
        start = time.perf_counter()
        with forward_context(batch.attn_metadata, body.buffers.kv_caches, body.attn_backend):
            compiled.capture(*body.model_args(batch), pool=pool.handle, stream=pool.stream)
        return CaptureRecord(label, time.perf_counter() - start, pool.reserved_bytes() - reserved)


def _progress(items: list, enabled: bool):
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency, but capture must not hinge on a progress bar
        return items
    return tqdm(items, desc="capturing graphs", unit="graph", leave=False)
