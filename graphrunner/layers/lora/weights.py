"""Persistent LoRA state on the device: the per-step slot metadata and each projection's slots.

`LoraBuffers` (one per runner, a field of `StepBuffers`) holds what the kernels read per step, in
one int32 buffer uploaded with one copy: `starts` [L + 1] (slot s owns `sorted_tokens[starts[s]:
starts[s + 1]]`), then per token row its slot (`token_slot`, -1: no adapter; the torch path masks
by it) and the rows grouped by slot (`sorted_tokens`), interleaved so that a step uploads a prefix
of 2 x its padded token count. `active` says whether the forward being run or captured applies
adapters: a plain Python flag that torch.compile guards on, set before each call, so the graphs
captured without LoRA contain none of its work.

`LoraWeights` (one per adapted projection) holds L slots of A [S, R, K_local] and B [N_local, R]
(S slices of a merged projection, R = max_lora_rank, the scaling folded into B), zero where an
adapter has a smaller rank or does not target a slice. An adapter is loaded into a slot by copy:
the addresses never change, so the captured graphs stay valid.

Tensor parallelism, as vLLM shards it: a column-parallel projection (q|k|v, gate|up) keeps A whole
(its input is replicated) and splits each slice's B rows like the base weight's; a row-parallel one
(o, down) splits A's input columns like the base weight's and keeps B whole, and its LoRA partial
sums are added before the all-reduce: sum_r (x_r A_r^T) B^T = (x A^T) B^T.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from graphrunner.kernels import HAS_TRITON
from graphrunner.layers.gemv import gemv_fits
from graphrunner.layers.linear import GemvMethod, LinearMethod
from graphrunner.layers.lora.kernels import lora_gemv_expand, lora_reference, lora_shrink_expand

__all__ = ["LoraBuffers", "LoraSlice", "LoraWeights"]

_GEMV_SHRINK_MAX_BYTES = 8 << 20

_UPLOAD_SLOTS = 2  # one host buffer filled while the other's copy may be in flight


class LoraBuffers:
    """The per-step slot metadata (module docstring), for up to `max_num_tokens` token rows."""

    def __init__(self, max_loras: int, max_num_tokens: int, device: torch.device) -> None:
        self.max_loras, self.max_num_tokens = max_loras, max_num_tokens
        self.device = device
        size = max_loras + 1 + 2 * max_num_tokens
        self.packed = torch.zeros(size, dtype=torch.int32, device=device)
        self.starts = self.packed[: max_loras + 1]  # [L + 1]
        pairs = self.packed[max_loras + 1:].view(max_num_tokens, 2)
        self.token_slot = pairs[:, 0]  # [T] slot of each token row, -1: none
        self.sorted_tokens = pairs[:, 1]  # [T] token rows grouped by slot
        self.token_slot.fill_(-1)
        is_cuda = device.type == "cuda"
        self._host = [torch.zeros(size, dtype=torch.int32, pin_memory=is_cuda) for _ in range(_UPLOAD_SLOTS)]
        self._host_np = [t.numpy() for t in self._host]
        self._copied = [torch.cuda.Event() if is_cuda else None for _ in range(_UPLOAD_SLOTS)]
        self._slot = 0
        self.active = False  # read by the projections while a forward runs or is captured
        self.version = 0  # bumped by every upload

    def upload(self, req_slots: np.ndarray, query_lens: np.ndarray, num_tokens_padded: int) -> None:
        """Write one step's metadata: request i (query_lens[i] tokens, in batch order) has slot
        req_slots[i] (-1: none); the padded rows up to `num_tokens_padded` have none."""
        L, T = self.max_loras, int(query_lens.sum())
        slot = (self._slot + 1) % _UPLOAD_SLOTS
        copied = self._copied[slot]
        if copied is not None:
            copied.synchronize()  # the copy that last read this host buffer, two uploads ago
        host = self._host_np[slot]
        token_slot = np.repeat(req_slots.astype(np.int32, copy=False), query_lens)
        order = np.argsort(token_slot, kind="stable")  # base rows (-1) first, then slot by slot
        host[: L + 1] = np.searchsorted(token_slot[order], np.arange(L + 1, dtype=np.int32))
        pairs = host[L + 1: L + 1 + 2 * num_tokens_padded].reshape(num_tokens_padded, 2)
        pairs[:T, 0] = token_slot
        pairs[T:, 0] = -1
        pairs[:T, 1] = order
        pairs[T:, 1] = 0
        n = L + 1 + 2 * num_tokens_padded
        self.packed[:n].copy_(self._host[slot][:n], non_blocking=True)
        if copied is not None:
            copied.record(torch.cuda.current_stream(self.device))
        self._slot = slot
        self.version += 1

    def clear(self, num_tokens_padded: int) -> None:
        """Metadata with no adapter rows (capture's dummy batches)."""
        self.upload(np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32), num_tokens_padded)


@dataclass(frozen=True)
class LoraSlice:
    """One slice of a projection's output: its PEFT module name, where its rows sit in this rank's
    output (`offset`, `size`) and which rank's share of the full module it holds (`shard`)."""

    module: str
    offset: int
    size: int
    shard: int


