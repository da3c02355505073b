"""`inspect table`: the dispatch table a configuration gets, without building a model.

The table is built exactly as the runner builds it (graphrunner/step/graphs.py): the
requested mode resolved against the attention backend's graph support, then a
`DispatchTable` over the capture sizes and batch limits. Only the support level needs
the backend; by default it is the one the runner would pick on `--device`, found with
the runner's own rule (`attention_cg_support`), so the two can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from capture.dispatch import DispatchTable
from capture.modes import AttentionCGSupport, resolve_mode
from graphrunner_tools.inspect.render import descriptor_dict, text_table
from graphrunner_tools.inspect.speculation import (
    Speculation,
    descriptor_role,
    is_verifying,
    table_lines,
    table_summary,
)

# Shared defaults of every inspect subcommand: the reference engine's (`graphrunner
# generate`), so that a recorded trace simulates under the table it was recorded with.
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512


@dataclass(frozen=True)
class TableSpec:
    """A configuration's dispatch-table inputs.

    mode None is the runner's default (FULL_AND_PIECEWISE, downgraded if the backend
    cannot serve it); attention_support None is what the backend on `device` declares;
    device None is cuda when available, else cpu. `model` is only named in the output:
    the table does not depend on the model; nor does it on the drafter
    (`speculative_method`, `draft_model`), only on k.
    """

    model: str | None = None
    device: str | None = None
    mode: str | None = None
    capture_sizes: tuple[int, ...] | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    num_speculative_tokens: int = 0
    attention_support: str | None = None
    speculative_method: str | None = None  # labels the output, like model
    draft_model: str | None = None
    enable_lora: bool = False  # LoRA graphs (has_lora) beside the plain ones

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be >= 0")
        if self.capture_sizes is not None:
            object.__setattr__(self, "capture_sizes", tuple(self.capture_sizes))

    @property
    def uniform_decode_query_len(self) -> int:
        """q: the tokens of each request in a uniform-decode batch."""
        return 1 + self.num_speculative_tokens

    @property
    def speculation(self) -> Speculation:
        return Speculation(self.num_speculative_tokens, self.speculative_method, self.draft_model)


@dataclass(frozen=True)
class BuiltTable:
    """A dispatch table plus where its inputs came from (for display)."""

    spec: TableSpec
    table: DispatchTable
    device: str
    support: AttentionCGSupport
    support_source: str  # why this support level: given, or what the backend declares


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_support(device: str) -> tuple[AttentionCGSupport, str]:
    """What the attention backend the runner picks on `device` allows inside FULL graphs."""
    import torch

    from graphrunner.attention import get_attention_backend
    from graphrunner.step.graphs import attention_cg_support

    dev = torch.device(device)
    backend = get_attention_backend(dev)
    support = attention_cg_support(dev, backend)
    if dev.type != "cuda":
        why = f"on {dev.type} FULL graphs are emulated, so attention backend {backend.name!r} qualifies"
    else:
        why = f"attention backend {backend.name!r} on cuda"
    return support, why


def build_table(spec: TableSpec) -> BuiltTable:
    """Resolve the mode and build the table; ValueError names any impossible setting."""
    device = spec.device or default_device()
    if spec.attention_support is not None:
        support, why = AttentionCGSupport.parse(spec.attention_support), "given with --attention-support"
    else:
        support, why = backend_support(device)
    resolution = resolve_mode(spec.mode, support)
    table = DispatchTable(
        resolution,
        spec.capture_sizes,
        max_num_reqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        uniform_decode_query_len=spec.uniform_decode_query_len,
        enable_lora=spec.enable_lora,
    )
    return BuiltTable(spec, table, device, support, why)


def candidate_ranges(table: DispatchTable, has_lora: bool = False) -> list[tuple[int, int, tuple[str, ...]]]:
    """(first t, last t, candidate keys) for runs of token counts with the same candidates (of
    batches with adapters when `has_lora`).

    Covers 1..max_num_batched_tokens; a run with no candidates runs eagerly.
    """
    runs: list[tuple[int, int, tuple[str, ...]]] = []
    for t in range(1, table.max_num_batched_tokens + 1):
        keys = tuple(str(d) for d in table.candidates(t, has_lora))
        if runs and runs[-1][2] == keys:
            runs[-1] = (runs[-1][0], t, keys)
        else:
            runs.append((t, t, keys))
    return runs


def table_dict(built: BuiltTable) -> dict[str, Any]:
    table, res = built.table, built.table.resolution
    return {
        "kind": "inspect-table",
        "model": built.spec.model,
        "device": built.device,
        "attention_support": built.support.name,
        "attention_support_source": built.support_source,
        "requested_mode": built.spec.mode,
        "resolution": {
            "mode": res.mode.name,
            "downgraded_from": None if res.downgraded_from is None else res.downgraded_from.name,
            "reason": res.reason,
        },
        "max_num_reqs": table.max_num_reqs,
        "max_num_batched_tokens": table.max_num_batched_tokens,
        "uniform_decode_query_len": table.uniform_decode_query_len,
        "speculative": table_summary(built.spec.speculation, table),
        "capture_sizes": list(table.capture_sizes),
        "max_graph_tokens": table.max_graph_tokens,
        "descriptors": [
            {**descriptor_dict(d), "verifying": is_verifying(d, table.uniform_decode_query_len)}
            for d in table.descriptors
        ],
        "candidates": [
            {"num_tokens_min": lo, "num_tokens_max": hi, "candidates": list(keys)}
            for lo, hi, keys in candidate_ranges(table)
        ],
        "lora": None if not table.enable_lora else {
            "capture_sizes": list(table.lora_capture_sizes),
            "num_graphs": sum(d.has_lora for d in table.descriptors),
            "candidates": [
                {"num_tokens_min": lo, "num_tokens_max": hi, "candidates": list(keys)}
                for lo, hi, keys in candidate_ranges(table, has_lora=True)
            ],
        },
    }


def header_lines(built: BuiltTable) -> list[str]:
    """Model, mode resolution, support and limits: the context every table-based output starts with."""
    spec, table, res = built.spec, built.table, built.table.resolution
    requested = spec.mode if spec.mode is not None else "default"
    if res.downgraded_from is not None:
        mode = f"requested {requested} -> {res.mode.name} (downgraded from {res.downgraded_from.name}: {res.reason})"
    else:
        mode = f"requested {requested} -> {res.mode.name}"
    sizes = list(table.capture_sizes)
    model = [f"model:          {spec.model} (labels the output: the table does not depend on the model)"]
    return [
        *(model if spec.model else []),
        f"device:         {built.device}; attention graph support {built.support.name} ({built.support_source})",
        f"mode:           {mode}",
        f"limits:         max_num_seqs={table.max_num_reqs} max_num_batched_tokens={table.max_num_batched_tokens} "
        f"q={table.uniform_decode_query_len}",
        f"capture sizes:  {sizes} ({len(sizes)} sizes)",
        *([f"LoRA:           graphs with adapters at {list(table.lora_capture_sizes)} (batches without adapters "
           "run the plain graphs)"] if table.enable_lora else []),
        *table_lines(spec.speculation, table),
    ]


def table_text(built: BuiltTable) -> str:
    table = built.table
    descs = table.descriptors
    n_full = sum(d.is_full for d in descs)
    lines = header_lines(built)
    lines.append(
        f"graphs:         {len(descs)} descriptors ({len(descs) - n_full} PIECEWISE, {n_full} FULL), "
        "in capture order (PIECEWISE first, largest first):"
    )
    k = built.spec.num_speculative_tokens
    width = max((len(str(d)) for d in descs), default=0)
    rows_text = [f"  {d!s:<{width}}  {descriptor_role(d, k)}".rstrip() for d in descs]
    lines += rows_text or ["  none: every step runs eagerly"]
    lines += ["", "candidates per token count (dispatch takes the first the batch fits; none fits -> NONE, eager):"]
    rows = []
    for lo, hi, keys in candidate_ranges(table):
        span = str(lo) if lo == hi else f"{lo}-{hi}"
        rows.append((span, ", ".join(keys) if keys else "(none: NONE, eager)"))
    lines.append(text_table(("num_tokens", "candidates"), rows, numeric=(True, False)))
    if table.enable_lora:
        lines += ["", "candidates of batches with LoRA adapters (only graphs captured with them):"]
        rows = []
        for lo, hi, keys in candidate_ranges(table, has_lora=True):
            span = str(lo) if lo == hi else f"{lo}-{hi}"
            rows.append((span, ", ".join(keys) if keys else "(none: NONE, eager)"))
        lines.append(text_table(("num_tokens", "candidates"), rows, numeric=(True, False)))
    return "\n".join(lines)
