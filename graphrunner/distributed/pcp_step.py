"""Prefill context parallelism in the step: split a prefill's tokens over the PCP ranks.

`PrefillContextParallel` is owned by a runner whose PCP group has P > 1 ranks. Every rank of
the group runs the same scheduler over the same requests (SPMD, like TP), so every rank
builds the same `PCPPartition` (graphrunner.distributed.pcp) of a step and runs the same
descriptor. A step that schedules only whole entries (decodes: query length <= 1 + k) is
left alone: every rank computes it whole, which is what PCP prescribes for decodes, so
FULL decode graphs are the plain ones. A step with a prefill entry (a *split step*) runs:

1. The global input preparation, unchanged, into this object's global buffers (the
   batch's `input_ids`, `positions` and `slot_mapping` views point here for the step).
2. `localize`: each rank gathers its local rows into the runner's input buffers (the
   addresses the PIECEWISE pieces were captured with), padding rows reading their entry's
   first token at RoPE position 0; the attention metadata becomes this rank's attention
   segments (`PCPPartition.attention_segments`), and the layers' K/V write goes through
   `KVAllGather`: the local k/v are all-gathered over the group and every real token is
   written once, at its global slot, into this rank's (replicated) KV cache. Queries then
   attend to the cache, which holds every earlier token of their request.
3. `restore`: after the last layer the local hidden states are all-gathered and put back in
   the global token order, so logits, sampling, prompt logprobs and speculative
   verification see the global batch, identical on every rank.

Split steps run PIECEWISE or eagerly (a FULL descriptor is downgraded to NONE: the per-step
index arrays vary in length). The KV cache is replicated across the group: PCP buys prefill
compute, not capacity (that is DCP's). Everything here runs outside the piece graphs; the
all-gathers are `graphrunner::tp_all_gather` on the PCP device group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from graphrunner.attention.base import AttentionMetadata
from graphrunner.distributed.groups import ParallelGroup
from graphrunner.distributed.pcp import PCPPartition
from graphrunner.limits import StepLimits
from graphrunner.step.inputs import InputBatch, InputBuffers


@dataclass
class KVAllGather:
    """The K/V write of a split step: all-gather the local k/v, write at the gathered slots."""

    group_name: str
    world_size: int
    slot_mapping: torch.Tensor  # [P * T_local_pad] int64: global slot of each gathered row, -1 = skip

    def gather(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """k, v [T_local_pad, Hkv, D] -> ([P * T_local_pad, Hkv, D] twice, their slots)."""
        kv = torch.stack((k, v))  # [2, T, Hkv, D]: one collective for both
        g = torch.ops.graphrunner.tp_all_gather(kv, self.world_size, self.group_name)  # [P, 2, T, Hkv, D]
        g = g.transpose(0, 1).reshape(2, -1, *k.shape[1:])
        return g[0], g[1], self.slot_mapping


@dataclass
class PCPBatch:
    """One split step's local side: its partition, the model's inputs and the device index arrays."""

    partition: PCPPartition
    num_local_padded: int  # T_local_pad: the descriptor's token count
    input_ids: torch.Tensor  # [T_local_pad] int32, view of the runner's input buffer
    positions: torch.Tensor  # [T_local_pad] int64, view of the runner's input buffer
    metadata: AttentionMetadata  # this rank's attention segments, K/V written through kv_gather
    gather_index: torch.Tensor  # [T_local_pad] int64: global row each local row reads
    is_real: torch.Tensor  # [T_local_pad] int64: 1 for real rows, 0 for padding
    kv_source: torch.Tensor  # [P * T_local_pad] int64: global token of each gathered row, -1 = no write
    segment_entry: torch.Tensor  # [A] int64: batch entry of each attention segment
    segment_host_seq_lens: torch.Tensor  # [A] int64: seq_len of prefill runs (host-exact), 0 for padding runs
    segment_whole: torch.Tensor  # [A] int64: 1 where the entry's device seq_len applies (decodes)
    restore_index: torch.Tensor  # [T] int64: gathered row of each global token


class PrefillContextParallel:
    """Split steps over a PCP group (module docstring). One per runner, P > 1 only."""

    def __init__(self, group: ParallelGroup, limits: StepLimits, inputs: InputBuffers, device: torch.device) -> None:
        if group.world_size < 2 or group.device_group is None:
            raise ValueError(f"PrefillContextParallel needs a PCP group of >= 2 ranks, got {group.world_size}")
        self.group_name = group.device_group_name
        self.size, self.rank = group.world_size, group.rank_in_group
        self.limits = limits
        self.inputs = inputs
        self.device = device
        T, R, M = limits.max_num_tokens, limits.max_num_reqs, limits.max_num_blocks_per_req
        self.max_segments = 4 * R  # <= 2 runs per segment, <= 2 segments per entry
        # The global side of a split step (the batch's views point here).
        self.global_input_ids = torch.zeros(T, dtype=torch.int32, device=device)
        self.global_positions = torch.zeros(T, dtype=torch.int64, device=device)
        self.global_slot_mapping = torch.zeros(T, dtype=torch.int64, device=device)
        # This rank's attention metadata over its segments.
        self.query_start_loc = torch.zeros(self.max_segments + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(self.max_segments, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(self.max_segments, M, dtype=torch.int32, device=device)
        self.kv_slots = torch.zeros(self.size * T, dtype=torch.int64, device=device)
        self.num_split_steps = 0  # split steps run so far (tests, logs)

    # ---- host side: partition and upload ---------------------------------------------------
    def partition(self, query_lens: np.ndarray, num_computed: np.ndarray) -> PCPPartition | None:
        """The step's partition, or None when it has no prefill entry (every rank runs it whole).

        query_lens, num_computed: [R] in batch order (num_computed: host mirror before the step).
        """
        whole = query_lens <= self.limits.uniform_decode_query_len  # decodes (and 1-token chunks) stay whole
        if bool(whole.all()):
            return None
        return PCPPartition.build(query_lens, num_computed, whole, self.size, self.rank)

    def bind(self, batch: InputBatch, part: PCPPartition, num_local_padded: int) -> None:
        """Point `batch`'s global token views at this object's buffers and upload the step's
        index arrays; sets `batch.pcp`. `num_local_padded`: the descriptor's token count."""
        T = batch.num_tokens
        batch.input_ids = self.global_input_ids[:T]
        batch.positions = self.global_positions[:T]
        batch.slot_mapping = batch.attn_metadata.slot_mapping = self.global_slot_mapping[:T]
        entry, start_loc, host_seq, whole = part.attention_segments()
        A, Tl = len(entry), num_local_padded
        gather = np.zeros(Tl, dtype=np.int64)
        gather[: part.num_local_tokens] = part.gather_index
        real = np.zeros(Tl, dtype=np.int64)
        real[: part.num_local_tokens] = part.is_real
        source = np.where(part.gathered_kv_write_mask(Tl), part.gathered_global_index(Tl), -1)
        host = np.concatenate([gather, real, source, entry, host_seq, whole, part.restore_index(Tl)]).astype(np.int64)
        dev = _upload(host, self.device)
        sizes = [Tl, Tl, self.size * Tl, A, A, A, T]
        views = torch.split(dev, sizes)
        self.query_start_loc[: A + 1].copy_(_upload(start_loc.astype(np.int32), self.device))
        seg_lens = np.diff(start_loc)
        metadata = AttentionMetadata(
            query_start_loc=self.query_start_loc[: A + 1], seq_lens=self.seq_lens[:A], block_table=self.block_table[:A],
            slot_mapping=self.kv_slots[: self.size * Tl], num_reqs=A, num_tokens=Tl,
            max_query_len=int(seg_lens.max()) if A else 0,
            max_seq_len=max(batch.attn_metadata.max_seq_len, int(host_seq.max()) if A else 0),
        )
        metadata.kv_gather = KVAllGather(self.group_name, self.size, metadata.slot_mapping)
        batch.pcp = PCPBatch(part, Tl, self.inputs.input_ids[:Tl], self.inputs.positions[:Tl], metadata, *views)
        self.num_split_steps += 1

    # ---- device side, in the step body ----------------------------------------------------
    def localize(self, batch: InputBatch) -> None:
        """After the global input preparation: this rank's model inputs and attention metadata."""
        p = batch.pcp
        assert p is not None
        torch.index_select(batch.input_ids, 0, p.gather_index, out=p.input_ids)
        torch.mul(torch.index_select(batch.positions, 0, p.gather_index), p.is_real, out=p.positions)
        slots = torch.index_select(batch.slot_mapping, 0, p.kv_source.clamp(min=0))
        p.metadata.slot_mapping.copy_(torch.where(p.kv_source >= 0, slots, -1))
        entry_seq = torch.index_select(batch.seq_lens, 0, p.segment_entry).to(torch.int64)
        p.metadata.seq_lens.copy_(torch.where(p.segment_whole > 0, entry_seq, p.segment_host_seq_lens))
        torch.index_select(batch.block_table, 0, p.segment_entry, out=p.metadata.block_table)

    def restore(self, batch: InputBatch, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T_local_pad, H] on every rank -> [T, H] in the global token order."""
        p = batch.pcp
        assert p is not None
        gathered = torch.ops.graphrunner.tp_all_gather(hidden, self.size, self.group_name)  # [P, T_local_pad, H]
        return gathered.reshape(-1, hidden.shape[-1]).index_select(0, p.restore_index)


def _upload(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device` without a sync (pinned staging on CUDA)."""
    t = torch.from_numpy(np.ascontiguousarray(host))
    if device.type != "cuda":
        return t.clone()
    return t.pin_memory().to(device, non_blocking=True)


def make_prefill_context_parallel(group: ParallelGroup | None, limits: StepLimits, inputs: InputBuffers,
                                  device: torch.device) -> PrefillContextParallel | None:
    """The runner's PCP side, or None without PCP (a group of one)."""
    if group is None or group.world_size == 1:
        return None
    return PrefillContextParallel(group, limits, inputs, device)


__all__ = ["KVAllGather", "PCPBatch", "PrefillContextParallel", "make_prefill_context_parallel"]
