"""Terminal rendering shared by the inspect subcommands: aligned tables and JSON."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from capture.descriptor import BatchExecutionDescriptor


class InspectError(Exception):
    """A user-facing failure (a missing optional package, an unusable input): printed as one line."""


def text_table(columns: Sequence[str], rows: Sequence[Sequence[str]], *, numeric: Sequence[bool] | None = None) -> str:
    """Columns padded to their widest cell; `numeric[i]` right-aligns column i."""
    numeric = list(numeric) if numeric is not None else [False] * len(columns)
    if len(numeric) != len(columns):
        raise ValueError(f"numeric has {len(numeric)} flags for {len(columns)} columns")
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]

    def fmt(row: Sequence[str]) -> str:
        cells = (v.rjust(w) if num else v.ljust(w) for v, w, num in zip(row, widths, numeric, strict=True))
        return "  ".join(cells).rstrip()

    return "\n".join([fmt(columns), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)])


def pct(fraction: float) -> str:
    return f"{100 * fraction:.1f}%"


def descriptor_dict(desc: BatchExecutionDescriptor) -> dict[str, Any]:
    """A descriptor as JSON: its short key plus every field."""
    return {
        "key": str(desc),
        "cg_mode": desc.cg_mode.name,
        "num_tokens": desc.num_tokens,
        "num_reqs": desc.num_reqs,
        "uniform_token_count": desc.uniform_token_count,
        "has_lora": desc.has_lora,
    }


def print_json(data: dict[str, Any]) -> None:
    """Machine output: indented JSON on stdout (anything else the command says goes to stderr)."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
