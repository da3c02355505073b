"""The `RunnerConfig` an `LLM` builds from its arguments, defaults resolved for the model and device."""

from __future__ import annotations

from typing import Any

import torch

from graphrunner.config import (
    CacheConfig,
    CompilationConfig,
    LoadConfig,
    ParallelConfig,
    RunnerConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

# The default context when the caller gives none: long enough for demos, small enough
# that a model with a huge max_position_embeddings does not size huge runner buffers.
DEFAULT_MAX_MODEL_LEN = 2048


def build_runner_config(
    model: str, parallel: ParallelConfig, device: torch.device, *, dtype: str, max_num_seqs: int,
    max_num_batched_tokens: int, max_model_len: int | None, block_size: int, seed: int, num_kv_blocks: int | None,
    gpu_memory_utilization: float, load_format: str, enforce_eager: bool | None, compilation_kwargs: dict[str, Any],
    speculative: SpeculativeConfig,
) -> RunnerConfig:
    """The `RunnerConfig` of `LLM`'s arguments, with their defaults resolved for this model and device."""
    from graphrunner.models.loader import is_builtin, load_model_config

    model_config = load_model_config(model)
    if max_model_len is None:
        max_model_len = min(model_config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    if load_format == "auto" and is_builtin(model):
        load_format = "dummy"  # builtins have no checkpoint
    if enforce_eager is None:
        enforce_eager = device.type != "cuda"
    return RunnerConfig(
        model=model_config,
        load=LoadConfig(model=model, load_format=load_format, seed=seed),
        cache=CacheConfig(
            block_size=block_size, num_blocks=num_kv_blocks, gpu_memory_utilization=gpu_memory_utilization
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
        ),
        parallel=parallel,
        compilation=CompilationConfig(enforce_eager=enforce_eager, **compilation_kwargs),
        speculative=speculative,
        dtype=dtype,
        seed=seed,
    )
