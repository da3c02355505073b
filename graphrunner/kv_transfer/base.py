"""The KV connector interface (vLLM's shape): a scheduler side and a runner side, one metadata between.

The scheduler side decides, per step, what moves: for a request being admitted it reports how many
more prompt tokens than the local prefix cache holds it can supply (`get_num_new_matched_tokens`), is
told the blocks they go to (`update_state_after_alloc`), and at the end of `schedule()` packs the
step's loads and saves into `SchedulerOutput.kv_connector_metadata` (`build_connector_meta`).

The runner side moves the bytes at three fixed points of the step:

    pre_forward(so)   before the step's graphs replay: every load lands in the paged cache, so a
                      FULL graph never reads KV that has not arrived (no layer-wise wait inside it)
    post_forward()    after the step's forward: the KV it computed is saved
    no_forward(so)    a step with nothing scheduled: its loads and saves still run

A runner without a connector holds None and pays one `is None` test per step. Dummy steps (profile,
capture) do not pass through `execute_model`, so they never reach a connector.

Blocks are named by the chained hash of their prefix (`prefix_hashes`) over the keys the engine's
prefix cache uses (`request_keys`: token ids, with each image's or prompt embeddings' content hash at
the positions it fills): equal hashes mean equal tokens and inputs from the first one on (and the same
adapter), so a block of one instance is a block of another for the same prompt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from graphrunner.config import KVTransferConfig, RunnerConfig
from graphrunner.kv_shape import KVCacheShape, stacked_layers
from graphrunner.state.staging import to_device_async

logger = logging.getLogger("graphrunner.kv_transfer")


def connector_extra(config: KVTransferConfig, allowed: Sequence[str]) -> dict[str, Any]:
    """The connector's `kv_connector_extra_config`; ValueError naming the connector, the unknown
    keys and the allowed ones when it has keys the connector does not read."""
    extra = config.kv_connector_extra_config
    unknown = sorted(set(extra) - set(allowed))
    if unknown:
        raise ValueError(f"{config.kv_connector}: unknown kv_connector_extra_config keys {unknown}; "
                         f"allowed: {list(allowed)}")
    return dict(extra)


def prefix_hashes(keys: Sequence[Any], num_blocks: int, block_size: int, salt: int = 0,
                  known: list[str] | None = None) -> list[str]:
    """The hex digests of the first `num_blocks` full blocks of `keys`: each covers its parent's digest
    and its own keys, so it names the whole prefix. `keys`: token ids, or a request's
    `block_key_tokens` (the prefix cache's keys: positions an image or prompt embeddings fill hold its
    content hash, a str, in place of the placeholder id). `known`: digests already computed for a
    prefix of these blocks (extended, and returned)."""
    hashes = known if known is not None else []
    parent = hashes[-1] if hashes else None
    first = len(hashes)
    span = keys[first * block_size:num_blocks * block_size]
    # Token ids alone (no content hash): one conversion for the whole span, not one per block (an 8k-token
    # prompt's 512 digests took 5 ms on the decode instance's critical path one block at a time).
    array = np.asarray(span)  # a content hash among the ids makes it an array of strings
    ids = array.astype(np.int64, copy=False) if array.dtype.kind in "iu" else None
    for i in range(num_blocks - first):
        block = (ids[i * block_size:(i + 1) * block_size].tobytes() if ids is not None
                 else _block_bytes(span[i * block_size:(i + 1) * block_size]))
        parent = _digest(parent, block, salt)
        hashes.append(parent)
    return hashes


def tail_digest(parent: str | None, keys: Sequence[Any], salt: int = 0) -> str:
    """The digest of a prompt's last block when it is partial (fewer keys than a block holds), after the
    digest of the full block before it (`parent`; None when it is the first block). Its bytes are
    shorter than any full block's, so it never names one."""
    return _digest(parent, _block_bytes(keys), salt)


def _digest(parent: str | None, data: bytes, salt: int) -> str:
    """A block's digest: of its parent's (the salt's for the first block) and its keys' bytes."""
    return hashlib.sha256((parent if parent is not None else f"salt:{salt}").encode() + data).hexdigest()


def _block_bytes(block: Sequence[Any]) -> bytes:
    """A block's keys as bytes: token ids as int64 (every token's top byte is 0), a block holding a content
    hash as JSON, which has no 0 byte, so the two never read alike."""
    if any(isinstance(k, str) for k in block):
        return json.dumps(block_keys(block), separators=(",", ":")).encode()
    return np.asarray(block, dtype=np.int64).tobytes()


def block_keys(block: Sequence[Any]) -> list[int | str]:
    """A block's keys as plain ints and strs (as stored beside a block, and compared on load)."""
    return [k if isinstance(k, str) else int(k) for k in block]


