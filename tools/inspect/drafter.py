"""`inspect capture` with speculation: which graphs verify drafts, and the drafter's nodes.

With k > 0 every step body verifies and then drafts (`SpeculativeStep.propose`, the last
thing `StepBody.run` does), so every FULL graph holds the drafter; the uniform-decode
ones (q = 1 + k tokens per request) are the verifying graphs. To attribute nodes to the
drafter, one representative FULL graph is captured twice more as throwaway graphs: as
the runner captures it, and with `propose` switched off; the difference in nodes and
kernel names is the drafter's (`capture.report.NodeAttribution`). They are captured as
one more graph of the runner would be (its pool and capture stream: the same cuBLAS
workspace, and a graph's memory in a shared pool is safe while graphs replay one at a
time), never join the runner's graphs, and are released at once. (A pool of their own
would not do: releasing it clears every stream's cuBLAS workspace, the runner's graphs'
included.) On a CPU, FULL graphs are emulated and have no node list: the attribution
says so instead of counting.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from capture.descriptor import BatchExecutionDescriptor
from capture.dispatch import DispatchTable
from capture.report import CaptureRecord, CaptureReport, NodeAttribution
from graphrunner_tools.inspect.speculation import Speculation, is_verifying, verifying_summary

if TYPE_CHECKING:
    from graphrunner.runner import ModelRunner
    from graphrunner.spec_decode.step import SpeculativeStep
    from graphrunner.step.graphs import StepGraphs

DRAFTER = "drafter"


def representative(table: DispatchTable, q: int) -> BatchExecutionDescriptor | None:
    """The graph the drafter is measured on: the smallest verifying descriptor, else the
    smallest FULL one (mode FULL has no separate decode graphs), else None (no FULL graph)."""
    full = sorted((d for d in table.descriptors if d.is_full), key=lambda d: (d.num_tokens, d.num_reqs or 0))
    verifying = [d for d in full if is_verifying(d, q)]
    if verifying:
        return verifying[0]
    return full[0] if full else None


@contextmanager
def drafter_off(spec: SpeculativeStep) -> Iterator[None]:
    """The step does not draft inside (`SpeculativeStep.drafting`), for captures to compare."""
    saved = spec.drafting
    spec.drafting = False
    try:
        yield
    finally:
        spec.drafting = saved


def capture_throwaway(graphs: StepGraphs, desc: BatchExecutionDescriptor, label: str) -> CaptureRecord:
    """Capture `desc`'s greedy step as a throwaway graph on the runner's pool, record its
    nodes, release it.

    Under inference mode, as `ModelRunner.capture_model` captures (grad mode is part of the
    compiled model's guards: another mode would recompile it)."""
    import torch

    from capture.full import FullGraph
    from graphrunner.step.graphs import GREEDY

    assert graphs.pool is not None and graphs.captured, "capture_model() first"
    graph: FullGraph | None = None
    try:
        with torch.inference_mode():
            graph = FullGraph(label, graphs.make_full_step(desc, GREEDY), graphs.pool)
            return graph.capture(inspect_nodes=True)
    finally:
        if graph is not None:
            graph.release()
        graphs.body.reset_scratch_row()  # the dummy step advanced it


def attribute_drafter(graphs: StepGraphs, spec: SpeculativeStep, desc: BatchExecutionDescriptor) -> NodeAttribution:
    """The drafter's nodes in `desc`'s greedy graph: captured with and without `propose`.

    A failed extra capture is reported in the attribution's note: the runner's own graphs
    were captured already, and the report stays useful without the drafter's share."""
    label = f"{desc}[greedy]"
    try:
        with_drafter = capture_throwaway(graphs, desc, label)
        with drafter_off(spec):
            without = capture_throwaway(graphs, desc, label)
    except Exception as e:  # out of memory, a capture error: say so, keep the report
        return NodeAttribution(DRAFTER, label, note=f"the extra capture failed: {type(e).__name__}: {e}")
    note = ""
    if with_drafter.num_nodes is None:
        note = ("CPU: FULL graphs are emulated, no node list" if graphs.device.type != "cuda"
                else "this torch/CUDA version gave no graph node dump")
    return NodeAttribution.between(DRAFTER, with_drafter, without, note)


def verifying_graphs(report: CaptureReport, table: DispatchTable, q: int) -> list[dict[str, Any]]:
    """The captured graphs (one per sampling variant) of the verifying descriptors."""
    out = []
    for desc in table.descriptors:
        if is_verifying(desc, q):
            out += [{"graph": r.key, "q": q, "num_reqs": desc.num_reqs}
                    for r in report.records if r.key.startswith(f"{desc}[")]
    return out


def speculative_capture(runner: ModelRunner, report: CaptureReport, speculation: Speculation) -> dict[str, Any]:
    """After `capture_model`: the verifying graphs, and the drafter's nodes added to `report`."""
    graphs, spec = runner.graphs, runner.body.spec
    assert graphs is not None and spec is not None, "a captured runner with num_speculative_tokens > 0"
    desc = representative(graphs.table, speculation.q)
    verifying = verifying_graphs(report, graphs.table, speculation.q)
    notes = [] if verifying else [f"verifying graphs: {verifying_summary(graphs.table, speculation.k)}"]
    if desc is None:
        notes.append(f"mode {graphs.mode.name} captures no FULL graph: the drafter runs eagerly, in no graph")
    else:
        report.attributions.append(attribute_drafter(graphs, spec, desc))
    return {
        **speculation.to_dict(),
        "verifying_graphs": verifying,
        "drafter_graph": None if desc is None else f"{desc}[greedy]",
        "notes": notes,
    }


def speculative_lines(summary: dict[str, Any] | None, speculation: Speculation) -> list[str]:
    """The capture text's speculative lines: verifying graphs by descriptor, with their variants."""
    if summary is None:
        return []
    q = summary["uniform_decode_query_len"]
    by_desc: dict[str, list[str]] = {}
    for g in summary["verifying_graphs"]:
        base, _, variant = g["graph"].partition("[")
        by_desc.setdefault(base, []).append(variant.rstrip("]"))
    graphs = "; ".join(f"{d}[{'|'.join(v)}]" for d, v in by_desc.items())
    lines = [f"speculative: {speculation.label}: uniform decode q = 1 + {speculation.k} = {q}"]
    if by_desc:
        lines.append(f"verifying graphs ({len(summary['verifying_graphs'])}, q={q}): {graphs}")
    if summary["drafter_graph"]:
        lines.append(f"drafter nodes measured on {summary['drafter_graph']} (captured again without the drafter)")
    return lines + [f"note: {note}" for note in summary["notes"]]
