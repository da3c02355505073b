"""Kernel families and nodes per decoder layer of captured graphs (`inspect capture`).

A decode step's cost is counted in graph nodes too: every node costs launch and drain time
even inside a CUDA graph. For each captured graph with a node list this module counts

- nodes per layer, two ways: the ratio `num_nodes / num_hidden_layers` (every node
  counted: embedding, LM head, sampling and input preparation too), and, when the
  node order is known (the graph's DOT dump), the nodes from one layer's attention
  kernel to the next layer's: the layers are delimited by the first attention-family
  kernel that occurs exactly once per layer (one attention call per decoder layer);
- kernel families: `FAMILY_RULES` below, an ordered list of regular expressions; a
  kernel node gets the family of the first rule whose pattern matches (re.search, any
  case) its short name (`capture.report.short_kernel_name`); a node that is not a kernel
  (MEMCPY, MEMSET, and any other type: EMPTY, EVENT_RECORD, ...) is `memcpy/memset`; a
  kernel no rule matches is `other`.

Plain data in, plain data and text out: no torch, nothing of `graphrunner`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from capture.report import CaptureRecord, GraphNode
from graphrunner_tools.inspect.render import pct, text_table

ATTENTION = "attention"
NON_KERNEL = "memcpy/memset"
OTHER = "other"
_NAMED = 4  # graphs named one by one in a "no node list" line; more are counted


@dataclass(frozen=True)
class FamilyRule:
    family: str
    pattern: str
    why: str

    def matches(self, kernel: str) -> bool:
        return re.search(self.pattern, kernel, re.IGNORECASE) is not None


# First match wins: a rule sits above every rule whose pattern would also match its kernels.
FAMILY_RULES: tuple[FamilyRule, ...] = (
    FamilyRule("nccl", r"nccl", "NCCL collectives; first, since ncclDevKernel_AllReduce_* also says Reduce"),
    FamilyRule(ATTENTION, r"^_(paged_attn|merge_splits|merge_states|write_kv|rope_write_kv)_kernel$|flash|fmha",
               "graphrunner/attention: paged attention, its split-KV merge, the LSE merge, the KV-cache write "
               "(alone, or fused with the rotary embedding)"),
    FamilyRule("moe", r"^_moe_\w+_kernel$",
               "graphrunner/layers/moe: routing, token-to-expert alignment, the grouped gate|up and down GEMMs, "
               "the top-k sum"),
    FamilyRule("sampling",
               r"^_(gumbel_argmax|threshold|pick|stats|plan|guess|pivot|compact|select|partial|combine|dense|sparse"
               r"|refresh|bitmask|refine|stream|reject_draw|reject_count|reject_decide)_kernel$",
               "graphrunner/sample: Triton sampling, the sort-free select, the split-row argmax, one-pass logprobs, "
               "the fused processors, token bitmasks"),
    FamilyRule("step inputs",
               r"^_(positions_seq_lens|input_ids|logits_indices|post_update|gather|slot_mapping|dcp_slot_mapping"
               r"|dcp_local_seq_lens|prepare_verify)_kernel$",
               "graphrunner/kernels and the verify preparation: the step's own input bookkeeping"),
    FamilyRule("triton fused", r"^triton_(?!tem_)|^_add_rms_norm_kernel$",
               "inductor's fused kernels (triton_poi_, triton_red_, triton_per_): norms, rotary, SiLU*mul, adds; "
               "graphrunner's residual add + RMSNorm (graphrunner/layers/norm.py)"),
    FamilyRule("reduce", r"reduce",
               "torch reductions (reduce_kernel) and cuBLAS split-K reduces (splitKreduce_kernel)"),
    FamilyRule("gemm/gemv", r"gemm|gemv|cutlass|xmma|cublas|nvjet|^triton_tem_",
               "cuBLAS / cuBLASLt / cutlass GEMMs and GEMVs (sm90_xmma_*, nvjet_*, gemv2T_kernel_val, "
               "cutlass::Kernel2), and inductor's GEMM templates (triton_tem_)"),
    FamilyRule("elementwise/copy", r"elementwise|copy|index|fill",
               "torch pointwise kernels and copies (vectorized_elementwise_kernel, elementwise_kernel, "
               "CatArrayBatchedCopy, index_select)"),
)
# Display order (largest share first in a decode step); every family of the rules, plus the two fallbacks.
FAMILIES: tuple[str, ...] = ("gemm/gemv", "moe", "triton fused", ATTENTION, "elementwise/copy", "reduce", "nccl",
                             NON_KERNEL, "sampling", "step inputs", OTHER)
assert {r.family for r in FAMILY_RULES} | {NON_KERNEL, OTHER} == set(FAMILIES)


def kernel_family(kernel: str) -> str:
    """The family of a kernel's short name: the first rule that matches, else `other`."""
    return next((r.family for r in FAMILY_RULES if r.matches(kernel)), OTHER)


