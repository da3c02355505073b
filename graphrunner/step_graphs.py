"""StepGraphs: the runner's dispatch table, graph pool, captured graphs and capture loop.

The runner asks two questions per step — which descriptor does this batch get
(`dispatch`), and run it (`replay_full`, or the PIECEWISE/eager body) — and one at
start-up: `capture()`. Everything graph-specific lives here so that `runner.py` reads
as the step itself.

FULL graphs are keyed by (descriptor, sampling variant): the sampler's code path is
static inside a graph, so a greedy-only batch replays a graph that skips the random
sampling pipeline, a plain random-sampling batch (temperature / top-k / top-p / min-p)
one that skips penalties, bias, allowed ids, min_tokens and logprobs, and any other
batch the one with every feature on.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import TYPE_CHECKING

import torch

from capture.descriptor import BatchExecutionDescriptor
from capture.dispatch import DispatchTable
from capture.full import FullGraph
from capture.modes import AttentionCGSupport, CUDAGraphMode, resolve_mode
from capture.pool import GraphPool
from capture.report import CaptureReport
from graphrunner.sample.sampler import SamplingFeatures

if TYPE_CHECKING:
    from graphrunner.runner import ModelRunner

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


def attention_cg_support(runner: "ModelRunner") -> AttentionCGSupport:
    """What the attention backend allows inside FULL graphs.

    On a CPU FULL graphs are emulated by re-running the step, so any backend qualifies.
    On CUDA only a backend that declares graph safety does (the torch reference syncs
    with the host).
    """
    if runner.device.type != "cuda":
        return AttentionCGSupport.ALWAYS
    declared = getattr(runner.attn_backend, "cudagraph_support", None)
    if declared is not None:
        return AttentionCGSupport.parse(declared)
    return AttentionCGSupport.ALWAYS if getattr(runner.attn_backend, "name", "") == "triton" else AttentionCGSupport.NEVER


class StepGraphs:
    """Dispatch table + pool + FULL graphs (+ the PIECEWISE model's captured sizes)."""

    def __init__(self, runner: "ModelRunner"):
        self.runner = runner
        comp = runner.config.compilation
        self.resolution = resolve_mode(
            comp.cudagraph_mode,
            attention_cg_support(runner),
            enforce_eager=comp.enforce_eager,
            backend=f"attention backend {getattr(runner.attn_backend, 'name', '?')!r}",
        )
        self.mode: CUDAGraphMode = self.resolution.mode
        self.table = DispatchTable(
            self.resolution,
            list(comp.cudagraph_capture_sizes) if comp.cudagraph_capture_sizes else None,
            max_num_reqs=runner.max_num_reqs,
            max_num_batched_tokens=runner.max_num_tokens,
            uniform_decode_query_len=runner.uniform_decode_query_len,
        )
        self.debug = comp.debug_cudagraphs
        self.pool: GraphPool | None = None
        self.full_graphs: dict[tuple[BatchExecutionDescriptor, SamplingFeatures], FullGraph] = {}
        self.captured = False
        self.generation = 0  # bumped by every capture and release: plans holding graphs compare it

    # ---- per step -----------------------------------------------------------------
    def dispatch(self, num_reqs: int, num_tokens: int, uniform_token_count: int | None) -> BatchExecutionDescriptor:
        """The plan of a step: NONE with real sizes until capture has run."""
        if not self.captured:
            return BatchExecutionDescriptor(CUDAGraphMode.NONE, num_tokens, num_reqs)
        return self.table.dispatch(num_reqs, num_tokens, uniform_token_count)

    def full_graph(self, desc: BatchExecutionDescriptor, features: SamplingFeatures) -> FullGraph:
        """The captured FULL graph that serves `desc` for a batch needing `features`."""
        return self.full_graphs[(desc, sampling_variant(features))]

    def replay_full(self, desc: BatchExecutionDescriptor, features: SamplingFeatures) -> None:
        self.full_graph(desc, features).replay()

    # ---- start-up -----------------------------------------------------------------
    def capture(self, *, inspect_nodes: bool = False, progress: bool = True) -> CaptureReport:
        """Capture every descriptor of the table: largest first, PIECEWISE before FULL."""
        runner = self.runner
        if runner.req_states.num_live:
            raise RuntimeError(
                f"capture_model() needs an idle runner; {runner.req_states.num_live} requests are live "
                "(capture runs dummy steps that write KV block 0)"
            )
        report = CaptureReport(mode=self.mode.name, device=str(runner.device))
        descriptors = [d for d in self.table.descriptors if not d.is_eager]
        if not descriptors:
            logger.warning("cudagraph mode %s: nothing to capture; every step runs eagerly", self.mode.name)
            return report
        self.release()
        self.pool = GraphPool(runner.device)
        work = [(d, None) for d in descriptors if d.is_piecewise]
        work += [(d, v) for d in descriptors if d.is_full for v in SAMPLING_VARIANTS]
        free_before = self.pool.free_bytes()
        start = time.perf_counter()
        gc.collect()
        if runner.device.type == "cuda":
            torch.cuda.empty_cache()
        if runner.has_compiled_model:
            report.compile_seconds = runner.compile_piecewise()
        gc.freeze()  # a GC pass during capture would walk (and time) every frozen object
        try:
            bar = _progress(work, progress)
            for desc, variant in bar:
                label = str(desc) if variant is None else f"{desc}[{variant_name(variant)}]"
                if hasattr(bar, "set_postfix_str"):
                    bar.set_postfix_str(f"{label} free={self.pool.free_bytes() / (1 << 30):.1f}GiB")
                if variant is None:
                    report.records.append(runner.capture_piecewise_size(desc, self.pool, label))
                else:
                    graph = FullGraph(
                        label,
                        runner.make_full_step(desc, variant),
                        self.pool,
                        static_tensors=runner.static_tensors,
                        check_invariants=runner.check_padding_invariants,
                        debug=self.debug,
                    )
                    report.records.append(graph.capture(inspect_nodes=inspect_nodes))
                    self.full_graphs[(desc, variant)] = graph
                runner.reset_scratch_row()
        finally:
            gc.unfreeze()
        self.captured = True
        self.generation += 1
        report.total_seconds = time.perf_counter() - start - report.compile_seconds
        report.free_memory_delta_bytes = free_before - self.pool.free_bytes()
        logger.info("captured %d graphs in %.2f s (%s)", report.num_graphs, report.total_seconds, self.mode.name)
        return report

    def release(self) -> None:
        """Drop every graph and the pool (before process groups go; lifecycle rule)."""
        for graph in self.full_graphs.values():
            graph.release()
        self.full_graphs.clear()
        self.runner.release_piecewise()
        if self.pool is not None:
            self.pool.release()
            self.pool = None
        self.captured = False
        self.generation += 1


def _progress(items: list, enabled: bool):
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency, but capture must not hinge on a progress bar
        return items
    return tqdm(items, desc="capturing graphs", unit="graph", leave=False)
