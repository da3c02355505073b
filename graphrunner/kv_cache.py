"""The paged KV cache: its size per block, how many blocks fit, and their allocation.

`determine_num_kv_blocks` runs a profile at the largest batch on CUDA to measure peak
activation memory, then gives the cache `gpu_memory_utilization` of the device minus
everything else in use; on a CPU the cache gets `cpu_kv_cache_bytes`.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable

import numpy as np
import torch

from graphrunner.config import CacheConfig
from graphrunner.kv_shape import KVCacheShape
from graphrunner.state.block_tables import BlockTables
from graphrunner.state.features import SamplingFeatures
from graphrunner.step.body import StepBody

logger = logging.getLogger("graphrunner.kv_cache")

_GIB = 1 << 30
# The e4m3 conversions of the fp8 KV kernels are native from this compute capability on (Ada, Hopper).
_FP8_MIN_CAPABILITY = (8, 9)


def check_fp8_kv_device(storage_dtype: torch.dtype, device: torch.device) -> None:
    """ValueError naming the device and its compute capability when an fp8 KV cache is asked for on a
    GPU whose kernels cannot convert to and from e4m3 (CPUs run the torch reference and are fine)."""
    if storage_dtype != torch.float8_e4m3fn or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < _FP8_MIN_CAPABILITY:
        need = ".".join(map(str, _FP8_MIN_CAPABILITY))
        raise ValueError(f"kv_cache_dtype='fp8' is not supported on {device} (compute capability "
                         f"{capability[0]}.{capability[1]}): the fp8 KV kernels need {need} or newer; "
                         "use kv_cache_dtype='auto'")


def determine_num_kv_blocks(shape: KVCacheShape, cache: CacheConfig, body: StepBody, device: torch.device, *,
                            max_blocks: int, max_num_blocks_per_req: int, max_model_len: int,
                            agree: Callable[[int], int], extra_block_bytes: int = 0) -> int:
    """How many KV blocks fit: a fixed count if configured, else profile + memory budget.

    `max_blocks` caps the count (more than max_num_seqs full-length requests can hold is
    dead memory); `agree` makes every rank of a replica size the same cache;
    `extra_block_bytes`: what else each block costs (a draft model's KV for the same block).
    """
    block_bytes = shape.block_bytes + extra_block_bytes
    if cache.num_blocks is not None:
        return cache.num_blocks
    if device.type != "cuda":
        num_blocks = cache.cpu_kv_cache_bytes // block_bytes
    else:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        profile_run(body, shape)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        current = torch.cuda.memory_allocated(device)
        free, total = torch.cuda.mem_get_info(device)
        budget = total * cache.gpu_memory_utilization - (total - free) - (peak - current)
        num_blocks = int(budget // block_bytes)
        logger.info(
            "KV cache budget %.2f GiB (%d blocks of %d tokens); activation peak %.2f GiB",
            max(budget, 0) / _GIB, num_blocks, shape.block_size, (peak - current) / _GIB,
        )
    num_blocks = agree(min(num_blocks, max_blocks))
    if num_blocks < max_num_blocks_per_req:
        raise RuntimeError(
            f"only {num_blocks} KV blocks fit, fewer than the {max_num_blocks_per_req} one request of "
            f"max_model_len={max_model_len} needs; lower max_model_len or raise the memory budget"
        )
    return int(num_blocks)


def profile_run(body: StepBody, shape: KVCacheShape) -> None:
    """Run the largest forward and the largest sampling batch on scratch state.

    All dummy entries point at the scratch row (whose block table is all block 0) over a
    one-block temporary cache, so nothing live is touched.
    """
    buffers, limits = body.buffers, body.limits
    real_caches, real_tables = buffers.kv_caches, buffers.block_tables
    buffers.kv_caches = shape.allocate(1, buffers.inputs.device)
    buffers.block_tables = BlockTables(buffers.requests.num_rows, limits.max_num_blocks_per_req, limits.block_size, 1,
                                       buffers.inputs.device)
    try:
        per_req = min(limits.max_num_tokens, limits.max_model_len)
        num_reqs = min(-(-limits.max_num_tokens // per_req), limits.max_num_reqs)
        query_lens = np.full(num_reqs, per_req, dtype=np.int32)
        query_lens[-1] = limits.max_num_tokens - per_req * (num_reqs - 1)
        body.dummy_step(query_lens, SamplingFeatures())
        decodes = np.ones(min(limits.max_num_reqs, limits.max_num_tokens), dtype=np.int32)
        body.dummy_step(decodes, SamplingFeatures.all_on())
    finally:
        buffers.kv_caches, buffers.block_tables = real_caches, real_tables
        body.reset_scratch_row()
