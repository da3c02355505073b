"""CaptureReport: what capture cost, per descriptor and in total; the parsing of graph node dumps."""

from __future__ import annotations

import heapq
import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

_GIB = float(1 << 30)


@dataclass
class CaptureRecord:
    """One captured graph (a FULL step graph or the pieces of one PIECEWISE size)."""

    key: str  # descriptor (and variant) in its short string form
    seconds: float
    pool_bytes: int  # growth of reserved device memory while capturing this graph
    num_nodes: int | None = None  # graph nodes, where the torch version can tell
    kernels: dict[str, int] = field(default_factory=dict)  # kernel name -> count in the graph
    # Triton kernels specialized (compiled, or loaded from its disk cache) while capturing this graph:
    # first launches of a new (kernel, constexprs) pair (capture.jit_events); None: not counted.
    jit_kernels: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class NodeAttribution:
    """The nodes of one captured graph that belong to a named part of its step.

    Measured by whoever knows the part (the report only holds plain data): the same step
    captured with and without the part; `num_nodes` and `kernels` are the difference,
    None / empty when no node list was available (`note` says why).
    """

    part: str  # what the nodes belong to, e.g. "drafter"
    graph: str  # the graph key it was measured on
    num_nodes: int | None = None
    graph_nodes: int | None = None  # all nodes of that graph, part included
    kernels: dict[str, int] = field(default_factory=dict)  # kernel name -> count in the part
    note: str = ""

    @classmethod
    def between(cls, part: str, with_part: CaptureRecord, without_part: CaptureRecord,
                note: str = "") -> NodeAttribution:
        """The part's nodes: `with_part` minus `without_part` (None if either has no node list)."""
        if with_part.num_nodes is None or without_part.num_nodes is None:
            return cls(part, with_part.key, None, with_part.num_nodes, {}, note or "no node list for this graph")
        kernels = Counter(with_part.kernels)
        kernels.subtract(without_part.kernels)
        return cls(part, with_part.key, with_part.num_nodes - without_part.num_nodes, with_part.num_nodes,
                   {k: n for k, n in sorted(kernels.items()) if n}, note)

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        if self.num_nodes is None:
            return f"{self.part}: nodes unavailable in {self.graph} ({self.note})"
        kernels = ", ".join(f"{k} x{n}" if n != 1 else k for k, n in self.kernels.items()) or "none"
        text = f"{self.part}: {self.num_nodes} nodes of {self.graph}'s {self.graph_nodes} (kernels: {kernels})"
        return text + (f"; {self.note}" if self.note else "")


@dataclass
class CaptureReport:
    """Returned by `ModelRunner.capture_model()`; printed by `graphrunner inspect capture`."""

    mode: str
    device: str
    records: list[CaptureRecord] = field(default_factory=list)
    total_seconds: float = 0.0  # capture only (compile excluded)
    compile_seconds: float = 0.0  # torch.compile of the PIECEWISE pieces, once
    free_memory_delta_bytes: int = 0  # device memory the whole capture took (free before - free after)
    attributions: list[NodeAttribution] = field(default_factory=list)  # parts of the step, by their nodes

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
            "attributions": [a.to_dict() for a in self.attributions],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        lines = [f"{'graph':<34} {'seconds':>8} {'pool MiB':>9} {'nodes':>6} {'jit':>4}"]
        for r in self.records:
            nodes = "-" if r.num_nodes is None else str(r.num_nodes)
            jit = "-" if r.jit_kernels is None else str(r.jit_kernels)
            lines.append(f"{r.key:<34} {r.seconds:>8.3f} {r.pool_bytes / (1 << 20):>9.1f} {nodes:>6} {jit:>4}")
        lines.append(
            f"{self.num_graphs} graphs ({self.mode}) on {self.device} in {self.total_seconds:.2f} s "
            f"(+ {self.compile_seconds:.2f} s compile); "
            f"pool {self.pool_bytes / _GIB:.3f} GiB; "
            f"device memory in use +{self.free_memory_delta_bytes / _GIB:.3f} GiB"
        )
        lines += [str(a) for a in self.attributions]
        return "\n".join(lines)