def node_family(node: GraphNode) -> str:
    return kernel_family(node.name) if node.kind == "KERNEL" else NON_KERNEL


def _ordered(counts: Counter) -> dict[str, int]:
    return {f: counts[f] for f in FAMILIES}


def family_counts(nodes: Iterable[GraphNode]) -> dict[str, int]:
    """Nodes per family, every family listed (zeros included), in display order."""
    return _ordered(Counter(node_family(n) for n in nodes))


def histogram_family_counts(num_nodes: int, kernels: dict[str, int]) -> dict[str, int]:
    """The same from a record's kernel histogram: its non-kernel nodes are the rest of num_nodes."""
    counts: Counter = Counter()
    for name, n in kernels.items():
        counts[kernel_family(name)] += n
    counts[NON_KERNEL] += num_nodes - sum(kernels.values())
    return _ordered(counts)


@dataclass(frozen=True)
class LayerSpan:
    """The decoder layers of one graph, delimited by their attention kernel (`anchor`)."""

    anchor: str
    gaps: tuple[int, ...]  # nodes from each anchor to the next: num_layers - 1 of them
    families: dict[str, int]  # the nodes of one span of the typical length, by family

    @property
    def typical(self) -> int:
        """The most frequent gap (the smaller one on a tie)."""
        counts = Counter(self.gaps)
        return max(counts, key=lambda g: (counts[g], -g))

    def to_dict(self) -> dict[str, Any]:
        return {"anchor": self.anchor, "nodes_per_layer": self.typical, "min": min(self.gaps),
                "max": max(self.gaps), "gaps": list(self.gaps)}

    def line(self) -> str:
        gaps = (f"all {len(self.gaps)} gaps equal" if min(self.gaps) == max(self.gaps)
                else f"the most frequent of {len(self.gaps)} gaps, which range {min(self.gaps)}-{max(self.gaps)}")
        return f"{self.typical} nodes per layer from one layer's {self.anchor} to the next ({gaps})"


def delimit_layers(nodes: Sequence[GraphNode], num_layers: int) -> LayerSpan | str:
    """The layers of a graph in execution order, or why they cannot be delimited.

    The anchor is the first attention-family kernel (in node order) that occurs exactly
    `num_layers` times: every decoder layer calls attention once.
    """
    if num_layers < 2:
        return f"{num_layers} decoder layer: no two consecutive layers to count between"
    positions: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        if node.kind == "KERNEL" and kernel_family(node.name) == ATTENTION:
            positions.setdefault(node.name, []).append(i)
    for name, pos in positions.items():
        if len(pos) == num_layers:
            span = LayerSpan(name, tuple(b - a for a, b in pairwise(pos)), {})
            k = span.gaps.index(span.typical)
            return LayerSpan(name, span.gaps, family_counts(nodes[pos[k] : pos[k + 1]]))
    found = ", ".join(f"{name} x{len(pos)}" for name, pos in positions.items()) or "none"
    return f"no attention kernel occurs once per layer ({num_layers} layers; attention kernels: {found})"


@dataclass
class GraphNodeSummary:
    """Nodes, nodes per layer and kernel families of one captured graph (None / empty: no node list)."""

    graph: str
    num_layers: int
    num_nodes: int | None = None
    families: dict[str, int] = field(default_factory=dict)
    node_types: dict[str, int] = field(default_factory=dict)  # empty without the node order
    layers: LayerSpan | None = None
    note: str = ""  # why something is missing

    @property
    def ratio(self) -> float | None:
        """num_nodes / num_hidden_layers: every node counted, those outside the layers too."""
        return None if self.num_nodes is None else self.num_nodes / self.num_layers

    def to_dict(self) -> dict[str, Any]:
        per_layer = self.layers.families if self.layers else {}
        return {
            "graph": self.graph,
            "num_nodes": self.num_nodes,
            "num_hidden_layers": self.num_layers,
            "nodes_per_layer_ratio": self.ratio,
            "layers": self.layers.to_dict() if self.layers else None,
            "families": [{"family": f, "count": n, "share": n / self.num_nodes if self.num_nodes else 0.0,
                          "per_layer": per_layer.get(f)} for f, n in self.families.items()],
            "node_types": self.node_types,
            "note": self.note,
        }


def no_nodes_note(record: CaptureRecord, device_type: str) -> str:
    if device_type != "cuda":
        return (f"node lists need a CUDA device (on {device_type}, FULL graphs are emulated by re-running the "
                "step: no CUDA graph, no nodes)")
    if record.key.startswith("PIECEWISE"):
        return "PIECEWISE piece graphs are captured without a node list"
    return "this torch/CUDA version gave no graph node dump"


