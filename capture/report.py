"""CaptureReport: what capture cost, per descriptor and in total."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

_GIB = float(1 << 30)


@dataclass
class CaptureRecord:
    """One captured graph (a FULL step graph or the pieces of one PIECEWISE size)."""

    key: str  # descriptor (and variant) in its short string form
    seconds: float
    pool_bytes: int  # growth of reserved device memory while capturing this graph
    num_nodes: int | None = None  # graph nodes, where the torch version can tell
    kernels: dict[str, int] = field(default_factory=dict)  # kernel name -> count in the graph

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class CaptureReport:
    """Returned by `ModelRunner.capture_model()`; printed by `graphrunner inspect capture`."""

    mode: str
    device: str
    records: list[CaptureRecord] = field(default_factory=list)
    total_seconds: float = 0.0  # capture only (compile excluded)
    compile_seconds: float = 0.0  # torch.compile of the PIECEWISE pieces, once
    free_memory_delta_bytes: int = 0  # device memory the whole capture took (free before - free after)

    @property
    def num_graphs(self) -> int:
        return len(self.records)

    @property
    def pool_bytes(self) -> int:
        return sum(r.pool_bytes for r in self.records)

    def kernel_histogram(self) -> Counter:
        hist: Counter = Counter()
        for r in self.records:
            hist.update(r.kernels)
        return hist

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "device": self.device,
            "num_graphs": self.num_graphs,
            "total_seconds": self.total_seconds,
            "compile_seconds": self.compile_seconds,
            "pool_bytes": self.pool_bytes,
            "free_memory_delta_bytes": self.free_memory_delta_bytes,
            "records": [r.to_dict() for r in self.records],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        lines = [f"{'graph':<34} {'seconds':>8} {'pool MiB':>9} {'nodes':>6}"]
        for r in self.records:
            nodes = "-" if r.num_nodes is None else str(r.num_nodes)
            lines.append(f"{r.key:<34} {r.seconds:>8.3f} {r.pool_bytes / (1 << 20):>9.1f} {nodes:>6}")
        lines.append(
            f"{self.num_graphs} graphs ({self.mode}) on {self.device} in {self.total_seconds:.2f} s "
            f"(+ {self.compile_seconds:.2f} s compile); "
            f"pool {self.pool_bytes / _GIB:.3f} GiB; free memory -{self.free_memory_delta_bytes / _GIB:.3f} GiB"
        )
        return "\n".join(lines)


def parse_graph_dot(text: str) -> tuple[int, dict[str, int]]:
    """Node count and kernel-name histogram from a `cudaGraphDebugDotPrint` DOT dump.

    The dump labels each node with its type and, for kernels, the (mangled) function
    name; the exact layout differs across CUDA versions, so this is a tolerant scan.
    """
    nodes = 0
    kernels: Counter = Counter()
    for line in text.splitlines():
        s = line.strip()
        if "->" in s or "[" not in s or s.startswith(("graph", "node", "edge", "subgraph", "digraph")):
            continue
        nodes += 1
        name = _kernel_name(s)
        if name:
            kernels[name] += 1
    return nodes, dict(kernels)


_FUNC = re.compile(r"(?:func|name|Function)\s*[:=]?\s*\\?\"?([A-Za-z_][A-Za-z0-9_:<>]*)")


def _kernel_name(node_line: str) -> str | None:
    if "KERNEL" not in node_line.upper():
        return None
    m = _FUNC.search(node_line)
    if m:
        return _demangle_short(m.group(1))
    # Fall back to the longest identifier on the line (a mangled symbol).
    idents = re.findall(r"_Z\w+|[A-Za-z_]\w{6,}", node_line)
    return _demangle_short(max(idents, key=len)) if idents else "kernel"


def _demangle_short(name: str) -> str:
    """A readable short name for a mangled C++ symbol (no external demangler)."""
    m = re.match(r"_Z(?:N\d*\w*?)?(\d+)(\w+)", name)
    if m:
        n = int(m.group(1))
        rest = m.group(2)
        if len(rest) >= n:
            return rest[:n]
    return name


def read_graph_dot(path: str | Path) -> tuple[int, dict[str, int]]:
    return parse_graph_dot(Path(path).read_text(errors="replace"))
