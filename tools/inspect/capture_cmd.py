"""`inspect capture`: capture a runner's graphs with node inspection and show what it cost.

The runner is built the way `bench capture` builds it (tools/bench/common.py: dummy
weights, the smallest legal KV cache, since capture's dummy steps only touch block 0),
then `capture_model(inspect_nodes=True)` returns the `CaptureReport`: per graph seconds,
pool memory and node count, and kernel names (CUDA graphs only). With
`--speculative-config` the runner speculates: the report lists the verifying graphs and
attributes nodes to the drafter (drafter.py). Each captured FULL graph's DOT dump is read
again for its node order: nodes per decoder layer and kernel families (node_families.py).
`--dot DESC FILE`
writes one captured FULL graph as Graphviz DOT; that needs a real CUDA graph, so on a
CPU (where FULL graphs are emulated) it is refused before anything is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from capture.modes import CUDAGraphMode
from capture.report import CaptureReport, GraphNode
from graphrunner_tools.inspect.node_families import (
    GraphNodeSummary,
    node_family_lines,
    rules_dict,
    smallest_decode_graph,
    summarize,
)
from graphrunner_tools.inspect.render import descriptor_dict
from graphrunner_tools.inspect.speculation import Speculation

if TYPE_CHECKING:
    import torch

    from graphrunner.runner import ModelRunner


@dataclass(frozen=True)
class CaptureSpec:
    """What `run_capture` builds and captures; capture_sizes None = the default ladder."""

    model: str = "builtin:qwen2.5-0.5b"
    device: str | None = None
    dtype: str = "auto"
    mode: str = "FULL_AND_PIECEWISE"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 1024
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # CacheConfig.cache_dtype: "auto" (the model's dtype), "fp8", "fp8_e4m3"
    capture_sizes: tuple[int, ...] | None = None
    compile_backend: str | None = None  # None: inductor on CUDA, eager on CPU
    load_format: str = "auto"
    seed: int = 0
    speculative_config: str | None = None  # JSON, as `--speculative-config` takes it; None: off
    dot: tuple[str, str] | None = None  # (descriptor key, output path)
    progress: bool = False

    def __post_init__(self) -> None:
        CUDAGraphMode.parse_capturing(self.mode)
        if self.capture_sizes is not None:
            object.__setattr__(self, "capture_sizes", tuple(self.capture_sizes))

    @property
    def speculation(self) -> Speculation:
        return Speculation.from_config_text(self.speculative_config)


@dataclass
class CaptureResult:
    spec: CaptureSpec
    env: dict
    capture_sizes: tuple[int, ...]
    descriptors: list[dict]
    load_seconds: float
    report: CaptureReport
    dot_written: str | None = None
    notes: list[str] = field(default_factory=list)
    speculative: dict[str, Any] | None = None  # drafter.speculative_capture's summary; None: no speculation
    num_layers: int = 0  # the model's num_hidden_layers
    # The paged cache the graphs read: storage dtype, blocks, tokens per block, bytes per block.
    kv_cache: dict[str, Any] = field(default_factory=dict)
    node_summaries: list[GraphNodeSummary] = field(default_factory=list)  # one per report record

    @property
    def default_graph(self) -> str | None:
        """The graph whose node families the text shows without --all-graphs."""
        return smallest_decode_graph(self.descriptors, self.report.records)

    def to_dict(self, top: int) -> dict[str, Any]:
        hist = self.report.kernel_histogram()
        return {
            "kind": "inspect-capture",
            "model": self.spec.model,
            "requested_mode": self.spec.mode,
            "env": self.env,
            "capture_sizes": list(self.capture_sizes),
            "descriptors": self.descriptors,
            "load_seconds": self.load_seconds,
            "report": self.report.to_dict(),
            "kernel_histogram": [{"kernel": k, "count": n} for k, n in hist.most_common(top)],
            "kernel_nodes": sum(hist.values()),
            "speculative": self.speculative,
            "kv_cache": self.kv_cache,
            "node_families": {
                "num_hidden_layers": self.num_layers,
                "default_graph": self.default_graph,
                "rules": rules_dict(),
                "graphs": [s.to_dict() for s in self.node_summaries],
            },
            "dot": self.dot_written,
            "notes": self.notes,
        }


def normalize_key(key: str) -> str:
    return "".join(key.split()).lower()


def check_dot_device(device_type: str) -> None:
    if device_type != "cuda":
        raise ValueError(
            f"--dot needs real CUDA graphs (a cuda device), but the device is {device_type}: on a CPU, FULL "
            "graphs are emulated by re-running the step, so there is no graph to dump"
        )


def build_runner(spec: CaptureSpec, device: torch.device) -> tuple[ModelRunner, float]:
    """`bench capture`'s runner (dummy weights, one full-length request's KV blocks),
    speculating as `spec.speculative_config` says: (runner, load seconds)."""
    from graphrunner_tools.bench.capture_bench import build_loaded_runner

    return build_loaded_runner(spec, device)


def run_capture(spec: CaptureSpec) -> CaptureResult:
    """Build, capture with node inspection, attribute the drafter's nodes, optionally write
    one DOT, shut down."""
    from graphrunner_tools.bench.common import env_info, release_memory, resolve_device
    from graphrunner_tools.inspect.drafter import speculative_capture

    device = resolve_device(spec.device)
    if spec.dot is not None:
        check_dot_device(device.type)  # before minutes of loading and capture
    speculation = spec.speculation
    runner, load_seconds = build_runner(spec, device)
    try:
        graphs = runner.graphs
        assert graphs is not None
        dot_key = dot_graph_key(spec.dot[0], [str(d) for d in graphs.table.descriptors]) if spec.dot else None
        try:
            report = runner.capture_model(inspect_nodes=True, progress=spec.progress)
        except NotImplementedError as e:
            raise ValueError(f"mode {graphs.mode.name} cannot be captured by this runner: {e}") from None
        result = CaptureResult(
            spec,
            env_info(device, spec.dtype),
            tuple(graphs.table.capture_sizes),
            [descriptor_dict(d) for d in graphs.table.descriptors],
            load_seconds,
            report,
        )
        shape = runner.kv_cache_shape
        result.kv_cache = {"dtype": str(shape.dtype).removeprefix("torch."), "cache_dtype": spec.kv_cache_dtype,
                           "num_blocks": runner.buffers.kv_caches[0].shape[1] if runner.buffers.kv_caches else 0,
                           "block_size": shape.block_size, "block_bytes": shape.block_bytes}
        if device.type != "cuda":
            result.notes.append(
                "CPU: FULL graphs are emulated (no CUDA graph), so node counts and kernel names are empty"
            )
        elif not report.kernel_histogram():
            result.notes.append("no kernel names: this torch/CUDA version gave no graph node dump")
        add_node_summaries(result, runner, device.type)
        if speculation.k:
            result.speculative = speculative_capture(runner, report, speculation)
        if spec.dot is not None:
            assert dot_key is not None
            result.dot_written = write_dot(runner, spec.dot, dot_key)
        return result
    finally:
        runner.shutdown()
        del runner
        release_memory(device)


def dump_graph_nodes(runner: ModelRunner) -> dict[str, list[GraphNode]]:
    """Each captured FULL graph's nodes in execution order, its DOT dump read again (CUDA,
    captured with inspect_nodes=True); a graph whose dump fails is left out."""
    import tempfile
    from pathlib import Path

    from capture.report import read_graph_nodes

    graphs = runner.graphs
    assert graphs is not None
    out: dict[str, list[GraphNode]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, graph in enumerate(graphs.full_graphs.values()):
            path = Path(tmp) / f"{i}.dot"
            try:
                graph.write_dot(path)
                out[graph.key] = read_graph_nodes(path)
            except Exception:  # best effort, as capture's own node dump: the summary says so
                continue
            finally:
                path.unlink(missing_ok=True)
    return out


def add_node_summaries(result: CaptureResult, runner: ModelRunner, device_type: str) -> None:
    """Nodes per layer and kernel families of every captured graph, into `result`."""
    result.num_layers = runner.model_config.num_hidden_layers
    nodes = dump_graph_nodes(runner) if device_type == "cuda" else {}
    result.node_summaries = [summarize(r, result.num_layers, nodes.get(r.key), device_type)
                             for r in result.report.records]
    if device_type == "cuda" and result.spec.speculation.k:
        result.notes.append("the FULL graphs hold the drafter's nodes too: nodes per layer count them")


def write_dot(runner: ModelRunner, dot: tuple[str, str], dot_key: str) -> str:
    """Write the captured FULL graph named by `dot` = (key as given, path); returns the path."""
    graphs = runner.graphs
    assert graphs is not None
    graph = next((g for g in graphs.full_graphs.values() if normalize_key(g.key) == dot_key), None)
    if graph is None:  # dot_graph_key checked the descriptor; only the variant can be missing
        keys = sorted(g.key for g in graphs.full_graphs.values())
        raise ValueError(f"--dot {dot[0]!r}: no captured FULL graph with that key; captured: {keys}")
    graph.write_dot(dot[1])
    return str(dot[1])


def dot_graph_key(text: str, descriptor_keys: list[str]) -> str:
    """The normalized FullGraph key for `text` ("FULL(t=8,r=8,q=1)[greedy]"; no variant = greedy).

    Checked against the table before capture so that a typo costs nothing.
    """
    key = normalize_key(text)
    base, _, variant = key.partition("[")
    variant = variant.rstrip("]") or "greedy"
    full = sorted(k for k in descriptor_keys if k.startswith("FULL("))
    if base not in {normalize_key(k) for k in full}:
        if base in {normalize_key(k) for k in descriptor_keys}:
            raise ValueError(
                f"--dot {text!r} is a PIECEWISE descriptor: only FULL graphs are dumped (PIECEWISE captures one "
                "graph per compiled piece)"
            )
        raise ValueError(f"--dot {text!r} is not a FULL descriptor of this table; FULL descriptors: {full}")
    if variant not in ("greedy", "sampled", "all"):
        raise ValueError(f"--dot {text!r}: variant [{variant}] must be [greedy], [sampled] or [all]")
    return f"{base}[{variant}]"


def kv_cache_lines(kv: dict[str, Any]) -> list[str]:
    """The KV cache line of the text report (none when the runner had no cache)."""
    if not kv:
        return []
    return [f"KV cache: {kv['dtype']} (kv_cache_dtype={kv['cache_dtype']}), {kv['num_blocks']} blocks x "
            f"{kv['block_size']} tokens, {kv['block_bytes']} bytes per block"]


def capture_text(result: CaptureResult, top: int, all_graphs: bool = False) -> str:
    from graphrunner_tools.bench.report import env_lines
    from graphrunner_tools.inspect.drafter import speculative_lines

    r = result.report
    graphs = f"model load {result.load_seconds:.2f} s; {len(result.descriptors)} descriptors, {r.num_graphs} graphs"
    if any(d["cg_mode"] == "FULL" for d in result.descriptors):
        graphs += " (a FULL descriptor is captured once per sampling variant: [greedy], [sampled] and [all])"
    lines = [
        f"graph capture: {result.spec.model}, mode {result.spec.mode} (resolved {r.mode})",
        *env_lines(result.env),
        f"capture sizes: {list(result.capture_sizes)}",
        *kv_cache_lines(result.kv_cache),
        graphs,
        *speculative_lines(result.speculative, result.spec.speculation),
        "",
        str(r),
    ]
    node_lines = node_family_lines(result.node_summaries, result.default_graph, all_graphs)
    if node_lines:
        lines += ["", *node_lines]
    hist = r.kernel_histogram()
    if hist:
        lines += ["", f"kernel histogram, top {top} (of {sum(hist.values())} kernel nodes in {len(hist)} kernels):"]
        lines += [f"  {n:7d}  {name}" for name, n in hist.most_common(top)]
    lines += [f"note: {n}" for n in result.notes]
    if result.dot_written:
        lines.append(f"DOT written to {result.dot_written}")
    return "\n".join(lines)
