"""`inspect simulate`: run the dispatch table over a batch trace and measure the outcome.

A trace is one JSON object per step — what `graphrunner generate --record-batches FILE`
writes (graphrunner.engine.batch_trace.batch_record) or what `workloads.synthesize` produces:
{"num_reqs", "num_tokens", "query_lens": [...], "uniform": q | null, ...}. Steps are
re-classified from their query lengths with the simulated table's q, so a trace
recorded under one configuration can be replayed against another.

Reported: the hit rate of each runtime mode (FULL / PIECEWISE / NONE) as a fraction of
steps and of real tokens — each set sums to 1 — and the padding waste, padded tokens
divided by real tokens.

With `--pipeline-parallel-size P` > 1 the padded steps also run through a P-stage pipeline
model (graphrunner_tools.inspect.pipeline): a step's work, its padded tokens plus a fixed
`--step-overhead-tokens`, splits evenly over the stages; the bubble fraction (1 - busy time
/ (P * makespan)) is reported for the synchronous schedule (one batch in flight: (P-1)/P)
and the pipelined one (up to P batches in flight), with the speed-up between them. The
trace's steps are taken as-is, as if consecutive steps held disjoint requests.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from capture.dispatch import DispatchTable
from capture.modes import CUDAGraphMode
from graphrunner_tools.inspect.explain import BatchShape
from graphrunner_tools.inspect.render import InspectError, pct, text_table

RUNTIME_MODES = ("FULL", "PIECEWISE", "NONE")


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def shape_of_record(record: Any, q: int, where: str) -> BatchShape:
    """A trace record's batch shape; ValueError naming `where` when the record is malformed."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    num_reqs, num_tokens = record.get("num_reqs"), record.get("num_tokens")
    if not (_is_count(num_reqs) and _is_count(num_tokens)):
        raise ValueError(f"{where}: num_reqs={num_reqs!r} and num_tokens={num_tokens!r} must be ints >= 1")
    lens = record.get("query_lens")
    if lens is not None:
        if not isinstance(lens, list) or not all(_is_count(n) for n in lens):
            raise ValueError(f"{where}: query_lens must be a list of ints >= 1")
        if len(lens) != num_reqs or sum(lens) != num_tokens:
            raise ValueError(
                f"{where}: query_lens (len {len(lens)}, sum {sum(lens)}) disagree with "
                f"num_reqs={num_reqs}, num_tokens={num_tokens}"
            )
        return BatchShape.from_query_lens(lens, q)
    uniform = record.get("uniform")
    if uniform is not None and (not _is_count(uniform) or num_reqs * uniform != num_tokens):
        raise ValueError(f"{where}: uniform={uniform!r} needs num_tokens == num_reqs * uniform")
    return BatchShape(num_reqs, num_tokens, uniform)


def read_trace(path: str | Path, q: int) -> list[BatchShape]:
    """Batch shapes of a JSONL trace file (blank lines skipped)."""
    shapes = []
    with Path(path).open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg})") from None
            shapes.append(shape_of_record(record, q, where))
    if not shapes:
        raise ValueError(f"trace {str(path)!r} has no steps")
    return shapes


@dataclass
class ModeStats:
    steps: int = 0
    real_tokens: int = 0
    padding_tokens: int = 0


@dataclass
class StepOutcome:
    real_tokens: int
    run_tokens: int  # after padding
    mode: str


@dataclass
class SimulationResult:
    source: str
    table: DispatchTable
    modes: dict[str, ModeStats] = field(default_factory=lambda: {m: ModeStats() for m in RUNTIME_MODES})
    descriptors: Counter = field(default_factory=Counter)
    uniform_steps: int = 0
    steps: list[StepOutcome] = field(default_factory=list)

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def real_tokens(self) -> int:
        return sum(m.real_tokens for m in self.modes.values())

    @property
    def padding_tokens(self) -> int:
        return sum(m.padding_tokens for m in self.modes.values())

    @property
    def padding_waste(self) -> float:
        """Padded tokens / real tokens over the whole trace."""
        return self.padding_tokens / self.real_tokens if self.real_tokens else 0.0

    def step_fraction(self, mode: str) -> float:
        return self.modes[mode].steps / self.num_steps if self.num_steps else 0.0

    def token_fraction(self, mode: str) -> float:
        return self.modes[mode].real_tokens / self.real_tokens if self.real_tokens else 0.0

    def to_dict(self, top: int = 10) -> dict[str, Any]:
        t = self.table
        return {
            "kind": "inspect-simulate",
            "source": self.source,
            "mode": t.mode.name,
            "capture_sizes": list(t.capture_sizes),
            "max_num_reqs": t.max_num_reqs,
            "max_num_batched_tokens": t.max_num_batched_tokens,
            "uniform_decode_query_len": t.uniform_decode_query_len,
            "num_steps": self.num_steps,
            "uniform_decode_steps": self.uniform_steps,
            "real_tokens": self.real_tokens,
            "padding_tokens": self.padding_tokens,
            "padding_waste": self.padding_waste,
            "hit_rates": {
                m: {
                    "steps": s.steps,
                    "step_fraction": self.step_fraction(m),
                    "real_tokens": s.real_tokens,
                    "token_fraction": self.token_fraction(m),
                    "padding_tokens": s.padding_tokens,
                }
                for m, s in self.modes.items()
            },
            "top_descriptors": [{"descriptor": d, "steps": n} for d, n in self.descriptors.most_common(top)],
        }


