"""`inspect explain`: the descriptor one batch gets, why, and what its padding costs.

A batch is given either by its query lengths (classified as the runner classifies a
step: uniform with q when every request has exactly q tokens) or by its sizes
(`num_tokens` with `uniform` q, or with `num_reqs` for a mixed batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from capture.dispatch import DispatchTable, Explanation
from graphrunner_tools.inspect.render import descriptor_dict, pct
from graphrunner_tools.inspect.speculation import explain_lines, explain_summary
from graphrunner_tools.inspect.table import BuiltTable, header_lines


@dataclass(frozen=True)
class BatchShape:
    """What dispatch sees of a batch: request and token counts, and q when uniform."""

    num_reqs: int
    num_tokens: int
    uniform: int | None = None

    @classmethod
    def from_query_lens(cls, query_lens: Sequence[int], q: int) -> BatchShape:
        """Classify like the runner: uniform iff every request has exactly q tokens."""
        lens = [int(n) for n in query_lens]
        if not lens or any(n < 1 for n in lens):
            raise ValueError(f"query_lens={lens} must list at least one request, each with >= 1 token")
        return cls(len(lens), sum(lens), q if all(n == q for n in lens) else None)

    @classmethod
    def from_sizes(cls, num_tokens: int, *, uniform: int | None = None, num_reqs: int | None = None) -> BatchShape:
        """`uniform` q: num_reqs = num_tokens / q (num_reqs, if given, must agree);
        otherwise a mixed batch of `num_reqs` requests."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens={num_tokens} must be >= 1")
        if uniform is None:
            if num_reqs is None:
                raise ValueError("a mixed batch needs --num-reqs (or give --uniform Q, or --query-lens)")
            return cls(num_reqs, num_tokens, None)
        if uniform < 1 or num_tokens % uniform:
            raise ValueError(f"--uniform={uniform} must be >= 1 and divide num_tokens={num_tokens}")
        if num_reqs is not None and num_reqs * uniform != num_tokens:
            raise ValueError(
                f"num_reqs={num_reqs} disagrees with a uniform batch of num_tokens={num_tokens}, q={uniform} "
                f"({num_tokens // uniform} requests)"
            )
        return cls(num_tokens // uniform, num_tokens, uniform)


def explain_batch(table: DispatchTable, shape: BatchShape) -> Explanation:
    """`DispatchTable.explain` for the shape; ValueError when it breaks the table's limits."""
    return table.explain(shape.num_reqs, shape.num_tokens, shape.uniform)


def explanation_dict(built: BuiltTable, shape: BatchShape, exp: Explanation) -> dict[str, Any]:
    return {
        "kind": "inspect-explain",
        "mode": built.table.mode.name,
        "batch": {"num_reqs": shape.num_reqs, "num_tokens": shape.num_tokens, "uniform": shape.uniform},
        "descriptor": str(exp.chosen),
        "chosen": descriptor_dict(exp.chosen),
        "verdicts": [
            {"descriptor": str(v.descriptor), "verdict": v.label, "reason": v.reason} for v in exp.verdicts
        ],
        "note": exp.note,
        "padding_tokens": exp.padding_tokens,
        "padding_reqs": exp.padding_reqs,
        "waste": exp.waste,  # padding tokens / tokens the step runs
        "speculative": explain_summary(built.spec.speculation, exp),  # None without speculation
    }


def explanation_text(built: BuiltTable, shape: BatchShape, exp: Explanation) -> str:
    chosen = exp.chosen
    reqs_run = chosen.num_reqs if chosen.is_full else shape.num_reqs
    lines = [
        *header_lines(built),
        "",
        str(exp),
        "",
        f"descriptor:     {chosen}",
        f"padding:        {exp.padding_tokens} tokens ({chosen.num_tokens} run for {shape.num_tokens} real; "
        f"{pct(exp.waste)} of the step), {exp.padding_reqs} requests ({reqs_run} run for {shape.num_reqs} real)",
        *explain_lines(built.spec.speculation, exp),
    ]
    return "\n".join(lines)
