"""`bench capture`: what capturing the graphs of one configuration costs.

Builds a runner, captures every descriptor of its dispatch table (the default capture
sizes unless told otherwise) and returns the runner's `CaptureReport`: total seconds,
pool memory, and per-descriptor time, memory and (with `inspect_nodes`) graph nodes.

The KV cache is the smallest legal one (one request of max_model_len): capture's dummy
steps only touch block 0, and a small cache keeps the free-memory figures about the
graphs rather than about the cache.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from capture.modes import CUDAGraphMode
from capture.report import CaptureReport
from graphrunner_tools.bench.common import (
    build_runner_config,
    default_compile_backend,
    env_info,
    release_memory,
    resolve_device,
)


@dataclass(frozen=True)
class CaptureSpec:
    """What `run_capture` captures. capture_sizes None = the runner's default ladder."""

    model: str = "builtin:qwen2.5-0.5b"
    mode: str = "FULL_AND_PIECEWISE"
    dtype: str = "auto"
    device: str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 512
    max_model_len: int = 1024
    block_size: int = 16
    num_kv_blocks: int | None = None
    capture_sizes: tuple[int, ...] | None = None
    compile_backend: str | None = None
    inspect_nodes: bool = False
    load_format: str = "auto"
    seed: int = 0
    progress: bool = False

    def __post_init__(self) -> None:
        CUDAGraphMode.parse_capturing(self.mode)
        if self.capture_sizes is not None:
            object.__setattr__(self, "capture_sizes", tuple(self.capture_sizes))


@dataclass
class CaptureResult:
    spec: CaptureSpec
    env: dict
    capture_sizes: tuple[int, ...]
    load_seconds: float
    report: CaptureReport

    def to_dict(self) -> dict:
        return {
            "kind": "capture",
            "spec": asdict(self.spec),
            "env": self.env,
            "capture_sizes": list(self.capture_sizes),
            "load_seconds": self.load_seconds,
            "startup_seconds": {"load": self.load_seconds, "compile": self.report.compile_seconds,
                                "capture": self.report.total_seconds},
            "report": self.report.to_dict(),
        }


if TYPE_CHECKING:
    from graphrunner.runner import ModelRunner


def build_loaded_runner(spec, device) -> tuple[ModelRunner, float]:
    """A runner for capture work, loaded and with its KV cache: (runner, load seconds).

    `spec` is any spec with the runner fields of `CaptureSpec` (the inspect tool's too);
    `num_kv_blocks` is optional (default: one full-length request's worth), and so is
    `speculative_config` (vLLM's dict or JSON text).
    """
    from graphrunner.config import SpeculativeConfig
    from graphrunner.runner import ModelRunner

    num_blocks = getattr(spec, "num_kv_blocks", None) or -(-spec.max_model_len // spec.block_size)
    config = build_runner_config(
        spec.model,
        mode=CUDAGraphMode.parse(spec.mode),
        dtype=spec.dtype,
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_model_len=spec.max_model_len,
        block_size=spec.block_size,
        num_blocks=num_blocks,
        capture_sizes=spec.capture_sizes,
        compile_backend=spec.compile_backend or default_compile_backend(device),
        load_format=spec.load_format,
        seed=spec.seed,
        kv_cache_dtype=getattr(spec, "kv_cache_dtype", "auto"),  # the inspect tool's spec names one
    )
    speculative = getattr(spec, "speculative_config", None)  # the inspect tool's spec may carry one
    if speculative:
        config = config.replace(speculative=SpeculativeConfig.from_dict(speculative))
    runner = ModelRunner(config, device)
    start = time.perf_counter()
    try:
        runner.load_model()
        runner.initialize_kv_cache(num_blocks)
    except BaseException:
        runner.shutdown()
        raise
    return runner, time.perf_counter() - start


def run_capture(spec: CaptureSpec) -> CaptureResult:
    """Build, capture, report, shut down."""
    device = resolve_device(spec.device)
    runner, load_seconds = build_loaded_runner(spec, device)
    try:
        assert runner.graphs is not None
        sizes = tuple(runner.graphs.table.capture_sizes)
        report = runner.capture_model(inspect_nodes=spec.inspect_nodes, progress=spec.progress)
        return CaptureResult(spec, env_info(device, spec.dtype), sizes, load_seconds, report)
    finally:
        runner.shutdown()
        del runner
        release_memory(device)