def simulate(table: DispatchTable, shapes: Iterable[BatchShape], source: str) -> SimulationResult:
    """Dispatch every step of the trace; ValueError names a step outside the table's limits."""
    result = SimulationResult(source, table)
    for i, shape in enumerate(shapes):
        try:
            desc = table.dispatch(shape.num_reqs, shape.num_tokens, shape.uniform)
        except ValueError as e:
            raise ValueError(
                f"step {i} of {source}: {e} (simulate with the limits the trace was recorded under)"
            ) from None
        mode = desc.cg_mode.name
        stats = result.modes[mode]
        stats.steps += 1
        stats.real_tokens += shape.num_tokens
        stats.padding_tokens += desc.padded_tokens(shape.num_tokens)
        result.descriptors[str(desc) if desc.cg_mode is not CUDAGraphMode.NONE else "NONE (eager)"] += 1
        result.uniform_steps += shape.uniform is not None
        result.steps.append(StepOutcome(shape.num_tokens, desc.num_tokens, mode))
    if not result.steps:
        raise ValueError(f"{source}: no steps to simulate")
    return result


def simulation_text(result: SimulationResult, header: list[str], top: int = 10) -> str:
    rows = []
    for m, s in result.modes.items():
        rows.append((m, str(s.steps), pct(result.step_fraction(m)), str(s.real_tokens), pct(result.token_fraction(m)),
                     str(s.padding_tokens)))
    lines = [
        *header,
        "",
        f"trace:          {result.source}: {result.num_steps} steps ({result.uniform_steps} uniform decode), "
        f"{result.real_tokens} real tokens",
        f"padding waste:  {result.padding_tokens} padded tokens / {result.real_tokens} real = "
        f"{pct(result.padding_waste)}",
        "",
        text_table(("mode", "steps", "% steps", "tokens", "% tokens", "padding"), rows,
                   numeric=(False, True, True, True, True, True)),
        "",
        f"most used descriptors (top {top}):",
    ]
    lines += [f"  {n:6d}  {d}" for d, n in result.descriptors.most_common(top)]
    return "\n".join(lines)


def plot_simulation(result: SimulationResult, path: str) -> None:
    """Mode shares (steps, tokens) beside tokens per step, real vs run, coloured by mode."""
    plt = require_plot()
    colors = {"FULL": "tab:green", "PIECEWISE": "tab:blue", "NONE": "tab:red"}
    fig, (ax_share, ax_steps) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1, 2.5]})
    bottoms = [0.0, 0.0]
    for m in RUNTIME_MODES:
        shares = [100 * result.step_fraction(m), 100 * result.token_fraction(m)]
        ax_share.bar(["steps", "real tokens"], shares, bottom=bottoms, color=colors[m], label=m)
        bottoms = [b + s for b, s in zip(bottoms, shares, strict=True)]
    ax_share.set_ylabel("% of trace")
    ax_share.set_ylim(0, 100)
    ax_share.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, fontsize="small")
    xs = range(result.num_steps)
    ax_steps.plot(xs, [s.real_tokens for s in result.steps], color="0.4", lw=0.8, label="real tokens")
    for m in RUNTIME_MODES:
        pts = [(i, s.run_tokens) for i, s in enumerate(result.steps) if s.mode == m]
        if pts:
            ax_steps.scatter(*zip(*pts, strict=True), s=6, color=colors[m], label=f"{m} (run tokens)")
    ax_steps.set_xlabel("step")
    ax_steps.set_ylabel("tokens")
    ax_steps.legend(markerscale=2)
    fig.suptitle(
        f"{result.source}: mode {result.table.mode.name}, padding waste {pct(result.padding_waste)}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def require_plot():
    """pyplot on the Agg backend; InspectError with the install hint when matplotlib is missing."""
    from graphrunner_tools.bench.report import MissingDependency, require_pyplot

    try:
        return require_pyplot()
    except MissingDependency:
        raise InspectError("--plot needs matplotlib, which is not installed: pip install 'graphrunner[plot]'") from None