# A node statement; not the target of an edge statement (`"a" -> "b" [headlabel=0];`),
# which the same pattern would otherwise also match.
_DOT_NODE = re.compile(r'(?<!-> )"(\w+_node_\d+)"\s*\[(.*?)\];', re.DOTALL)
_DOT_EDGE = re.compile(r'"(\w+_node_\d+)"\s*->\s*"(\w+_node_\d+)"')
_NODE_INDEX = re.compile(r"(\d+)_node_(\d+)$")
_NODE_TYPE = re.compile(r'label="\{(\w+)')
_KERNEL_FUNC = re.compile(r"\{ID \| \d+ \(topoId: \d+\) \| ([^\\<}|]+)")
# The last name of a symbol says nothing when it is one of these (cutlass::Kernel2,
# internal::gemvx::kernel): keep the qualified name then.
_GENERIC_NAME = re.compile(r"[Kk]ernel\d*")


class GraphNode(NamedTuple):
    """One node of a captured graph: its CUDA node type and, for a KERNEL, the short kernel name."""

    kind: str  # KERNEL, MEMCPY, MEMSET, EMPTY, EVENT_RECORD, ... as the DOT dump names it
    name: str = ""  # short_kernel_name of a KERNEL node's function; "" for other types


def _dot_nodes(text: str) -> dict[str, GraphNode]:
    """Every node of a `cudaGraphDebugDotPrint` dump by its DOT id, in file order."""
    nodes = {}
    for match in _DOT_NODE.finditer(text):
        body = match.group(2)
        node_type = _NODE_TYPE.search(body)
        kind = node_type.group(1) if node_type else "UNKNOWN"
        name = ""
        if kind == "KERNEL":
            func = _KERNEL_FUNC.search(body)
            name = short_kernel_name(func.group(1).strip()) if func else "kernel"
        nodes[match.group(1)] = GraphNode(kind, name)
    return nodes


def parse_graph_dot(text: str) -> tuple[int, dict[str, int]]:
    """Node count and kernel-name histogram from a `cudaGraphDebugDotPrint` DOT dump.

    Each node is `"graph_G_node_N"[... label="{TYPE | {ID | n (topoId: m) | name<<<grid>>>} ..."]`;
    kernel names are mangled C++ symbols for library kernels, plain for Triton ones.
    """
    nodes = _dot_nodes(text).values()
    return len(nodes), dict(Counter(n.name for n in nodes if n.kind == "KERNEL"))


def parse_graph_nodes(text: str) -> list[GraphNode]:
    """The nodes of a DOT dump in execution order: a topological order of its edges, ties
    (nodes free to run at once) broken by capture order (the `node_N` index)."""
    nodes = _dot_nodes(text)

    def index(node_id: str) -> tuple[int, int]:
        m = _NODE_INDEX.search(node_id)
        return (int(m.group(1)), int(m.group(2))) if m else (0, 0)

    succ: dict[str, list[str]] = {n: [] for n in nodes}
    indegree = dict.fromkeys(nodes, 0)
    for a, b in _DOT_EDGE.findall(text):
        if a in nodes and b in nodes:
            succ[a].append(b)
            indegree[b] += 1
    ready = [(index(n), n) for n, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for m in succ[n]:
            indegree[m] -= 1
            if indegree[m] == 0:
                heapq.heappush(ready, (index(m), m))
    if len(order) < len(nodes):  # a cycle cannot come from a graph; keep every node anyway
        seen = set(order)
        order += sorted((n for n in nodes if n not in seen), key=index)
    return [nodes[n] for n in order]


def short_kernel_name(symbol: str) -> str:
    """The function's own name from an Itanium-mangled symbol (`_ZN2at6native9fooKernelI...` -> fooKernel).

    A generic last name (`kernel`, `Kernel2`) keeps its scopes: `cutlass::Kernel2`,
    `internal::gemvx::kernel`. Unmangled names (Triton kernels, `sm90_xmma_...`) are kept.
    """
    if not symbol.startswith("_Z"):
        return symbol
    nested = symbol.startswith("_ZN")
    i = 3 if nested else 2
    names: list[str] = []
    while i < len(symbol) and symbol[i].isdigit() and (nested or not names):
        j = i
        while j < len(symbol) and symbol[j].isdigit():
            j += 1
        n = int(symbol[i:j])
        names.append(symbol[j : j + n])
        i = j + n
    if not names:
        return symbol
    return "::".join(names) if _GENERIC_NAME.fullmatch(names[-1]) else names[-1]


def read_graph_dot(path: str | Path) -> tuple[int, dict[str, int]]:
    return parse_graph_dot(Path(path).read_text(errors="replace"))


def read_graph_nodes(path: str | Path) -> list[GraphNode]:
    return parse_graph_nodes(Path(path).read_text(errors="replace"))
