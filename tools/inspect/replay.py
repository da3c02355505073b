"""`inspect replay`: the step latency of a FULL-graph replay beside the same batch run eagerly.

For each size s, s decode requests are admitted and stepped exactly as `bench latency`
does it (tools/bench/latency.py is reused whole): once by a runner that captured a FULL
graph for every chosen size, once by an eager runner. The capture sizes are the chosen
sizes, so each batch replays the graph of its own size with no padding: the padded
batch the graph runs *is* the batch the eager runner runs, and the two timings compare
the same work. A timed step is `execute_model` + `sample_tokens`; the reported figure is
the median over CUDA events on a GPU and over perf_counter on a CPU (where FULL graphs
are emulated, so the ratio is ~1 by construction and only the plumbing is exercised).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from capture.modes import CUDAGraphMode

# The bench's copy-bandwidth probe runs inside run_latency; replay reports no roofline,
# so a token-sized probe keeps it out of the way.
_PROBE_BYTES = 1 << 20


@dataclass(frozen=True)
class ReplaySpec:
    """mode: any mode with FULL graphs; FULL_DECODE_ONLY captures only what decode batches replay."""

    model: str = "builtin:qwen2.5-0.5b"
    device: str | None = None
    dtype: str = "auto"
    mode: str = "FULL_DECODE_ONLY"
    sizes: tuple[int, ...] = (1, 8, 32)
    context: int = 1024
    steps: int = 20
    warmup: int = 3
    block_size: int = 16
    compile_backend: str | None = None
    load_format: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(self.sizes))
        mode = CUDAGraphMode.parse(self.mode)
        if not mode.has_full_graphs:
            allowed = [m.name for m in CUDAGraphMode if m.has_full_graphs]
            raise ValueError(f"replay times FULL graphs, but mode={mode.name} captures none; allowed: {allowed}")
        if not self.sizes or any(s < 1 for s in self.sizes):
            raise ValueError(f"sizes={list(self.sizes)} must be non-empty, each >= 1")


@dataclass
class ReplayRow:
    """One size: the graph the batch replayed and the two medians (milliseconds)."""

    size: int
    descriptor: str  # what the graph runner dispatched the batch to
    eager_descriptor: str
    replayed_full: bool  # False: the batch did not hit a FULL graph (then the ratio means little)
    replay_ms: float
    eager_ms: float
    speedup: float  # eager_ms / replay_ms: > 1 when the replay is faster
    replay_host_ms: float  # host clock around the same region
    eager_host_ms: float
    timer: str  # "cuda events" or "perf_counter"


@dataclass
class ReplayResult:
    spec: ReplaySpec
    env: dict
    rows: list[ReplayRow] = field(default_factory=list)
    resolved_mode: str | None = None
    capture_seconds: float | None = None
    num_graphs: int | None = None
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "inspect-replay",
            "spec": asdict(self.spec),
            "env": self.env,
            "resolved_mode": self.resolved_mode,
            "capture_seconds": self.capture_seconds,
            "num_graphs": self.num_graphs,
            "rows": [asdict(r) for r in self.rows],
            "errors": self.errors,
        }


def run_replay(spec: ReplaySpec, log: Callable[[str], None]) -> ReplayResult:
    """Time every size under the graph mode and eagerly; a failed mode is recorded in `errors`."""
    from graphrunner_tools.bench.latency import LatencySpec, run_latency

    mode = CUDAGraphMode.parse(spec.mode).name
    latency = run_latency(
        LatencySpec(
            model=spec.model,
            batch_sizes=spec.sizes,
            context=spec.context,
            modes=(mode, "NONE"),
            dtype=spec.dtype,
            device=spec.device,
            steps=spec.steps,
            warmup=spec.warmup,
            block_size=spec.block_size,
            capture_sizes=None,  # exactly the chosen sizes: no padding, same batch both ways
            compile_backend=spec.compile_backend,
            load_format=spec.load_format,
            seed=spec.seed,
            copy_bytes=_PROBE_BYTES,
        ),
        log=log,
    )
    result = ReplayResult(spec, latency.env, errors=list(latency.errors))
    graph_info = next(m for m in latency.modes if m.mode == mode)
    result.resolved_mode = graph_info.resolved_mode
    result.capture_seconds = graph_info.capture_seconds
    result.num_graphs = graph_info.num_graphs
    graph_rows = {r.batch_size: r for r in latency.rows if r.mode == mode}
    eager_rows = {r.batch_size: r for r in latency.rows if r.mode == "NONE"}
    for size in spec.sizes:
        g, e = graph_rows.get(size), eager_rows.get(size)
        if g is None or e is None:
            continue  # its mode failed: reported in errors
        use_events = g.device_median_ms is not None and e.device_median_ms is not None
        replay_ms = g.device_median_ms if use_events else g.median_ms
        eager_ms = e.device_median_ms if use_events else e.median_ms
        result.rows.append(
            ReplayRow(
                size=size,
                descriptor=g.descriptor,
                eager_descriptor=e.descriptor,
                replayed_full=g.descriptor.startswith("FULL("),
                replay_ms=replay_ms,  # type: ignore[arg-type]
                eager_ms=eager_ms,  # type: ignore[arg-type]
                speedup=eager_ms / replay_ms,  # type: ignore[operator]
                replay_host_ms=g.median_ms,
                eager_host_ms=e.median_ms,
                timer="cuda events" if use_events else "perf_counter",
            )
        )
    return result


def replay_text(result: ReplayResult) -> str:
    from graphrunner_tools.bench.report import env_lines
    from graphrunner_tools.inspect.render import text_table

    s = result.spec
    lines = [
        f"replay vs eager: {s.model}, mode {s.mode} (resolved {result.resolved_mode}), decode batches at context "
        f"{s.context}, median of {s.steps} steps after {s.warmup} warmup",
        *env_lines(result.env),
    ]
    if result.capture_seconds is not None:
        lines.append(f"captured {result.num_graphs} graphs in {result.capture_seconds:.2f} s (capture sizes = sizes)")
    rows = []
    for r in result.rows:
        graph = r.descriptor if r.replayed_full else f"{r.descriptor} (no FULL graph)"
        rows.append((str(r.size), graph, f"{r.replay_ms:.3f}", f"{r.eager_ms:.3f}", f"{r.speedup:.2f}x",
                     f"{r.replay_host_ms:.3f}", f"{r.eager_host_ms:.3f}"))
    timer = result.rows[0].timer if result.rows else "-"
    lines += [
        f"timer: {timer}; speedup = eager / replay; host ms = perf_counter around the same region",
        "",
        text_table(("size", "graph", "replay ms", "eager ms", "speedup", "replay host ms", "eager host ms"), rows,
                   numeric=(True, False, True, True, True, True, True)),
    ]
    lines += [f"FAILED: {err}" for err in result.errors]
    return "\n".join(lines)
