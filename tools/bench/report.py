"""Rendering of benchmark results: terminal tables, markdown, JSON files, PNG plots.

Pure formatting: takes the result dataclasses (or their `to_dict()`), never measures.
matplotlib is optional (the `plot` extra); asking for a PNG without it raises
`MissingDependency` with the install hint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphrunner_tools.bench.roofline import EXPERT_FORMULA

if TYPE_CHECKING:
    from graphrunner_tools.bench.capture_bench import CaptureResult
    from graphrunner_tools.bench.latency import LatencyResult
    from graphrunner_tools.bench.throughput import ThroughputResult

_GIB = float(1 << 30)


class MissingDependency(RuntimeError):
    """An optional package an output format needs is not installed."""


def write_json(data: dict[str, Any], path: str) -> None:
    """Write `data` as indented JSON to `path`; "-" means stdout."""
    text = json.dumps(data, indent=2, default=str)
    if path == "-":
        sys.stdout.write(text + "\n")
    else:
        Path(path).write_text(text + "\n")


def _pct(x: float | None) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.1f}%"


def env_lines(env: dict[str, Any]) -> list[str]:
    return [
        f"device: {env.get('device_name')} ({env.get('device')}), dtype {env.get('dtype')}",
        f"torch {env.get('torch')}, triton {env.get('triton')}, cuda {env.get('cuda')}, python {env.get('python')}",
    ]


# ---- latency ------------------------------------------------------------------------
_LAT_COLUMNS = ("mode", "bs", "graph", "ms/step", "p90 ms", "dev ms", "tok/s", "roofline ms", "% roofline")


def _is_moe(result: LatencyResult) -> bool:
    return any(r.active_experts is not None for r in result.rows)


def _latency_columns(result: LatencyResult) -> tuple[str, ...]:
    return _LAT_COLUMNS + (("experts/layer",) if _is_moe(result) else ())


def _latency_cells(result: LatencyResult) -> list[tuple[str, ...]]:
    cells: list[tuple[str, ...]] = []
    moe = _is_moe(result)
    for r in result.rows:
        experts = () if not moe else ("-" if r.active_experts is None else f"{r.active_experts:.1f}",)
        cells.append(
            (
                r.mode,
                str(r.batch_size),
                r.descriptor,
                f"{r.median_ms:.3f}",
                f"{r.p90_ms:.3f}",
                "-" if r.device_median_ms is None else f"{r.device_median_ms:.3f}",
                f"{r.tokens_per_s:.1f}",
                f"{r.roofline_ms:.3f}",
                _pct(r.roofline_fraction),
                *experts,
            )
        )
    return cells


def _text_table(columns: tuple[str, ...], cells: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    # Left-align the text columns (first three), right-align numbers.
    def fmt(row: tuple[str, ...]) -> str:
        return "  ".join(v.ljust(w) if i < 3 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths, strict=True)))

    return [fmt(columns), "  ".join("-" * w for w in widths), *(fmt(r) for r in cells)]


def _latency_header(result: LatencyResult) -> list[str]:
    s, bw = result.spec, result.bandwidth
    return [
        f"decode latency: {s.model}, context {s.context}, {s.steps} timed steps after {s.warmup} warmup",
        *env_lines(result.env),
        f"KV cache: {_kv_dtype(result)} (kv_cache_dtype={s.kv_cache_dtype}); the roofline reads its element size",
        f"copy bandwidth: {bw.bytes_per_s / 1e9:.1f} GB/s ({bw.method}); roofline = (weights + KV read) / bandwidth",
        *([f"weights read count the routed experts as {EXPERT_FORMULA}"] if _is_moe(result) else []),
    ]


def _kv_dtype(result: LatencyResult) -> str:
    """The storage dtype the runners' KV caches had (the first built one's), else the spec's name."""
    built = [m.kv_cache_dtype for m in result.modes if m.kv_cache_dtype]
    return built[0] if built else result.spec.kv_cache_dtype


