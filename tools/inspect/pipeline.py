"""The pipeline model of `inspect simulate --pipeline-parallel-size P`: bubble fraction per schedule.

The model. A step's work is its padded token count (the descriptor's num_tokens after
dispatch) plus a fixed per-step overhead, both in token units; the layers split evenly over
P stages, so every stage spends work / P on every step. Two schedules run the trace's steps
in order:

- synchronous: one batch in flight (graphrunner's engine before pipelining). A step passes
  through the stages one after another, so each stage idles (P-1)/P of every step and the
  makespan is the total work.
- pipelined: up to P batches in flight; stage s runs batch t while stage s+1 runs batch t-1.
  finish[s][t] = max(finish[s-1][t], finish[s][t-1]) + work[t] / P, where batch t enters
  stage 0 only once batch t-P has left the last stage (finish[-1][t] = finish[P-1][t-P]:
  the depth-P FIFO; without it stage 0 could run any number of batches ahead).

Bubble fraction = 1 - (busy time summed over stages) / (P * makespan). The overhead is stage
work like the tokens, so the synchronous bubble is (P-1)/P whatever the overhead; a larger
overhead evens out the steps and shrinks the pipelined bubble. Pipelining needs consecutive
steps to hold disjoint requests (as vLLM's PP schedules them); the trace's steps are taken
as-is, so the pipelined figures are the bound a disjoint schedule of the same steps reaches.

Times are kept in integer units of 1/P token, so the fractions are exact before the final
conversion to float.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from graphrunner_tools.inspect.render import pct, text_table

PP_OPTION = "--pipeline-parallel-size"
OVERHEAD_OPTION = "--step-overhead-tokens"
DISJOINT_NOTE = ("pipelining needs consecutive steps to use disjoint requests; the trace's steps are taken "
                 "as-is, so the pipelined figures are what a disjoint schedule of the same steps would reach")


def check_pipeline_args(pp_size: object, overhead_tokens: object) -> None:
    """ValueError naming the option and value unless P is an int >= 1 and the overhead an int >= 0."""
    if not isinstance(pp_size, int) or isinstance(pp_size, bool) or pp_size < 1:
        raise ValueError(f"{PP_OPTION}={pp_size!r} must be an int >= 1")
    if not isinstance(overhead_tokens, int) or isinstance(overhead_tokens, bool) or overhead_tokens < 0:
        raise ValueError(f"{OVERHEAD_OPTION}={overhead_tokens!r} must be an int >= 0")


@dataclass(frozen=True)
class Schedule:
    """One schedule's outcome; times in units of 1/P token (one stage's share of one token)."""

    name: str
    in_flight: int  # batches at most
    makespan_units: int
    busy_units: int  # summed over the stages
    stages: int

    @property
    def makespan_tokens(self) -> float:
        return self.makespan_units / self.stages

    @property
    def bubble(self) -> Fraction:
        if self.makespan_units == 0:
            return Fraction(0)
        return 1 - Fraction(self.busy_units, self.stages * self.makespan_units)

    @property
    def bubble_fraction(self) -> float:
        return float(self.bubble)

    def to_dict(self) -> dict[str, Any]:
        return {"max_batches_in_flight": self.in_flight, "makespan_tokens": self.makespan_tokens,
                "bubble_fraction": self.bubble_fraction}


def synchronous(work: Sequence[int], pp_size: int) -> Schedule:
    """One batch in flight: each step occupies the stages in turn (makespan = total work)."""
    total = sum(work)
    return Schedule("synchronous", 1, pp_size * total, pp_size * total, pp_size)


def pipelined(work: Sequence[int], pp_size: int, *, bounded: bool = True) -> Schedule:
    """Up to P batches in flight, by the recurrence of the module docstring. `bounded=False`
    drops the FIFO bound (stage 0 never waits): the bare recurrence, a lower bound."""
    latest = [0] * pp_size  # latest[s]: when stage s finished its latest batch
    left_last: list[int] = []  # left_last[t]: when batch t left the last stage
    for t, w in enumerate(work):
        # A stage's share of step t is w / P token = w units.
        done = left_last[t - pp_size] if bounded and t >= pp_size else 0
        for s in range(pp_size):
            done = max(done, latest[s]) + w
            latest[s] = done
        left_last.append(done)
    makespan = left_last[-1] if left_last else 0
    return Schedule("pipelined", pp_size if bounded else len(work), makespan, pp_size * sum(work), pp_size)


@dataclass(frozen=True)
class PipelineResult:
    pp_size: int
    overhead_tokens: int
    work: tuple[int, ...]  # per step: padded tokens + overhead
    sync: Schedule
    piped: Schedule

    @property
    def speedup(self) -> float:
        return self.sync.makespan_units / self.piped.makespan_units if self.piped.makespan_units else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "pipeline_parallel_size": self.pp_size,
            "step_overhead_tokens": self.overhead_tokens,
            "work_tokens": sum(self.work),
            "synchronous": self.sync.to_dict(),
            "pipelined": self.piped.to_dict(),
            "speedup": self.speedup,
            "note": DISJOINT_NOTE,
        }


def simulate_pipeline(run_tokens: Sequence[int], pp_size: int, overhead_tokens: int = 0) -> PipelineResult:
    """Both schedules over steps of `run_tokens` padded tokens each."""
    check_pipeline_args(pp_size, overhead_tokens)
    work = tuple(n + overhead_tokens for n in run_tokens)
    return PipelineResult(pp_size, overhead_tokens, work, synchronous(work, pp_size), pipelined(work, pp_size))


def pipeline_text(result: PipelineResult) -> str:
    p = result.pp_size
    rows = [(s.name, "1" if s.in_flight == 1 else f"up to {s.in_flight}", f"{s.makespan_tokens:.1f}",
             pct(s.bubble_fraction)) for s in (result.sync, result.piped)]
    return "\n".join([
        f"pipeline:       PP {p}; a step's work (padded tokens + {result.overhead_tokens} overhead tokens) "
        f"splits evenly over {p} stages",
        f"                {sum(result.work)} token-times of work over {len(result.work)} steps",
        "",
        text_table(("schedule", "batches in flight", "makespan (token-times)", "bubble"), rows,
                   numeric=(False, True, True, True)),
        "",
        f"speed-up of pipelined over synchronous: {result.speedup:.2f}x",
        "note: pipelining needs consecutive steps to use disjoint requests; the trace's steps are taken as-is,",
        "      so the pipelined figures are what a disjoint schedule of the same steps would reach",
    ])