def summarize(record: CaptureRecord, num_layers: int, nodes: Sequence[GraphNode] | None,
              device_type: str) -> GraphNodeSummary:
    """One graph's summary: from its ordered nodes where given (and whole), else from its histogram."""
    summary = GraphNodeSummary(record.key, num_layers, record.num_nodes)
    if record.num_nodes is None:
        summary.note = no_nodes_note(record, device_type)
        return summary
    if nodes is None or len(nodes) != record.num_nodes:
        summary.families = histogram_family_counts(record.num_nodes, record.kernels)
        why = ("its DOT dump could not be read again" if nodes is None
               else f"its DOT dump had {len(nodes)} nodes, not {record.num_nodes}")
        summary.note = f"node order unknown ({why}): layers not delimited, only the ratio"
        return summary
    summary.families = family_counts(nodes)
    summary.node_types = dict(Counter(n.kind for n in nodes).most_common())
    layers = delimit_layers(nodes, num_layers)
    if isinstance(layers, str):
        summary.note = f"layers not delimited, only the ratio: {layers}"
    else:
        summary.layers = layers
    return summary


# ---- which graph, and text ------------------------------------------------------------
def smallest_decode_graph(descriptors: Sequence[dict[str, Any]], records: Sequence[CaptureRecord]) -> str | None:
    """The smallest decode graph: the FULL descriptor with the fewest tokens, uniform-decode
    ones first, in its [greedy] variant (else its first captured variant); None: no FULL graph."""
    full = sorted((d for d in descriptors if d["cg_mode"] == "FULL"),
                  key=lambda d: (d["uniform_token_count"] is None, d["num_tokens"]))
    keys = [r.key for r in records]
    for d in full:
        if f"{d['key']}[greedy]" in keys:
            return f"{d['key']}[greedy]"
        found = next((k for k in keys if k.startswith(f"{d['key']}[")), None)
        if found:
            return found
    return None


def family_table(summary: GraphNodeSummary) -> str:
    """family | nodes | share | per layer (the delimited layer's nodes; '-' without one); zero rows left out."""
    assert summary.num_nodes is not None
    per_layer = summary.layers.families if summary.layers else None
    rows = [[f, str(n), pct(n / summary.num_nodes) if summary.num_nodes else "-",
             str(per_layer[f]) if per_layer else "-"] for f, n in summary.families.items() if n]
    layer_total = str(sum(per_layer.values())) if per_layer else "-"
    rows.append(["total", str(summary.num_nodes), pct(1.0) if summary.num_nodes else "-", layer_total])
    return text_table(["family", "nodes", "share", "per layer"], rows, numeric=[False, True, True, True])


def summary_lines(summary: GraphNodeSummary) -> list[str]:
    """One graph's block: header, the two per-layer figures, the family table."""
    if summary.num_nodes is None:
        return [f"nodes of {summary.graph}: {summary.note}"]
    lines = [f"nodes of {summary.graph}: {summary.num_nodes} nodes, {summary.num_layers} decoder layers",
             f"  {summary.ratio:.1f} nodes per layer = all {summary.num_nodes} nodes / {summary.num_layers} layers "
             "(nodes outside the layers counted too)"]
    if summary.layers:
        lines.append(f"  {summary.layers.line()}")
    if summary.note:
        lines.append(f"  note: {summary.note}")
    lines += [f"  {row}" for row in family_table(summary).splitlines()]
    return lines


def node_family_lines(summaries: Sequence[GraphNodeSummary], default: str | None, all_graphs: bool) -> list[str]:
    """The capture text's node section: the default graph's block, or with `all_graphs` every
    graph's; graphs without a node list are grouped into one line per reason."""
    if not summaries:
        return []
    chosen = list(summaries) if all_graphs else [s for s in summaries if s.graph == default]
    if not chosen:
        return ["nodes per layer and kernel families: no FULL graph was captured, and PIECEWISE piece graphs "
                "are captured without a node list (--all-graphs lists every graph)"]
    lines: list[str] = []
    for s in chosen:
        if s.num_nodes is not None:
            lines += [*summary_lines(s), ""]
    missing: dict[str, list[str]] = {}
    for s in chosen:
        if s.num_nodes is None:
            missing.setdefault(s.note, []).append(s.graph)
    for note, graphs in missing.items():
        named = ", ".join(graphs[:_NAMED]) + (f" and {len(graphs) - _NAMED} more" if len(graphs) > _NAMED else "")
        lines.append(f"nodes of {named}: {note}")
    if not all_graphs and len(summaries) > 1:
        lines.append(f"(the smallest decode graph; --all-graphs shows all {len(summaries)} graphs)")
    return lines[:-1] if lines and not lines[-1] else lines


def rules_dict() -> list[dict[str, str]]:
    return [{"family": r.family, "pattern": r.pattern, "why": r.why} for r in FAMILY_RULES]
