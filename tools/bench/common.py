"""Pieces every benchmark shares: timing statistics, device helpers, runner construction.

Kept free of benchmark policy: the subcommand modules decide what to measure, this
module only knows how to time, how to build a runner config, and how to hand device
memory back between runners.
"""

from __future__ import annotations

import gc
import platform
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from capture.modes import CUDAGraphMode
from graphrunner.config import (
    CacheConfig,
    CompilationConfig,
    KernelConfig,
    LoadConfig,
    LoRAConfig,
    RunnerConfig,
    SchedulerConfig,
)


@dataclass(frozen=True)
class Stats:
    """Summary of repeated timings, in seconds."""

    median: float
    p90: float
    mean: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stats:
        if not samples:
            raise ValueError("Stats.of() needs at least one sample")
        a = np.asarray(samples, dtype=np.float64)
        return cls(
            median=float(np.median(a)),
            p90=float(np.percentile(a, 90)),
            mean=float(a.mean()),
            min=float(a.min()),
            max=float(a.max()),
            n=int(a.size),
        )

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def resolve_device(device: str | None) -> torch.device:
    """`None` -> CUDA when present, else CPU; a CUDA device without an index gets the current one."""
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but torch.cuda.is_available() is False")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device) -> None:
    """Return what a finished runner held: Python garbage, compile caches, the CUDA cache.

    Run between runners so that one large model fits several times in sequence.
    """
    if "torch._dynamo" in sys.modules:
        # Compiled PIECEWISE code holds references to the model it traced.
        torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def env_info(device: torch.device, dtype: str | torch.dtype | None = None) -> dict[str, Any]:
    """Where the numbers came from: device, library versions, and the dtype `dtype` resolves to."""
    from graphrunner.config import resolve_dtype

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    info: dict[str, Any] = {
        "device": str(device),
        "device_name": device_name(device),
        "dtype": str(resolve_dtype(dtype, device)).removeprefix("torch."),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        from capture.cuda_driver import CudaDriver

        info["device_memory_gib"] = torch.cuda.get_device_properties(device).total_memory / (1 << 30)
        info["cuda_driver_fast_path"] = CudaDriver.load() is not None
    return info


def parse_mode(name: str) -> CUDAGraphMode:
    """A CUDAGraphMode from its name ("FULL", "none", "full-and-piecewise")."""
    return CUDAGraphMode.parse(name)


def default_compile_backend(device: torch.device) -> str:
    """Inductor on CUDA (what production runs); eager on CPU (inductor codegen is slow there)."""
    return "inductor" if device.type == "cuda" else "eager"


def build_runner_config(
    model: str,
    *,
    mode: CUDAGraphMode,
    dtype: str,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    block_size: int,
    num_blocks: int | None,
    capture_sizes: Sequence[int] | None,
    compile_backend: str,
    load_format: str = "auto",
    seed: int = 0,
    kernel: KernelConfig | None = None,
    lora: LoRAConfig | None = None,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
) -> RunnerConfig:
    """A RunnerConfig for one benchmarked mode. NONE means enforce_eager (nothing captured); `kernel`
    (default `KernelConfig()`) picks the layers' and attention's kernels; `lora` turns multi-LoRA on;
    `quantization` as `LLM`'s."""
    from graphrunner.models.loader import is_builtin, load_model_config
    from graphrunner.models.quant_config import with_quantization

    if load_format == "auto" and is_builtin(model):
        load_format = "dummy"  # builtins have no checkpoint
    eager = mode is CUDAGraphMode.NONE
    return RunnerConfig(
        model=with_quantization(load_model_config(model), quantization),
        load=LoadConfig(model=model, load_format=load_format, seed=seed),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
        ),
        compilation=CompilationConfig(
            cudagraph_mode=None if eager else mode.name,
            cudagraph_capture_sizes=tuple(capture_sizes) if capture_sizes and not eager else None,
            enforce_eager=eager,
            compile_backend=compile_backend,
        ),
        kernel=kernel if kernel is not None else KernelConfig(),
        lora=lora,
        dtype=dtype,
        seed=seed,
    )


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()

