"""The batch trace `LLM(record_batches=PATH)` writes: one JSON line per executed step."""

from __future__ import annotations

import json
import os
from pathlib import Path

from graphrunner.protocol import SchedulerOutput


def batch_record(scheduler_output: SchedulerOutput, uniform_decode_query_len: int, descriptor: object) -> dict:
    """One line of a batch trace: the step's shape as the runner classifies it.

    {"num_reqs", "num_tokens", "query_lens": [...] (scheduler order), "uniform": q when
    every request has exactly q tokens else None, "descriptor": str(descriptor)}.
    """
    query_lens = [int(n) for n in scheduler_output.num_scheduled_tokens.values()]
    q = uniform_decode_query_len
    uniform = q if query_lens and all(n == q for n in query_lens) else None
    return {
        "num_reqs": len(query_lens),
        "num_tokens": sum(query_lens),
        "query_lens": query_lens,
        "uniform": uniform,
        "descriptor": None if descriptor is None else str(descriptor),
    }


def append_record(path: str | os.PathLike, scheduler_output: SchedulerOutput, runner: object) -> None:
    """Append the launched step's line to the trace at `path` (host-side only: nothing touches the device)."""
    record = batch_record(scheduler_output, runner.uniform_decode_query_len,  # type: ignore[attr-defined]
                          runner.last_descriptor)  # type: ignore[attr-defined]
    with Path(path).open("a") as f:
        f.write(json.dumps(record) + "\n")
