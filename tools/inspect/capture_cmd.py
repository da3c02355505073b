"""`inspect capture`: capture a runner's graphs with node inspection and show what it cost.

The runner is built the way `bench capture` builds it (tools/bench/common.py: dummy
weights, the smallest legal KV cache, since capture's dummy steps only touch block 0),
then `capture_model(inspect_nodes=True)` returns the `CaptureReport`: per graph seconds,
pool memory and node count, and kernel names (CUDA graphs only). `--dot DESC FILE`
writes one captured FULL graph as Graphviz DOT; that needs a real CUDA graph, so on a
CPU (where FULL graphs are emulated) it is refused before anything is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from capture.modes import CUDAGraphMode
from capture.report import CaptureReport
from graphrunner_tools.inspect.render import descriptor_dict


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
    capture_sizes: tuple[int, ...] | None = None
    compile_backend: str | None = None  # None: inductor on CUDA, eager on CPU
    load_format: str = "auto"
    seed: int = 0
    dot: tuple[str, str] | None = None  # (descriptor key, output path)
    progress: bool = False

    def __post_init__(self) -> None:
        CUDAGraphMode.parse_capturing(self.mode)
        if self.capture_sizes is not None:
            object.__setattr__(self, "capture_sizes", tuple(self.capture_sizes))


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


def run_capture(spec: CaptureSpec) -> CaptureResult:
    """Build, capture with node inspection, optionally write one DOT, shut down."""
    from graphrunner_tools.bench.capture_bench import build_loaded_runner
    from graphrunner_tools.bench.common import env_info, release_memory, resolve_device

    device = resolve_device(spec.device)
    if spec.dot is not None:
        check_dot_device(device.type)  # before minutes of loading and capture
    runner, load_seconds = build_loaded_runner(spec, device)
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
        if device.type != "cuda":
            result.notes.append(
                "CPU: FULL graphs are emulated (no CUDA graph), so node counts and kernel names are empty"
            )
        elif not report.kernel_histogram():
            result.notes.append("no kernel names: this torch/CUDA version gave no graph node dump")
        if spec.dot is not None:
            graph = next((g for g in graphs.full_graphs.values() if normalize_key(g.key) == dot_key), None)
            if graph is None:  # dot_graph_key checked the descriptor; only the variant can be missing
                keys = sorted(g.key for g in graphs.full_graphs.values())
                raise ValueError(f"--dot {spec.dot[0]!r}: no captured FULL graph with that key; captured: {keys}")
            graph.write_dot(spec.dot[1])
            result.dot_written = str(spec.dot[1])
        return result
    finally:
        runner.shutdown()
        del runner
        release_memory(device)


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


def capture_text(result: CaptureResult, top: int) -> str:
    from graphrunner_tools.bench.report import env_lines

    r = result.report
    graphs = f"model load {result.load_seconds:.2f} s; {len(result.descriptors)} descriptors, {r.num_graphs} graphs"
    if any(d["cg_mode"] == "FULL" for d in result.descriptors):
        graphs += " (a FULL descriptor is captured once per sampling variant: [greedy], [sampled] and [all])"
    lines = [
        f"graph capture: {result.spec.model}, mode {result.spec.mode} (resolved {r.mode})",
        *env_lines(result.env),
        f"capture sizes: {list(result.capture_sizes)}",
        graphs,
        "",
        str(r),
    ]
    hist = r.kernel_histogram()
    if hist:
        lines += ["", f"kernel histogram, top {top} (of {sum(hist.values())} kernel nodes in {len(hist)} kernels):"]
        lines += [f"  {n:7d}  {name}" for name, n in hist.most_common(top)]
    lines += [f"note: {n}" for n in result.notes]
    if result.dot_written:
        lines.append(f"DOT written to {result.dot_written}")
    return "\n".join(lines)
