"""CpuOffloadConnector: blocks evicted from the GPU prefix cache go to a host-memory LRU and come back on a hit.

The scheduler side owns the index: prefix hash -> host slot, least recently used first, at most
`num_slots` of them (`kv_connector_extra_config["cpu_bytes"]` over the bytes of one block). When the
prefix cache hands out a cached block again (`block_evicted`), its content is still intact (it is
written only by the step it is now scheduled in), so the step's metadata says "copy GPU block b to
host slot s" and the runner does it first thing in `pre_forward`, before that step writes it. A
waiting request whose prompt continues past its local hit with blocks in the index gets them back:
"copy host slot s to GPU block b", also in `pre_forward`, after the offloads (a block offloaded and
reused as a load target in one step is read before it is overwritten). Slots matched or loaded in a
step are not reused by that step's offloads.

The runner side owns the bytes: one [num_slots, num_layers, 2, block_size, kv_heads, head_dim] host
tensor, pinned on CUDA so the copies run on the main stream without blocking the host.

`verify_loads` (an option, off by default): the metadata names each copy's prefix hash, the runner
side keeps a checksum of every block it offloads (by hash) and of every block after it is loaded,
and `verify_report()` compares them. Equal bytes give equal checksums whatever the dtype, so a load
into the wrong block, at the wrong offset, from a reused slot or before its copy landed shows as a
mismatch, where comparing greedy tokens with an engine that recomputes cannot tell it from bf16
rounding (a prefix prefilled in other chunk shapes gives other last bits).
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

_EXTRA_KEYS = ("cpu_bytes", "verify_loads")
# Blocks per checksum pass: the int64 words of 16 blocks of llama-3.1-8b (2 MiB of bf16 each) take 64 MiB.
_CHECKSUM_BYTES = 64 << 20


def num_host_slots(config: KVTransferConfig, shape: KVCacheShape) -> int:
    """Host blocks of `cpu_bytes`; ValueError naming the value when it is missing or holds no block."""
    extra = connector_extra(config, _EXTRA_KEYS)
    cpu_bytes = extra.get("cpu_bytes")
    if not isinstance(cpu_bytes, int) or isinstance(cpu_bytes, bool) or cpu_bytes < shape.block_bytes:
        raise ValueError(f"CpuOffloadConnector needs kv_connector_extra_config['cpu_bytes'], an int of at least one "
                         f"block ({shape.block_bytes} bytes), got {cpu_bytes!r}")
    return cpu_bytes // shape.block_bytes


def verify_loads(config: KVTransferConfig) -> bool:
    """The `verify_loads` option; ValueError naming the value when it is not a bool."""
    value = connector_extra(config, _EXTRA_KEYS).get("verify_loads", False)
    if not isinstance(value, bool):
        raise ValueError(f"CpuOffloadConnector: kv_connector_extra_config['verify_loads'] must be a bool, "
                         f"got {value!r}")
    return value


def block_checksums(data: torch.Tensor) -> torch.Tensor:
    """One int64 per block of `data` ([num_layers, 2, n, block_size, kv_heads, head_dim]): its bytes read
    as 32-bit words (bytes where the block's length is odd), weighted by their position and summed, so
    equal bytes give equal sums (integer sums are exact in any order) and a moved word changes it."""
    n = data.shape[2]
    flat = data.transpose(0, 2).reshape(n, -1).view(torch.uint8)
    words = flat.view(torch.int32) if flat.shape[1] % 4 == 0 else flat
    weights = torch.arange(1, words.shape[1] + 1, dtype=torch.int64, device=data.device)
    step = max(1, _CHECKSUM_BYTES // (8 * words.shape[1]))
    return torch.cat([(words[i:i + step].to(torch.int64) * weights).sum(1) for i in range(0, n, step)])


@dataclass
class CpuOffloadMetadata:
    """One step's copies: (GPU block, host slot) offloads, then (host slot, GPU block) loads; with
    `verify_loads`, the prefix hash of each (else empty)."""

    offloads: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)
    offload_hashes: list[str] = field(default_factory=list)
    load_hashes: list[str] = field(default_factory=list)


class CpuOffloadScheduler(KVConnectorScheduler):
    """The host index: which prefixes sit in which host slot, least recently used first."""

    def __init__(self, config: KVTransferConfig, shape: KVCacheShape, model_id: str) -> None:
        super().__init__(config, shape, model_id)
        self.num_slots = num_host_slots(config, shape)
        self.verify = verify_loads(config)
        self._index: OrderedDict[str, int] = OrderedDict()  # hash -> slot, oldest first
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._block_hash: dict[int, str] = {}  # GPU block -> the hash of the full block it holds
        self._matched: dict[str, list[int]] = {}  # request id -> host slots matched, until admitted
        self._pinned: set[int] = set()  # slots this step matches or loads from: not reused before it runs
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
        if self.verify:
            self._meta.offload_hashes.append(h)
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
            # Pinned from the match on: admitting the request allocates its blocks, and every cached GPU
            # block that hands out is offloaded into the least recently used slot, which is typically one
            # of these (a conversation's history was offloaded a turn ago). Reused, it would be
            # overwritten before its load reads it (or drop the hash update_state_after_alloc looks up).
            self._pinned.update(slots)
        return len(slots) * bs

    def update_state_after_alloc(self, req: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        slots = self._matched.pop(req.req_id)[:num_external_tokens // self.block_size]
        first = req.num_computed_tokens // self.block_size - len(slots)
        h = self.hashes(req, first + len(slots))
        for i, slot in enumerate(slots):
            self._meta.loads.append((slot, block_ids[first + i]))
            if self.verify:
                self._meta.load_hashes.append(h[first + i])
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
        self.verify = verify_loads(config)
        self._offloaded_sums: dict[str, torch.Tensor] = {}  # hash -> checksum of the block last offloaded for it
        self._load_checks: list[tuple[list[str], torch.Tensor, torch.Tensor]] = []  # (hashes, loaded, offloaded)

    def load(self, metadata: CpuOffloadMetadata) -> None:
        # Every copy is queued on the main stream, slot by slot (non-blocking from and to pinned memory):
        # an offload lands before a later load of its slot reads it, and before this step's forward
        # overwrites its block; the host never waits for the device.
        if metadata.offloads:
            blocks, slots = zip(*metadata.offloads, strict=True)
            data = gather_blocks(self.kv_caches, blocks)  # [L, 2, n, bs, h, d]
            if self.verify:
                self._offloaded_sums.update(zip(metadata.offload_hashes, block_checksums(data), strict=True))
            for j, slot in enumerate(slots):
                self.host[slot].copy_(data[:, :, j], non_blocking=True)
        if metadata.loads:
            slots, blocks = zip(*metadata.loads, strict=True)
            staged = torch.empty((len(slots), *self.host.shape[1:]), dtype=self.host.dtype, device=self.device)
            for j, slot in enumerate(slots):
                staged[j].copy_(self.host[slot], non_blocking=True)
            scatter_blocks(self.kv_caches, blocks, staged.permute(1, 2, 0, 3, 4, 5))
            if self.verify:
                self._check_loaded(metadata.load_hashes, blocks)

    def _check_loaded(self, hashes: list[str], blocks: Sequence[int]) -> None:
        """Checksum the loaded blocks as the paged cache now holds them, beside the offloaded ones' (queued
        on the stream after the loads: no host wait; `verify_report` compares)."""
        loaded = block_checksums(gather_blocks(self.kv_caches, blocks))
        missing = torch.full((), -1, dtype=torch.int64, device=loaded.device)  # no offload of that hash
        want = torch.stack([self._offloaded_sums.get(h, missing) for h in hashes])
        self._load_checks.append((list(hashes), loaded, want))

    def verify_report(self) -> dict[str, Any]:
        """With `verify_loads`: {"checked": blocks loaded so far, "mismatched": the prefix hashes of those whose
        bytes differ from the bytes offloaded for that prefix}. Waits for the device."""
        if not self.verify:
            raise ValueError("CpuOffloadConnector: verify_report needs kv_connector_extra_config['verify_loads']=True")
        hashes = [h for checked, _, _ in self._load_checks for h in checked]
        if not hashes:
            return {"checked": 0, "mismatched": []}
        loaded = torch.cat([got for _, got, _ in self._load_checks]).cpu()
        want = torch.cat([w for _, _, w in self._load_checks]).cpu()
        bad = (loaded != want).nonzero().flatten().tolist()
        return {"checked": len(hashes), "mismatched": [hashes[i] for i in bad]}

    def save(self, metadata: CpuOffloadMetadata) -> None:
        """Nothing after the step: blocks leave the GPU when they are evicted, in `load`."""


__all__ = ["CpuOffloadMetadata", "CpuOffloadScheduler", "CpuOffloadWorker", "block_checksums", "num_host_slots",
           "verify_loads"]
