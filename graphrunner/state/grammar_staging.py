"""Persistent staging of a step's grammar masks: the engine fills a host block, one copy moves it.

A constrained step's masks are `[M, W]` int32 (W = ceil(V / 32); 1.2 MB at 64 rows of a 152k
vocabulary). They used to travel as a fresh pinned block the engine filled, plus the placement
indices through another fresh pinned block: two allocations of the caching host allocator, two
device allocations, two copies. Each slot here is one persistent host block

    [ index entries: int64, right-aligned against the rows | mask rows: int32 [rows, W] ]

The engine fills the rows in place (`block`), the runner writes the step's indices just in front
of them (`upload`), and ONE copy of the used span lands at the same offsets of a persistent
device block, from which the caller runs at most one fill and one scatter. Where the rows go to
consecutive slots of the destination (state rows in order, every slot written) `send_rows`
copies them straight into place: no index, no kernel.

Reuse: `num_slots` slots, taken in turn. A slot is handed out again only once the copy that read
it has completed (an event recorded after the copy; the step that used it is normally long done,
so the wait is a query). A block the engine holds is therefore valid until `num_slots` more
blocks are taken: the engine uploads each step's masks before it fills the next step's (vLLM's
structured-output manager reuses one bitmask buffer the same way).

On CUDA the copy and its event go through the driver (`capture.cuda_driver`) where it can be
used: ~1 us each instead of torch's several (the copy also skips the caching host allocator's
bookkeeping, which persistent blocks do not need). Without it, torch's copy_ and Event.record.
On a CPU the slot itself is what the scatter reads: no copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from capture.cuda_driver import CudaDriver
from graphrunner.state.staging import host_buffer

__all__ = ["GrammarStaging"]

_MIN_ROWS = 16  # a slot's smallest row capacity (growth doubles it)


class GrammarStaging:
    """Host slots and one device block for a step's grammar masks and their placement indices."""

    def __init__(self, device: torch.device | str, words: int, num_slots: int = 2) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.words = words  # W: int32 words per mask row
        self.num_slots = num_slots
        self.is_cuda = self.device.type == "cuda"
        self.rows = 0  # mask rows each slot holds
        self.head = 0  # int64 index entries in front of the rows
        self._host: list[torch.Tensor] = []  # per slot [2 * head + rows * W] int32 (pinned on CUDA)
        self._index_np: list[np.ndarray] = []  # per slot [head] int64: its index entries
        self._rows_host: list[torch.Tensor] = []  # per slot [rows, W] int32: its mask rows
        self._rows_ptr: list[int] = []  # per slot: where its mask rows start (identifies the engine's block)
        # Per slot, what the scatter reads (the device block on CUDA, the slot itself on a CPU):
        self._read_index: list[torch.Tensor] = []  # [head] int64
        self._read_rows: list[torch.Tensor] = []  # [rows, W] int32
        self._events: list[Any] = []  # per slot: recorded after the copy that read it (CUDA)
        self._next = 0
        self._device_block: torch.Tensor | None = None  # [2 * head + rows * W] int32 (CUDA)
        self._driver: CudaDriver | None = None
        self._stream_of: Any = None  # device index -> raw current stream (driver path)

    # ---- the engine's side ------------------------------------------------------------
    def block(self, num_rows: int, words: int) -> torch.Tensor:
        """[num_rows, words] int32 host memory to fill with a step's masks, uploaded by the next
        `upload` / `send_rows` without a host copy. Another width: a fresh block (copied then)."""
        if words != self.words:
            return host_buffer((num_rows, words), torch.int32, self.device)
        self._ensure(num_rows, 0)
        return self._rows_host[self._take()][:num_rows]

    # ---- the runner's side --------------------------------------------------------------
    def upload(self, mask: np.ndarray | None, pinned: torch.Tensor | None,
               index: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(index [K] int64, rows [M, W] int32) readable on the device, after one copy: `mask`
        ([M, w <= W]; None: no rows) from the engine's block (`pinned`, as `block` gave it) or
        copied into a slot (words past w are 0), `index` ([K] int64) written in front of it."""
        num_rows, k = (0 if mask is None else len(mask)), len(index)
        slot = self._own_slot(pinned, num_rows) if mask is not None else None
        if self._ensure(num_rows, k):
            slot = None  # grown: the engine's block lives in the old slots, copied below
        if slot is None:
            slot = self._take()
            if mask is not None and num_rows:
                self._copy_in(slot, mask)
        head, words = self.head, self.words
        self._index_np[slot][head - k :] = index
        lo, hi = 2 * (head - k), 2 * head + num_rows * words  # int32 words of the span to copy
        self._send(slot, lo, hi)
        return self._read_index[slot][head - k :], self._read_rows[slot][:num_rows]

    def send_rows(self, mask: np.ndarray, pinned: torch.Tensor | None, dst: torch.Tensor, first: int) -> None:
        """dst[first : first + M] = mask (dst: [N, W] contiguous int32 on the device; `mask` and
        `pinned` as in `upload`): one copy straight into place."""
        num_rows, words = len(mask), self.words
        slot = self._own_slot(pinned, num_rows)
        if self._ensure(num_rows, 0):
            slot = None
        if slot is None:
            slot = self._take()
            self._copy_in(slot, mask)
        src = self._rows_host[slot]
        if self._driver is not None and dst.is_contiguous():
            nbytes = num_rows * words * 4
            stream = self._stream_of(self.device.index)
            self._driver.memcpy_htod_async(dst.data_ptr() + first * words * 4, self._rows_ptr[slot], nbytes, stream)
            self._driver.event_record(self._events[slot].cuda_event, stream)
            return
        dst[first : first + num_rows].copy_(src[:num_rows], non_blocking=self.is_cuda)
        if self.is_cuda:
            self._events[slot].record()

    # ---- slots ------------------------------------------------------------------------
    def _own_slot(self, pinned: torch.Tensor | None, num_rows: int) -> int | None:
        """The slot whose block `pinned` is (the engine filled it in place), else None."""
        if pinned is None or num_rows > self.rows or pinned.dtype != torch.int32:
            return None
        ptr = pinned.data_ptr()
        for slot, start in enumerate(self._rows_ptr):
            if start == ptr:
                return slot if tuple(pinned.shape) == (num_rows, self.words) else None
        return None

    def _take(self) -> int:
        """The next slot, once the last copy that read it has completed."""
        slot = self._next
        self._next = (slot + 1) % self.num_slots
        if self.is_cuda:
            self._events[slot].synchronize()
        return slot

    def _copy_in(self, slot: int, mask: np.ndarray) -> None:
        """A mask from elsewhere into the slot's rows; words past its width forbid (0)."""
        rows = self._rows_host[slot].numpy()
        width = mask.shape[1]
        rows[: len(mask), :width] = mask
        rows[: len(mask), width:] = 0

    def _ensure(self, num_rows: int, num_index: int) -> bool:
        """Grow every slot (and the device block) to hold `num_rows` rows and `num_index` index
        entries; True if it grew (after waiting for every copy that reads the old slots)."""
        if self._host and num_rows <= self.rows and num_index <= self.head:
            return False
        rows = max(_MIN_ROWS, self.rows)
        while rows < num_rows:
            rows *= 2
        head = max(num_index, self.head, 4 * rows)  # fill rows + destinations (+ gather sources)
        for event in self._events:  # the driver's copies are not booked in the caching host allocator
            event.synchronize()
        self._allocate(rows, head)
        return True

    def _allocate(self, rows: int, head: int) -> None:
        self.rows, self.head, words = rows, head, self.words
        size = 2 * head + rows * words
        self._host = [host_buffer((size,), torch.int32, self.device) for _ in range(self.num_slots)]
        self._index_np = [h[: 2 * head].view(torch.int64).numpy() for h in self._host]
        self._rows_host = [h[2 * head :].view(rows, words) for h in self._host]
        self._rows_ptr = [r.data_ptr() for r in self._rows_host]
        read = self._host
        if self.is_cuda:
            self._device_block = torch.empty(size, dtype=torch.int32, device=self.device)  # one: copies are in order
            read = [self._device_block] * self.num_slots
        self._read_index = [r[: 2 * head].view(torch.int64) for r in read]
        self._read_rows = [r[2 * head :].view(rows, words) for r in read]
        if not self.is_cuda:
            return
        if not self._events:
            self._events = [torch.cuda.Event() for _ in range(self.num_slots)]
            for event in self._events:
                event.record()  # torch creates the CUDA event at its first record
            if self.device.index == torch.cuda.current_device():  # the driver works in the current context
                self._driver = CudaDriver.load()
                self._stream_of = torch._C._cuda_getCurrentRawStream

    def _send(self, slot: int, lo: int, hi: int) -> None:
        """Copy int32 words [lo, hi) of the slot to the device block, then mark the slot busy."""
        if not self.is_cuda or hi <= lo:
            return
        assert self._device_block is not None
        if self._driver is not None:
            stream = self._stream_of(self.device.index)
            dst, src = self._device_block.data_ptr(), self._host[slot].data_ptr()
            self._driver.memcpy_htod_async(dst + 4 * lo, src + 4 * lo, 4 * (hi - lo), stream)
            self._driver.event_record(self._events[slot].cuda_event, stream)
            return
        self._device_block[lo:hi].copy_(self._host[slot][lo:hi], non_blocking=True)
        self._events[slot].record()
