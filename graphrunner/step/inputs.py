"""InputBuffers (persistent, max-size) and InputBatch (one step's views of them).

Every tensor the step reads or writes is a view of a buffer allocated here once, at
maximum size (docs/architecture.md §4). Per step the runner writes the two host arrays that only
the scheduler knows (idx_mapping and query_start_loc) into one pinned staging buffer
and uploads it with a single H2D copy; everything else is derived on the device.

The pinned staging buffer is double-buffered: with async scheduling the host prepares
step N + 1 while step N's upload may still be queued, so each upload writes the slot
the previous one did not use, after waiting on the event recorded behind that slot's
last copy (already complete in practice: it is two uploads old).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from graphrunner.attention.base import AttentionMetadata
from graphrunner.state.features import SamplingFeatures

# Pinned staging slots for the per-step upload: one being filled while one may be in flight.
NUM_UPLOAD_SLOTS = 2


class InputBuffers:
    """Owns every static tensor a step touches, sized for the largest batch."""

    def __init__(self, max_num_reqs: int, max_num_tokens: int, max_num_blocks_per_req: int, device: torch.device):
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.device = device
        # idx_mapping [max_reqs] followed by query_start_loc [max_reqs + 1]: one packed
        # buffer so that a step's host inputs travel in one copy.
        packed_len = 2 * max_num_reqs + 1
        self._is_cuda = device.type == "cuda"
        self._host_slots = [
            torch.zeros(packed_len, dtype=torch.int32, pin_memory=self._is_cuda) for _ in range(NUM_UPLOAD_SLOTS)
        ]
        self._host_slots_np = [t.numpy() for t in self._host_slots]
        # One reusable event per slot, recorded behind the slot's latest copy (CUDA only).
        self._slot_copied = [torch.cuda.Event() if self._is_cuda else None for _ in range(NUM_UPLOAD_SLOTS)]
        self._slot = 0
        # Bumped by every upload: the device `packed` holds the host arrays of upload
        # number `version` (lets the runner skip re-uploading an unchanged batch).
        self.version = 0
        self.packed = torch.zeros(packed_len, dtype=torch.int32, device=device)
        self.idx_mapping = self.packed[:max_num_reqs]  # [max_reqs] int32: batch entry -> state row
        self.query_start_loc = self.packed[max_num_reqs:]  # [max_reqs + 1] int32

        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)  # [T]
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)  # [T]
        self.slot_mapping = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)  # [T]
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)  # [R]
        self.logits_indices = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)  # [R]
        self.block_table = torch.zeros(max_num_reqs, max_num_blocks_per_req, dtype=torch.int32, device=device)  # [R, M]
        self.sampled = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)  # [R]

    def upload(self, idx_mapping: np.ndarray, query_lens: np.ndarray, num_reqs_padded: int, pad_row: int) -> None:
        """Write one step's host arrays (padded) and copy them to the device.

        Padded entries point at `pad_row` (the scratch row) and have query length 0,
        so query_start_loc stays non-decreasing and ends at the real token count.
        """
        n = len(idx_mapping)
        slot = (self._slot + 1) % NUM_UPLOAD_SLOTS
        copied = self._slot_copied[slot]
        if copied is not None:
            copied.synchronize()  # the copy that last read this slot (two uploads ago); no-op if never recorded
        host = self._host_slots_np[slot]
        R = self.max_num_reqs
        host[:n] = idx_mapping
        host[n:R] = pad_row
        qsl = host[R:]
        qsl[0] = 0
        np.cumsum(query_lens, out=qsl[1 : n + 1])
        qsl[n + 1 :] = qsl[n]
        self.packed.copy_(self._host_slots[slot], non_blocking=True)
        if copied is not None:
            copied.record(torch.cuda.current_stream(self.device))
        self._slot = slot
        self.version += 1

    @property
    def host_packed(self) -> torch.Tensor:
        """The pinned host buffer of the latest upload."""
        return self._host_slots[self._slot]


@dataclass
class InputBatch:
    """One step: the batch order, its sizes, and views of the persistent buffers."""

    req_ids: list[str]  # batch order (decodes first)
    idx_mapping_np: np.ndarray  # [num_reqs] state rows
    query_lens_np: np.ndarray  # [num_reqs] scheduled tokens per request
    num_reqs: int
    num_tokens: int
    num_reqs_padded: int
    num_tokens_padded: int
    sampling_features: SamplingFeatures
    # Views (padded sizes):
    idx_mapping: torch.Tensor  # [R_pad] int32
    query_start_loc: torch.Tensor  # [R_pad + 1] int32
    input_ids: torch.Tensor  # [T_pad] int32
    positions: torch.Tensor  # [T_pad] int64
    seq_lens: torch.Tensor  # [R_pad] int32
    slot_mapping: torch.Tensor  # [T_pad] int64
    block_table: torch.Tensor  # [R_pad, M] int32
    logits_indices: torch.Tensor  # [R_pad] int64
    sampled: torch.Tensor  # [R_pad] int32
    attn_metadata: AttentionMetadata
    # Prefill context parallelism: this rank's side of a split step (pcp_step.PCPBatch), else None.
    pcp: Any = None
    # LoRA: some row has an adapter (the step runs the LoRA graphs), and the number that names this
    # batch's slot metadata upload (layers/lora/manager.py skips re-uploading it).
    has_lora: bool = False
    lora_key: int = 0

    @classmethod
    def from_buffers(
        cls,
        buffers: InputBuffers,
        req_ids: list[str],
        idx_mapping_np: np.ndarray,
        query_lens_np: np.ndarray,
        num_reqs_padded: int,
        num_tokens_padded: int,
        sampling_features: SamplingFeatures,
        max_seq_len: int,
    ) -> InputBatch:
        R, T = num_reqs_padded, num_tokens_padded
        qsl = buffers.query_start_loc[: R + 1]
        seq_lens = buffers.seq_lens[:R]
        block_table = buffers.block_table[:R]
        slot_mapping = buffers.slot_mapping[:T]
        metadata = AttentionMetadata(
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=slot_mapping,
            num_reqs=R,
            num_tokens=T,
            max_query_len=int(query_lens_np.max()) if len(query_lens_np) else 0,
            max_seq_len=max_seq_len,
        )
        return cls(
            req_ids=req_ids,
            idx_mapping_np=idx_mapping_np,
            query_lens_np=query_lens_np,
            num_reqs=len(req_ids),
            num_tokens=int(query_lens_np.sum()),
            num_reqs_padded=R,
            num_tokens_padded=T,
            sampling_features=sampling_features,
            idx_mapping=buffers.idx_mapping[:R],
            query_start_loc=qsl,
            input_ids=buffers.input_ids[:T],
            positions=buffers.positions[:T],
            seq_lens=seq_lens,
            slot_mapping=slot_mapping,
            block_table=block_table,
            logits_indices=buffers.logits_indices[:R],
            sampled=buffers.sampled[:R],
            attn_metadata=metadata,
        )
