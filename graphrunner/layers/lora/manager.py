"""LoraManager: the runner's host side of multi-LoRA serving.

    manager = LoraManager(lora_config, model, buffers, model_config, tp_rank=..., dtype=..., device=...)
    manager.check(scheduler_output)        # validation: adapters readable, <= max_loras in the step
    manager.update(scheduler_output, removed_req_ids)
    manager.has_adapters(req_ids)          # dispatch: does the batch need the LoRA graphs?
    manager.prepare(batch_key, req_ids, query_lens, num_tokens_padded)   # slots + one upload

It keeps which adapter each live request runs with, an LRU of `max_cpu_loras` adapters read from
their folders (host memory), and an LRU of the `max_loras` device slots. `prepare` puts every adapter
of a batch into a slot (copying it in, over the least recently used slot the batch does not need)
and uploads the batch's per-token slots. A batch never has more than `max_loras` distinct adapters:
`check` refuses such a step before any state changes.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from graphrunner.config import LoRAConfig, ModelConfig
from graphrunner.layers.lora.peft import LoraAdapter, load_adapter
from graphrunner.layers.lora.weights import LoraBuffers, LoraSlice, LoraWeights
from graphrunner.protocol import LoRARequest, SchedulerOutput

logger = logging.getLogger("graphrunner.lora")

__all__ = ["LoraManager", "attach_lora"]


def attach_lora(model: Any, buffers: LoraBuffers, max_rank: int, dtype: torch.dtype,
                device: torch.device) -> dict[tuple[int, str], LoraWeights]:
    """Give every dense decoder projection of `model` (this rank's share) its `LoraWeights`; returns them
    by (global layer index, projection attribute). Mixture-of-experts MLPs get none (peft.py refuses
    adapters on them)."""
    from graphrunner.layers.linear import MergedColumnLinear, QKVLinear, RowLinear

    found: dict[tuple[int, str], LoraWeights] = {}

    def attach(index: int, name: str, layer: Any, slices: list[LoraSlice], row_parallel: bool) -> None:
        weights = LoraWeights(buffers, slices, layer.weight.shape[1], max_rank=max_rank, row_parallel=row_parallel,
                              tp_rank=layer.tp_rank, dtype=dtype, device=device)
        layer.lora = weights
        found[(index, name)] = weights

    m = model.model
    for index, layer in enumerate(m.local_layers, start=m.start_layer):
        qkv: QKVLinear = layer.self_attn.qkv_proj
        q, kv = qkv.q_size, qkv.kv_size
        attach(index, "qkv_proj", qkv, [LoraSlice("q_proj", 0, q, qkv.tp_rank),
                                        LoraSlice("k_proj", q, kv, qkv.kv_tp_rank),
                                        LoraSlice("v_proj", q + kv, kv, qkv.kv_tp_rank)], False)
        o: RowLinear = layer.self_attn.o_proj
        attach(index, "o_proj", o, [LoraSlice("o_proj", 0, o.out_features, 0)], True)
        gate_up = getattr(layer.mlp, "gate_up_proj", None)
        if isinstance(gate_up, MergedColumnLinear):
            g, u = gate_up.local_sizes
            attach(index, "gate_up_proj", gate_up, [LoraSlice("gate_proj", 0, g, gate_up.tp_rank),
                                                    LoraSlice("up_proj", g, u, gate_up.tp_rank)], False)
            down: RowLinear = layer.mlp.down_proj
            attach(index, "down_proj", down, [LoraSlice("down_proj", 0, down.out_features, 0)], True)
    return found


class LoraManager:
    """Adapters per request, the host LRU, the device slots and the per-step upload (module docstring)."""

    def __init__(self, config: LoRAConfig, model: Any, buffers: LoraBuffers, model_config: ModelConfig,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.config = config
        self.model_config = model_config
        self.buffers = buffers
        self.weights = attach_lora(model, buffers, config.max_lora_rank, dtype, device)
        self.layers: dict[int, dict[str, LoraWeights]] = {}
        for (index, name), w in self.weights.items():
            self.layers.setdefault(index, {})[name] = w
        self.requests: dict[str, LoRARequest] = {}  # live requests that run with an adapter
        self.adapter_of: dict[str, int] = {}  # the same requests' adapter ids
        self.live: dict[int, int] = {}  # adapter id -> live requests running with it
        self._known: dict[int, LoRARequest] = {}  # adapter id -> the request that named it last
        self.cpu: OrderedDict[int, LoraAdapter] = OrderedDict()  # int id -> adapter, least recent first
        self.slots: list[int | None] = [None] * config.max_loras  # adapter id in each device slot
        self.slot_of: dict[int, int] = {}
        self._slot_lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(config.max_loras))
        self.num_loads = 0  # adapters copied into a slot, for tests and stats
        # (batch key, slot generation, buffers version) when the device metadata is that batch's
        self._uploaded: tuple[int, int, int] | None = None
        self._generation = 0  # bumped by every slot load

    # ---- validation and request bookkeeping -------------------------------------------
    def check(self, so: SchedulerOutput) -> None:
        """Read every new request's adapter (host LRU) and check that the step has at most `max_loras`
        distinct adapters; ValueError naming the request and the folder or the limit, before any state
        changes."""
        if not so.scheduled_new_reqs and len(self.live) <= self.config.max_loras:
            return  # no step of the live requests can exceed the limit (steady decoding ends here)
        new_ids: dict[str, LoRARequest | None] = {}
        for new in so.scheduled_new_reqs:
            lora = getattr(new, "lora_request", None)
            if lora is not None:
                if not isinstance(lora, LoRARequest):
                    raise ValueError(f"request {new.req_id!r}: lora_request must be a LoRARequest, got "
                                     f"{type(lora).__name__}")
                try:
                    self.adapter(lora)
                except ValueError as e:
                    raise ValueError(f"request {new.req_id!r}: {e}") from None
            new_ids[new.req_id] = lora
        if len(self.live.keys() | {r.lora_int_id for r in new_ids.values() if r is not None}) <= self.config.max_loras:
            return
        distinct = set()
        for req_id in so.num_scheduled_tokens:
            lora = new_ids[req_id] if req_id in new_ids else self.requests.get(req_id)
            if lora is not None:
                distinct.add(lora.lora_int_id)
        if len(distinct) > self.config.max_loras:
            raise ValueError(f"the step schedules {len(distinct)} distinct LoRA adapters {sorted(distinct)}, "
                             f"above max_loras={self.config.max_loras}")

    def update(self, so: SchedulerOutput, removed: Iterable[str]) -> None:
        """Follow the step's removals and admissions (after the state update)."""
        live = self.live
        for req_id in removed:
            lora = self.requests.pop(req_id, None)
            if lora is not None:
                del self.adapter_of[req_id]
                live[lora.lora_int_id] -= 1
                if not live[lora.lora_int_id]:
                    del live[lora.lora_int_id]
        for new in so.scheduled_new_reqs:
            lora = getattr(new, "lora_request", None)
            if lora is not None:
                self.requests[new.req_id] = lora
                self.adapter_of[new.req_id] = lora.lora_int_id
                live[lora.lora_int_id] = live.get(lora.lora_int_id, 0) + 1
                self._known[lora.lora_int_id] = lora

    @property
    def num_live(self) -> int:
        """Live requests that run with an adapter."""
        return len(self.requests)

    def has_adapters(self, req_ids: Iterable[str]) -> bool:
        requests = self.requests
        return bool(requests) and any(r in requests for r in req_ids)

    # ---- host LRU -----------------------------------------------------------------------
    def adapter(self, lora: LoRARequest) -> LoraAdapter:
        """`lora`'s adapter from the host LRU, read from its folder when not cached (the least recently
        used of `max_cpu_loras` is dropped; a dropped adapter is read again when it is needed)."""
        cached = self.cpu.get(lora.lora_int_id)
        if cached is not None:
            self.cpu.move_to_end(lora.lora_int_id)
            return cached
        adapter = load_adapter(lora, self.model_config, self.config.max_lora_rank)
        self.cpu[lora.lora_int_id] = adapter
        capacity = self.config.max_cpu_loras
        assert capacity is not None, "LoRAConfig resolves it"
        while len(self.cpu) > capacity:
            self.cpu.popitem(last=False)
        logger.info("LoRA: read %s (rank %d, %s)", lora, adapter.rank, sorted(adapter.targets()))
        return adapter

    # ---- device slots -------------------------------------------------------------------
    def prepare(self, batch_key: int, req_ids: list[str], query_lens: np.ndarray, num_tokens_padded: int) -> None:
        """Put the batch's adapters into slots and upload its per-token slots (skipped when the device
        already holds this batch's metadata and no slot changed since)."""
        if self._uploaded == (batch_key, self._generation, self.buffers.version):
            return  # steady decoding: the same batch, its adapters still in their slots
        # Int keys and C-level map calls: hashing the LoRARequest dataclasses instead cost ~70 us at 256 rows.
        ids = list(map(self.adapter_of.get, req_ids))
        needed = set(ids)
        needed.discard(None)
        slot: dict[int | None, int] = {None: -1}
        for adapter_id in needed:
            slot[adapter_id] = self._ensure_slot(adapter_id, needed)  # type: ignore[arg-type]
        req_slots = np.fromiter(map(slot.__getitem__, ids), dtype=np.int32, count=len(ids))
        self.buffers.upload(req_slots, query_lens, num_tokens_padded)
        self._uploaded = (batch_key, self._generation, self.buffers.version)

    def _ensure_slot(self, adapter_id: int, batch_ids: set[int]) -> int:
        """`adapter_id`'s slot, loading it over the least recently used slot no adapter of the batch
        (`batch_ids`) holds."""
        slot = self.slot_of.get(adapter_id)
        if slot is not None:
            self._slot_lru.move_to_end(slot)
            return slot
        needed = {self.slot_of[i] for i in batch_ids if i in self.slot_of}
        slot = next(s for s in self._slot_lru if s not in needed)  # check() bounds the batch by max_loras
        lora = self._known[adapter_id]
        adapter = self.adapter(lora)
        old = self.slots[slot]
        if old is not None:
            del self.slot_of[old]
        for index, projections in self.layers.items():
            for w in projections.values():
                parts = {s.module: adapter.modules[(index, s.module)] for s in w.slices
                         if (index, s.module) in adapter.modules}
                w.load(slot, parts)
        self.slots[slot], self.slot_of[adapter_id] = adapter_id, slot
        self._slot_lru.move_to_end(slot)
        self._generation += 1
        self.num_loads += 1
        logger.debug("LoRA: %s into slot %d (replacing %s)", lora, slot, old)
        return slot