def request_keys(req: Any) -> Sequence[Any]:
    """What `req`'s blocks are keyed by: the engine's prefix-cache keys (`Request.block_key_tokens`), so a
    connector shares KV exactly where the prefix cache would (never between two images, or two prompt
    embeddings, behind equal placeholder ids)."""
    return req.block_key_tokens


def model_identity(config: RunnerConfig) -> str:
    """What must be equal for two instances' KV of the same tokens to be equal: the weights (a
    folder, or dummy weights and their seed). Written into every stored block and checked on load."""
    load = config.load
    seed = f"|seed={load.seed}" if load.load_format == "dummy" else ""
    return f"{config.model.name}|{load.model}|{load.load_format}{seed}"


def gather_blocks(kv_caches: list[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
    """The KV of `block_ids` from every layer: [num_layers, 2, n, block_size, kv_heads, head_dim]."""
    index = to_device_async(np.asarray(block_ids, dtype=np.int64), kv_caches[0].device)
    stacked = stacked_layers(kv_caches)
    if stacked is not None:  # one copy, where a stack of per-layer copies copied every byte twice
        return stacked.index_select(2, index)
    return torch.stack([cache.index_select(1, index) for cache in kv_caches])


_MAX_RUNS = 16  # an 8k-token prompt comes in 4 messages of 128 blocks (2,048-token prefill chunks)


def block_runs(blocks: Sequence[torch.Tensor], max_runs: int = _MAX_RUNS) -> list[torch.Tensor]:
    """Blocks [num_layers, 2, block_size, kv_heads, head_dim] as [num_layers, 2, n, ...] tensors, in order:
    each run of consecutive blocks of one tensor laid out that way (a message of the link, as it
    arrived) a view of it, so nothing is copied: a stack of an 8k-token prompt's blocks was 1 GiB of
    llama-3.1-8b KV (14 ms of a CPU step for 1,500 tiny-llama blocks). More than `max_runs` runs (blocks
    read one by one, from files) are stacked into one: each run costs a copy launch per layer."""
    runs: list[torch.Tensor] = []
    i, n = 0, len(blocks)
    while i < n:
        first = blocks[i]
        layers, two, *inner = first.shape
        per_block = math.prod(inner)
        dense = list(first.stride()[2:]) == [math.prod(inner[k + 1:]) for k in range(len(inner))]
        storage, offset, shape, stride = (first.untyped_storage().data_ptr(), first.storage_offset(), first.shape,
                                          first.stride())
        j = i + 1
        while dense and j < n:  # the blocks that follow `first` in its tensor, one after the other
            b = blocks[j]
            if (b.storage_offset() != offset + (j - i) * per_block or b.stride() != stride or b.shape != shape
                    or b.untyped_storage().data_ptr() != storage):
                break
            j += 1
        runs.append(first.as_strided((layers, two, j - i, *inner), (*stride[:2], per_block, *stride[2:]), offset))
        if len(runs) > max_runs:
            return [torch.stack(list(blocks), dim=2)]
        i = j
    return runs


def scatter_blocks(kv_caches: list[torch.Tensor], block_ids: Sequence[int], data: torch.Tensor) -> None:
    """Write `data` ([num_layers, 2, n, block_size, kv_heads, head_dim], any device) into `block_ids`
    of every layer, in stream order (before anything the step launches after)."""
    device = kv_caches[0].device
    # A pinned, non-blocking index copy: a list copied to the device straight waits for the stream,
    # i.e. for the step still running ahead, which made each admission step of an 8k-token prompt
    # (four block runs) take 13-19 ms of host time against 11 ms per step on llama-3.1-8b.
    index = to_device_async(np.asarray(block_ids, dtype=np.int64), device)
    data = data.to(device, non_blocking=True)
    if data.dtype.itemsize == 1:
        # fp8 blocks move as their bytes: index_copy_ has no float8 kernel on a CPU, and a byte copy
        # cannot change a quantized value.
        data, kv_caches = data.view(torch.uint8), [cache.view(torch.uint8) for cache in kv_caches]
    stacked = stacked_layers(kv_caches)
    if stacked is not None:  # one launch for every layer (32 a run of blocks for llama-3.1-8b otherwise)
        stacked.index_copy_(2, index, data)
        return
    for layer, cache in enumerate(kv_caches):
        cache.index_copy_(1, index, data[layer])


class KVConnectorScheduler:
    """The scheduler's side of a connector (vLLM's `KVConnectorBase_V1` scheduler-role methods)."""

    def __init__(self, config: KVTransferConfig, shape: KVCacheShape, model_id: str) -> None:
        self.config, self.shape, self.model_id = config, shape, model_id
        self.block_size = shape.block_size
        self.num_external_hit_tokens = 0  # prompt tokens loaded instead of computed
        self.num_query_tokens = 0  # prompt tokens of the requests asked about
        self._hashes: dict[str, list[str]] = {}  # request id -> its full blocks' digests so far

    def hashes(self, req: Any, num_blocks: int) -> list[str]:
        """The digests of `req`'s first `num_blocks` full blocks (computed once per request)."""
        known = self._hashes.setdefault(req.req_id, [])
        if len(known) < num_blocks:
            prefix_hashes(request_keys(req), num_blocks, self.block_size, req.cache_salt, known)
        return known[:num_blocks]

    def prompt_hashes(self, req: Any) -> list[str]:
        """The digests of every block of `req`'s prompt: its full blocks, then its last, partial block
        if it has one (`tail_digest`), which a producer saves too so that a consumer computes only the
        prompt's last token."""
        bs, n = self.block_size, req.num_prompt_tokens
        full = self.hashes(req, n // bs)
        if n % bs == 0:
            return full
        return [*full, tail_digest(full[-1] if full else None, request_keys(req)[n - n % bs:n], req.cache_salt)]

    def get_num_new_matched_tokens(self, req: Any, num_computed_tokens: int) -> int | None:
        """Prompt tokens past `num_computed_tokens` (the local prefix-cache hit, block aligned) this
        connector can supply for waiting `req`, leaving at least its last token to compute (the blocks
        that hold them are loaded whole). 0 by default. None: its blocks are on their way; the
        scheduler keeps it waiting (and the requests behind it, first come first served) and asks again
        next step, while the running requests go on; `wait_for_kv` is called when nothing else can run."""
        return 0

    def wait_for_kv(self, timeout: float) -> None:
        """Nothing is runnable while requests wait for arriving blocks: block up to `timeout` seconds
        (or until something arrives) instead of spinning."""

    def update_state_after_alloc(self, req: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """`req` was admitted with `num_external_tokens` from this connector, placed after its local hit
        in `block_ids` (all of its blocks)."""

    def block_evicted(self, block_id: int) -> None:
        """The prefix cache is handing out cached block `block_id` again (its content is still intact
        until the step it is scheduled in)."""

    def blocks_cached(self, req: Any, num_full: int) -> None:
        """`req`'s first `num_full` blocks are full and keyed in the prefix cache."""

    def build_connector_meta(self, scheduler_output: Any, requests: dict[str, Any]) -> Any:
        """The step's loads and saves (`SchedulerOutput.kv_connector_metadata`); `requests`: the live
        requests by id (their `num_computed_tokens` is where this step's chunk starts)."""
        return None

    def request_finished(self, req: Any) -> None:
        """`req` ended (finished or aborted): forget it."""
        self._hashes.pop(req.req_id, None)

    def request_preempted(self, req: Any) -> None:
        """`req` lost its KV and waits to be admitted again."""

    def note_query(self, req: Any) -> None:
        self.num_query_tokens += req.num_tokens

    @property
    def external_hit_rate(self) -> float:
        """Prompt tokens loaded through the connector over prompt tokens asked about."""
        return self.num_external_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class KVConnectorWorker:
    """The runner's side of a connector: moves KV between the paged cache and elsewhere at the step's
    fixed points (module docstring). Subclasses implement `load` and `save`."""

    def __init__(self, config: KVTransferConfig, shape: KVCacheShape, model_id: str, device: torch.device) -> None:
        self.config, self.shape, self.model_id, self.device = config, shape, model_id, device
        self.kv_caches: list[torch.Tensor] = []
        self._metadata: Any = None

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The runner's paged cache, one [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer."""
        self.kv_caches = kv_caches

    def pre_forward(self, scheduler_output: Any) -> None:
        """Before the step's graphs replay: take the step's metadata and land its loads."""
        self._metadata = metadata = scheduler_output.kv_connector_metadata
        if metadata is not None:
            self.load(metadata)

    def post_forward(self) -> None:
        """After the step's forward: save what it computed, then drop the metadata."""
        metadata, self._metadata = self._metadata, None
        if metadata is not None:
            self.save(metadata)

    def no_forward(self, scheduler_output: Any) -> None:
        """A step with nothing scheduled: its loads and saves still run."""
        self.pre_forward(scheduler_output)
        self.post_forward()

    def load(self, metadata: Any) -> None:
        raise NotImplementedError

    def save(self, metadata: Any) -> None:
        raise NotImplementedError


__all__ = ["KVConnectorScheduler", "KVConnectorWorker", "block_keys", "block_runs", "gather_blocks", "model_identity",
           "prefix_hashes", "request_keys", "scatter_blocks", "tail_digest"]
