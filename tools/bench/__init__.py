"""`graphrunner bench`: decode latency vs roofline, capture cost, generate throughput.

    graphrunner bench latency    --model builtin:qwen2.5-0.5b --batch-sizes 1,8,32 --modes NONE,FULL
    graphrunner bench capture    --model builtin:qwen2.5-0.5b --mode FULL_AND_PIECEWISE
    graphrunner bench throughput --model builtin:qwen2.5-0.5b --num-prompts 256 --input-len 512 --output-len 128

Each subcommand is also a function (`run_latency`, `run_capture`, `run_throughput`) that
takes a frozen spec and returns a result dataclass with `to_dict()`, so benchmarks can be
driven from Python without the CLI. Torch and the model stack are imported lazily.
"""

from __future__ import annotations

__all__ = [
    "CaptureSpec",
    "LatencySpec",
    "ThroughputSpec",
    "run_capture",
    "run_latency",
    "run_throughput",
]


def __getattr__(name: str):
    if name in ("LatencySpec", "run_latency"):
        from graphrunner_tools.bench import latency

        return getattr(latency, name)
    if name in ("CaptureSpec", "run_capture"):
        from graphrunner_tools.bench import capture_bench

        return getattr(capture_bench, name)
    if name in ("ThroughputSpec", "run_throughput"):
        from graphrunner_tools.bench import throughput

        return getattr(throughput, name)
    raise AttributeError(f"module 'graphrunner_tools.bench' has no attribute {name!r}")