def _mode_lines(result: LatencyResult) -> list[str]:
    lines = []
    for m in result.modes:
        parts = [f"mode {m.mode}"]
        if m.resolved_mode and m.resolved_mode != m.mode:
            parts.append(f"resolved to {m.resolved_mode}")
        if m.capture_seconds is not None and m.pool_bytes is not None:
            parts.append(
                f"{m.num_graphs} graphs captured in {m.capture_seconds:.2f} s, pool {m.pool_bytes / _GIB:.3f} GiB"
            )
        if m.error:
            parts.append(f"FAILED: {m.error}")
        lines.append("; ".join(parts))
    return lines


def latency_table(result: LatencyResult) -> str:
    """The readable mode x batch table, with the run's context above it."""
    table = _text_table(_latency_columns(result), _latency_cells(result))
    return "\n".join([*_latency_header(result), *_mode_lines(result), "", *table])


def latency_markdown(result: LatencyResult) -> str:
    lines = [f"### {result.spec.model}: decode step latency", ""]
    lines += [f"- {line}" for line in [*_latency_header(result)[1:], *_mode_lines(result)]]
    columns = _latency_columns(result)
    lines += ["", "| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in _latency_cells(result)]
    return "\n".join(lines) + "\n"


def latency_png(result: LatencyResult, path: str) -> None:
    """ms/step vs batch size per mode, with the roofline as a dashed line."""
    plt = require_pyplot()
    fig, (ax_t, ax_f) = plt.subplots(1, 2, figsize=(11, 4.2))
    by_mode: dict[str, list] = {}
    for r in result.rows:
        by_mode.setdefault(r.mode, []).append(r)
    for mode, rows in by_mode.items():
        rows = sorted(rows, key=lambda r: r.batch_size)
        xs = [r.batch_size for r in rows]
        ax_t.plot(xs, [r.median_ms for r in rows], marker="o", label=mode)
        ax_f.plot(xs, [100 * r.roofline_fraction for r in rows], marker="o", label=mode)
    roof = {r.batch_size: r.roofline_ms for r in result.rows}
    if roof:
        xs = sorted(roof)
        ax_t.plot(xs, [roof[x] for x in xs], "k--", label="roofline")
    sizes = sorted({r.batch_size for r in result.rows})
    for ax in (ax_t, ax_f):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("batch size (decode requests)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax_t.set_ylabel("ms / step (median)")
    ax_f.set_ylabel("% of bandwidth roofline")
    env = result.env
    fig.suptitle(f"{result.spec.model} ({env.get('dtype')}), context {result.spec.context}, {env.get('device_name')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def require_pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependency(
            "--png needs matplotlib, which is not installed: pip install 'graphrunner[plot]'"
        ) from None
    return plt


# ---- capture ------------------------------------------------------------------------
def capture_text(result: CaptureResult, top_kernels: int = 15) -> str:
    r = result.report
    lines = [
        f"graph capture: {result.spec.model}, mode {result.spec.mode} (resolved {r.mode})",
        *env_lines(result.env),
        f"capture sizes: {list(result.capture_sizes)}",
        f"start-up: load {result.load_seconds:.2f} s / compile {r.compile_seconds:.2f} s / "
        f"capture {r.total_seconds:.2f} s",
        "",
        str(r),
    ]
    hist = r.kernel_histogram()
    if hist:
        lines += ["", f"top kernels over all graphs (of {sum(hist.values())} kernel nodes):"]
        lines += [f"  {n:6d}  {name}" for name, n in hist.most_common(top_kernels)]
    return "\n".join(lines)


def capture_markdown(result: CaptureResult) -> str:
    r = result.report
    lines = [
        f"### {result.spec.model}: graph capture ({r.mode})",
        "",
        f"- {env_lines(result.env)[0]}",
        f"- start-up: load {result.load_seconds:.2f} s / compile {r.compile_seconds:.2f} s / "
        f"capture {r.total_seconds:.2f} s",
        f"- {r.num_graphs} graphs in {r.total_seconds:.2f} s; pool {r.pool_bytes / _GIB:.3f} GiB; "
        f"device memory in use +{r.free_memory_delta_bytes / _GIB:.3f} GiB",
        "",
        "| graph | seconds | pool MiB | nodes |",
        "|---|---|---|---|",
    ]
    for rec in r.records:
        nodes = "-" if rec.num_nodes is None else str(rec.num_nodes)
        lines.append(f"| {rec.key} | {rec.seconds:.3f} | {rec.pool_bytes / (1 << 20):.1f} | {nodes} |")
    return "\n".join(lines) + "\n"


# ---- throughput ---------------------------------------------------------------------
def throughput_text(result: ThroughputResult) -> str:
    s = result.spec
    lines = [
        f"offline throughput: {s.model}, {s.num_prompts} prompts, "
        f"input {s.input_len}, output {s.output_len} ({s.dist})",
        *env_lines(result.env),
        f"mode {result.mode}, {result.scheduling} scheduling, max_num_seqs {s.max_num_seqs}, "
        f"max_num_batched_tokens {s.max_num_batched_tokens}",
        f"start-up seconds:    {_startup(result.startup_seconds)}",
        f"input tokens:        {result.input_tokens}",
        f"output tokens:       {result.output_tokens}",
        f"elapsed seconds:     {result.elapsed_seconds:.3f}",
        f"requests/s:          {result.requests_per_s:.2f}",
        f"output tokens/s:     {result.output_tokens_per_s:.1f}",
        f"total tokens/s:      {result.total_tokens_per_s:.1f}",
        f"preemptions:         {result.preemptions}",
        f"copy bandwidth:      {result.bandwidth.bytes_per_s / 1e9:.1f} GB/s ({result.bandwidth.method})",
        f"ideal output tok/s:  {result.ideal_output_tokens_per_s:.1f} "
        f"(decode at batch {result.ideal_batch}, each step reading all weights + mean KV)",
        f"fraction of ideal:   {_pct(result.ideal_fraction)}",
        f"GPU busy:            {_busy(result.gpu_busy_fraction)}",
        f"time to first token: {_ttft(result)}",
    ]
    if s.images:
        lines.append(f"images:              {s.images} a prompt of {result.image_size} px, "
                     f"{result.image_tokens} tokens each, {result.images_encoded} encoded, encoder cache hit rate "
                     f"{_pct(result.encoder_hit_rate or 0.0)}")
    return "\n".join(lines)


def throughput_markdown(result: ThroughputResult) -> str:
    s = result.spec
    return (
        f"### {s.model}: offline throughput\n\n"
        f"- {env_lines(result.env)[0]}\n\n"
        "| prompts | input | output | dist | mode | scheduling | output tok/s | ideal tok/s | % ideal | GPU busy "
        "| TTFT median / p99 | load / compile / capture s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        f"| {s.num_prompts} | {s.input_len} | {s.output_len} | {s.dist} | {result.mode} | {result.scheduling} | "
        f"{result.output_tokens_per_s:.1f} | {result.ideal_output_tokens_per_s:.1f} | {_pct(result.ideal_fraction)} | "
        f"{_busy(result.gpu_busy_fraction)} | {_ttft(result)} | {_startup(result.startup_seconds)} |\n"
        + (f"\n{s.images} image(s) a prompt, {result.image_size} px, {result.image_tokens} tokens each: "
           f"{result.images_encoded} encoded, encoder cache hit rate {_pct(result.encoder_hit_rate or 0.0)}\n"
           if s.images else "")
    )


def _ttft(result: ThroughputResult) -> str:
    if result.ttft_median_ms is None or result.ttft_p99_ms is None:
        return "-"
    return f"{result.ttft_median_ms:.1f} / {result.ttft_p99_ms:.1f} ms"


def _busy(fraction: float | None) -> str:
    return "not measured (no CUDA events)" if fraction is None else _pct(fraction)


def _startup(seconds: dict[str, float]) -> str:
    return " / ".join(f"{seconds.get(k, 0.0):.2f}" for k in ("load", "compile", "capture"))
