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
            f"pool {self.pool_bytes / _GIB:.3f} GiB; "
            f"device memory in use +{self.free_memory_delta_bytes / _GIB:.3f} GiB"
        )
        return "\n".join(lines)


_DOT_NODE = re.compile(r'"(\w+_node_\d+)"\s*\[(.*?)\];', re.DOTALL)
_NODE_TYPE = re.compile(r'label="\{(\w+)')
_KERNEL_FUNC = re.compile(r"\{ID \| \d+ \(topoId: \d+\) \| ([^\\<}|]+)")


def parse_graph_dot(text: str) -> tuple[int, dict[str, int]]:
    """Node count and kernel-name histogram from a `cudaGraphDebugDotPrint` DOT dump.

    Each node is `"graph_G_node_N"[... label="{TYPE | {ID | n (topoId: m) | name<<<grid>>>} ..."]`;
    kernel names are mangled C++ symbols for library kernels, plain for Triton ones.
    """
    nodes = 0
    kernels: Counter = Counter()
    for match in _DOT_NODE.finditer(text):
        nodes += 1
        body = match.group(2)
        node_type = _NODE_TYPE.search(body)
        if node_type is None or node_type.group(1) != "KERNEL":
            continue
        func = _KERNEL_FUNC.search(body)
        kernels[short_kernel_name(func.group(1).strip()) if func else "kernel"] += 1
    return nodes, dict(kernels)


def short_kernel_name(symbol: str) -> str:
    """The function's own name from an Itanium-mangled symbol (`_ZN2at6native9fooKernelI...` -> fooKernel)."""
    if not symbol.startswith("_Z"):
        return symbol
    i = 3 if symbol.startswith("_ZN") else 2
    name = symbol
    while i < len(symbol) and symbol[i].isdigit():
        j = i
        while j < len(symbol) and symbol[j].isdigit():
            j += 1
        n = int(symbol[i:j])
        name = symbol[j : j + n]
        i = j + n
    return name


def read_graph_dot(path: str | Path) -> tuple[int, dict[str, int]]:
    return parse_graph_dot(Path(path).read_text(errors="replace"))
