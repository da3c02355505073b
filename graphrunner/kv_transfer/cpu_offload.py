"""CpuOffloadConnector: blocks evicted from the GPU prefix cache go to a host-memory LRU and come back on a hit.

The scheduler side owns the index: prefix hash -> host slot, least recently used first, at most
`num_slots` of them (`kv_connector_extra_config["cpu_bytes"]` over the bytes of one block). When the
prefix cache hands out a cached block again (`block_evicted`), its content is still intact (it is
written only by the step it is now scheduled in), so the step's metadata says "copy GPU block b to
host slot s" and the runner does it first thing in `pre_forward`, before that step writes it. A
waiting request whose prompt continues past its local hit with blocks in the index gets them back:
"copy host slot s to GPU block b", also in `pre_forward`, after the offloads (a block offloaded and
reused as a load target in one step is read before it is overwritten). Slots loaded in a step are
not reused by that step's offloads.

The runner side owns the bytes: one [num_slots, num_layers, 2, block_size, kv_heads, head_dim] host
tensor, pinned on CUDA so the copies run on the main stream without blocking the host.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from graphrunner.config import KVTransferConfig
from graphrunner.kv_shape import KVCacheShape
from graphrunner.kv_transfer.base import (
    KVConnectorScheduler,
    KVConnectorWorker,
    connector_extra,
    gather_blocks,
    scatter_blocks,
)

_EXTRA_KEYS = ("cpu_bytes",)


def num_host_slots(config: KVTransferConfig, shape: KVCacheShape) -> int:
    """Host blocks of `cpu_bytes`; ValueError naming the value when it is missing or holds no block."""
    extra = connector_extra(config, _EXTRA_KEYS)
    cpu_bytes = extra.get("cpu_bytes")
    if not isinstance(cpu_bytes, int) or isinstance(cpu_bytes, bool) or cpu_bytes < shape.block_bytes:
        raise ValueError(f"CpuOffloadConnector needs kv_connector_extra_config['cpu_bytes'], an int of at least one "
                         f"block ({shape.block_bytes} bytes), got {cpu_bytes!r}")
    return cpu_bytes // shape.block_bytes


@dataclass
class CpuOffloadMetadata:
    """One step's copies: (GPU block, host slot) offloads, then (host slot, GPU block) loads."""

    offloads: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)


class CpuOffloadScheduler(KVConnectorScheduler):
    """The host index: which prefixes sit in which host slot, least recently used first."""

    def __init__(self, config: KVTransferConfig, shape: KVCacheShape, model_id: str) -> None:
        super().__init__(config, shape, model_id)
        self.num_slots = num_host_slots(config, shape)
        self._index: OrderedDict[str, int] = OrderedDict()  # hash -> slot, oldest first
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._block_hash: dict[int, str] = {}  # GPU block -> the hash of the full block it holds
        self._matched: dict[str, list[int]] = {}  # request id -> host slots matched, until admitted
        self._pinned: set[int] = set()  # slots this step loads from: not reused before it runs
        self._meta = CpuOffloadMetadata()
        self.num_offloaded_blocks = 0

    def blocks_cached(self, req: Any, num_full: int) -> None:
        for block, h in zip(req.block_ids[:num_full], self.hashes(req, num_full), strict=True):
            self._block_hash[block] = h

    def block_evicted(self, block_id: int) -> None:
        h = self._block_hash.pop(block_id, None)
        if h is None:
            return
        if h in self._index:
            self._index.move_to_end(h)
            return
        slot = self._take_slot()
        if slot is None:
            return  # every slot is loaded from this step: this block is not offloaded
        self._index[h] = slot
        self._meta.offloads.append((block_id, slot))
        self.num_offloaded_blocks += 1

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for h, slot in self._index.items():
            if slot not in self._pinned:
                del self._index[h]
                return slot
        return None

    def get_num_new_matched_tokens(self, req: Any, num_computed_tokens: int) -> int:
        self._matched.pop(req.req_id, None)
        self.note_query(req)
        bs = self.block_size
        first, last = num_computed_tokens // bs, (req.num_tokens - 1) // bs
        if first >= last:
            return 0
        slots = []
        for h in self.hashes(req, last)[first:]:
            slot = self._index.get(h)
            if slot is None:
                break
            slots.append(slot)
        if slots:
            self._matched[req.req_id] = slots
        return len(slots) * bs

    def update_state_after_alloc(self, req: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        slots = self._matched.pop(req.req_id)[:num_external_tokens // self.block_size]
        first = req.num_computed_tokens // self.block_size - len(slots)
        h = self.hashes(req, first + len(slots))
        for i, slot in enumerate(slots):
            self._meta.loads.append((slot, block_ids[first + i]))
            self._pinned.add(slot)
            self._index.move_to_end(h[first + i])
        self.num_external_hit_tokens += num_external_tokens

    def build_connector_meta(self, scheduler_output: Any, requests: dict[str, Any]) -> CpuOffloadMetadata | None:
        meta, self._meta = self._meta, CpuOffloadMetadata()
        self._pinned.clear()
        return meta if meta.offloads or meta.loads else None

    def request_finished(self, req: Any) -> None:
        super().request_finished(req)
        self._matched.pop(req.req_id, None)

    def request_preempted(self, req: Any) -> None:
        self._matched.pop(req.req_id, None)


class CpuOffloadWorker(KVConnectorWorker):
    """The host blocks and the copies between them and the paged cache, on the main stream."""

    def __init__(self, config: KVTransferConfig, shape: KVCacheShape, model_id: str, device: torch.device) -> None:
        super().__init__(config, shape, model_id, device)
        s = shape
        self.host = torch.zeros((num_host_slots(config, shape), s.num_layers, 2, s.block_size, s.num_kv_heads,
                                 s.head_dim), dtype=s.dtype, pin_memory=device.type == "cuda")

    def load(self, metadata: CpuOffloadMetadata) -> None:
        # Every copy is queued on the main stream, slot by slot (non-blocking from and to pinned memory):
        # an offload lands before a later load of its slot reads it, and before this step's forward
        # overwrites its block; the host never waits for the device.
        if metadata.offloads:
            blocks, slots = zip(*metadata.offloads, strict=True)
            data = gather_blocks(self.kv_caches, blocks)  # [L, 2, n, bs, h, d]
            for j, slot in enumerate(slots):
                self.host[slot].copy_(data[:, :, j], non_blocking=True)
        if metadata.loads:
            slots, blocks = zip(*metadata.loads, strict=True)
            staged = torch.empty((len(slots), *self.host.shape[1:]), dtype=self.host.dtype, device=self.device)
            for j, slot in enumerate(slots):
                staged[j].copy_(self.host[slot], non_blocking=True)
            scatter_blocks(self.kv_caches, blocks, staged.permute(1, 2, 0, 3, 4, 5))

    def save(self, metadata: CpuOffloadMetadata) -> None:
        """Nothing after the step: blocks leave the GPU when they are evicted, in `load`."""


__all__ = ["CpuOffloadMetadata", "CpuOffloadScheduler", "CpuOffloadWorker", "num_host_slots"]
