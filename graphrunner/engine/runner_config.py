"""The `RunnerConfig` an `LLM` builds from its arguments, defaults resolved for the model and device."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from graphrunner.config import (
    CacheConfig,
    CompilationConfig,
    KVTransferConfig,
    LoadConfig,
    LoRAConfig,
    ParallelConfig,
    RunnerConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

logger = logging.getLogger(__name__)


def build_runner_config(
    model: str, parallel: ParallelConfig, device: torch.device, *, dtype: str, max_num_seqs: int,
    max_num_batched_tokens: int, max_model_len: int | None, block_size: int, seed: int, num_kv_blocks: int | None,
    gpu_memory_utilization: float, load_format: str, enforce_eager: bool | None, compilation_kwargs: dict[str, Any],
    speculative: SpeculativeConfig, lora: LoRAConfig | None = None, enable_prompt_embeds: bool = False,
    kv_transfer: KVTransferConfig | None = None, quantization: str | None = None, kv_cache_dtype: str = "auto",
) -> RunnerConfig:
    """The `RunnerConfig` of `LLM`'s arguments, with their defaults resolved for this model and device."""
    from graphrunner.models.loader import is_builtin, load_model_config
    from graphrunner.models.quant_config import with_quantization

    model_config = with_quantization(load_model_config(model), quantization)
    if enable_prompt_embeds:
        model_config = dataclasses.replace(model_config, enable_prompt_embeds=True)
    if max_model_len is None:
        max_model_len = model_config.max_position_embeddings  # vLLM's default; fit_max_model_len may lower it
    if load_format == "auto" and is_builtin(model):
        load_format = "dummy"  # builtins have no checkpoint
    if enforce_eager is None:
        enforce_eager = device.type != "cuda"
    return RunnerConfig(
        model=model_config,
        load=LoadConfig(model=model, load_format=load_format, seed=seed),
        cache=CacheConfig(
            block_size=block_size, num_blocks=num_kv_blocks, gpu_memory_utilization=gpu_memory_utilization,
            cache_dtype=kv_cache_dtype,
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
        lora=lora,
        kv_transfer=kv_transfer,
        dtype=dtype,
        seed=seed,
    )


def fit_max_model_len(scheduler: Any, config: RunnerConfig, explicit: bool) -> None:
    """Name where the scheduler's max_model_len came from (its over-length errors say so), and
    lower a default one to what the KV cache holds, with a logged notice (vLLM's default is the
    model's length; an explicit one that does not fit is the caller's to change: requests that
    would need more blocks are refused at admission)."""
    model_len = config.model.max_position_embeddings
    if explicit:
        scheduler.max_model_len_source = "max_model_len as given"
        return
    scheduler.max_model_len_source = f"the model's max_position_embeddings={model_len}, the default"
    capacity = scheduler.num_blocks * scheduler.block_size - scheduler.spec_lookahead
    if capacity < scheduler.max_model_len:
        logger.warning(
            "max_model_len lowered from the model's %d to %d: the KV cache holds %d blocks of %d tokens "
            "(pass max_model_len, num_kv_blocks or gpu_memory_utilization to change it)",
            scheduler.max_model_len, capacity, scheduler.num_blocks, scheduler.block_size)
        scheduler.max_model_len = capacity
        scheduler.max_model_len_source = (f"lowered from the model's {model_len} to what the KV cache holds "
                                          f"({scheduler.num_blocks} blocks x {scheduler.block_size} tokens)")