class LoraWeights:
    """L slots of one projection's adapters (module docstring).

    `row_parallel`: A's input columns are split over `tp_size` ranks (o, down); else B's rows are, per
    slice (`slices`). `in_features` is this rank's input width."""

    def __init__(self, buffers: LoraBuffers, slices: Sequence[LoraSlice], in_features: int, *, max_rank: int,
                 row_parallel: bool, tp_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.buffers = buffers
        self.slices = tuple(slices)
        self.row_parallel, self.tp_rank = row_parallel, tp_rank
        self.in_features = in_features
        L, S, R = buffers.max_loras, len(self.slices), max_rank
        out = sum(s.size for s in self.slices)
        self.a = torch.zeros(L, S, R, in_features, dtype=dtype, device=device)  # [L, S, R, K_local]
        self.b = torch.zeros(L, out, R, dtype=dtype, device=device)  # [L, N_local, R], scaled
        self.slice_bounds = tuple((s.offset, s.size) for s in self.slices)
        self.slice_table = torch.tensor(self.slice_bounds, dtype=torch.int32, device=device)  # [S, 2]
        self.max_slice = max(s.size for s in self.slices)
        self.use_triton = HAS_TRITON and self.a.is_cuda
        # Every slot's A rides in a one-row GEMV's launch only while reading it costs less than the shrink
        # launch it saves (a separate norm node cost ~1.5 us of launch and drain on an H100; 8 MiB at an
        # H200's 4.8 TB/s is 1.7 us). Llama-3.1-8B at rank 16 with 8 slots: 1-4 MiB a projection.
        self.gemv_shrink = self.a.numel() * self.a.element_size() <= _GEMV_SHRINK_MAX_BYTES

    @property
    def active(self) -> bool:
        return self.buffers.active

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [T, N_local] += each token row's adapter of x [T, K_local] (in place)."""
        T, buf = x.shape[0], self.buffers
        if self.use_triton:
            # The whole buffer, not `[:T]`: the kernels read rows below starts[L] <= T only, and a slice
            # by the traced token count is a new unbacked size that inductor's pieces refuse.
            torch.ops.graphrunner.lora_shrink_expand(x, out, self.a, self.b, buf.sorted_tokens, buf.starts,
                                                     self.slice_table, self.max_slice)
        else:
            lora_reference(x, out, self.a, self.b, buf.token_slot[:T], self.slice_bounds)

    def project(self, method: LinearMethod, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, K_local] W^T (+ bias) by the projection's `method`, each token row's adapter added. Under
        the single-row GEMV (`GemvMethod`) one opaque op serves every row count: one row runs the GEMV
        over W and every slot's A in one launch, then the expand (`lora_gemv_expand`); several rows the
        GEMM, then the shrink and the expand. A decode step at batch 1 pays one launch a projection for
        its adapters instead of two (while every slot's A is small: `gemv_shrink`)."""
        buf = self.buffers
        if self.use_triton and self.gemv_shrink and isinstance(method, GemvMethod) and weight.dtype == self.a.dtype:
            return torch.ops.graphrunner.lora_linear(x, weight, bias, self.a, self.b, buf.sorted_tokens, buf.starts,
                                                     self.slice_table, self.max_slice, method.tile, method.pdl_rows)
        out = method.linear(x, weight, bias)
        self.apply(x, out)
        return out

    @torch.no_grad()
    def load(self, slot: int, parts: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        """Copy an adapter's modules (full HF A [r, in], B [out, r], scaling; by PEFT module name) into
        `slot`, this rank's share of each; slices it does not target are zeroed."""
        a, b = self.a[slot], self.b[slot]
        a.zero_()
        b.zero_()
        for i, s in enumerate(self.slices):
            part = parts.get(s.module)
            if part is None:
                continue
            lora_a, lora_b, scale = part
            r = lora_a.shape[0]
            if self.row_parallel:
                lora_a = lora_a.narrow(1, self.tp_rank * self.in_features, self.in_features)
            else:
                lora_b = lora_b.narrow(0, s.shard * s.size, s.size)
            a[i, :r].copy_(lora_a)
            b[s.offset:s.offset + s.size, :r].copy_(lora_b.float() * scale)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()


def _op_impl(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, sorted_tokens: torch.Tensor,
             starts: torch.Tensor, slices: torch.Tensor, max_slice: int) -> None:
    lora_shrink_expand(x, out, a, b, sorted_tokens, starts, slices, max_slice)


# Opaque to torch.compile (as the other Triton kernels of the model): traced once, the launches run as is.
lora_shrink_expand_op = torch.library.custom_op("graphrunner::lora_shrink_expand", _op_impl,
                                                mutates_args=("out",))


@lora_shrink_expand_op.register_fake
def _lora_shrink_expand_fake(x, out, a, b, sorted_tokens, starts, slices, max_slice) -> None:
    return None


def _lora_linear_impl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor,
                      b: torch.Tensor, sorted_tokens: torch.Tensor, starts: torch.Tensor, slices: torch.Tensor,
                      max_slice: int, tile: Sequence[int], pdl_rows: int) -> torch.Tensor:
    if gemv_fits(x, weight, bias):
        return lora_gemv_expand(x, weight, bias, a, b, sorted_tokens, starts, slices, max_slice, tuple(tile),  # type: ignore[arg-type]
                                pdl_rows)
    out = F.linear(x, weight, bias)
    lora_shrink_expand(x, out, a, b, sorted_tokens, starts, slices, max_slice)
    return out


# The row count is known only at run time under torch.compile: the choice is made inside the op.
lora_linear_op = torch.library.custom_op("graphrunner::lora_linear", _lora_linear_impl, mutates_args=())


@lora_linear_op.register_fake
def _lora_linear_fake(x, weight, bias, a, b, sorted_tokens, starts, slices, max_slice, tile, pdl_rows) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])
