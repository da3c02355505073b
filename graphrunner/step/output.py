"""What a step hands back: the pending step, its device-to-host copies, ModelRunnerOutput.

`execute_model` leaves a `PendingStep`; `sample_tokens` turns it into the engine's
result, either at once (one blocking D2H copy) or as an `AsyncOutput` whose copies run
on the output copy stream. A steady decode batch copies the same tensor prefixes step
after step, so its `OutputLayout` is resolved once and kept in the decode plan.

The device-to-host copies run on a side stream and are resolved by the engine later:

    out = runner.sample_tokens(async_output=True)   # returns at once: the copy is queued
    ...                                             # schedule and launch the next step
    result = out.get()                              # waits for this copy only

`OutputRing` owns a few slots of pinned host buffers. `launch()` makes the output copy
stream wait on an event recorded on the compute stream after the step, queues one
non-blocking D2H copy per device tensor into the slot's host buffers, and records a
`copy_done` event there; `AsyncOutput.get()` synchronizes on that event only (never
the device), then turns the host buffers into the caller's result with `finalize`.

Two buffers are shared with the device work that follows, and the ring guards both:
- a slot's pinned host buffers are reused only once the `AsyncOutput` that owns them
  was resolved; taking a slot that an unresolved output still holds is an error naming
  the ring size (the engine resolves step N before it launches step N + 2);
- the device tensors are persistent step buffers the next step overwrites, so the
  runner calls `guard_next_step()` before launching it: the compute stream waits (on
  the device, not the host) for the last queued copy.

On a CPU there are no streams: copies are synchronous, events are absent, and the same
API works unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from capture.cuda_driver import CudaDriver
from capture.descriptor import BatchExecutionDescriptor
from capture.full import FullGraph
from graphrunner.protocol import DraftTokenIds, ModelRunnerOutput
from graphrunner.sample.logprobs import logprob_dicts
from graphrunner.spec_decode.step import SpecBuffers, VerifyRecord
from graphrunner.state.requests import RequestState
from graphrunner.state.sampling import SamplingStates
from graphrunner.step.buffers import LogprobBuffers
from graphrunner.step.inputs import InputBatch

DEFAULT_NUM_SLOTS = 3
COPY_STREAM_ENV = "GRAPHRUNNER_OUTPUT_COPY_STREAM"

Finalize = Callable[[dict[str, torch.Tensor]], Any]


class AsyncOutput:
    """The result of one step, resolved on first `get()` (later calls return the same object)."""

    def __init__(self, ring: OutputRing | None, slot: int, host: dict[str, torch.Tensor], finalize: Finalize | None,
                 copy_done: torch.cuda.Event | None, result: Any = None):
        self._ring = ring
        self._slot = slot
        self._host = host
        self._finalize = finalize
        self._copy_done = copy_done
        self._result = result
        self._resolved = finalize is None
        self._copied = False  # the copy is known to have landed (synchronized once)

    @classmethod
    def ready(cls, result: Any) -> AsyncOutput:
        """An output that is already resolved (a step with nothing to copy)."""
        return cls(None, -1, {}, None, None, result)

    @property
    def resolved(self) -> bool:
        return self._resolved

    def is_ready(self) -> bool:
        """Whether `get()` would return without waiting (never blocks)."""
        return self._resolved or self._copy_done is None or self._copy_done.query()

    def wait(self) -> None:
        """Block until this output's copy has landed (`get()` then only builds the result)."""
        if not self._resolved and self._copy_done is not None and not self._copied:
            self._copy_done.synchronize()
            self._on_copied()

    def _on_copied(self) -> None:
        self._copied = True
        if self._ring is not None:
            self._ring._copy_landed(self._copy_done)

    def get(self) -> Any:
        """Wait for this output's copy (not the whole device), then build and return the result."""
        if not self._resolved:
            if self._copy_done is not None and not self._copied:
                self._copy_done.synchronize()
                self._on_copied()
            assert self._finalize is not None
            try:
                # finalize must not keep views of the host buffers: the slot is reused next.
                self._result = self._finalize(self._host)
            finally:
                # Resolved even when finalize raised: the slot must not stay taken forever.
                self._resolved = True
                self._host = {}
                self._finalize = None
                if self._ring is not None:
                    self._ring._release(self._slot, self)
        return self._result


class OutputLayout:
    """The D2H copies of one fixed set of device tensors, resolved once per ring slot.

    Steady decoding copies the same tensor prefixes step after step; a layout keeps,
    per slot, the host views `finalize` receives and the raw (dst, src, bytes) triples
    the driver path queues, so a launch does no per-tensor Python work.
    """

    __slots__ = ("names", "host", "copies", "tensors")

    def __init__(self, tensors: dict[str, torch.Tensor], host: list[dict[str, torch.Tensor]], raw: bool):
        self.tensors = tensors  # keeps the sources alive while the layout may be launched
        self.names = tuple(tensors)
        self.host = host
        self.copies: list[tuple[tuple[int, int, int], ...]] | None = None
        if raw:
            self.copies = [
                tuple((h[name].data_ptr(), t.data_ptr(), t.numel() * t.element_size()) for name, t in tensors.items())
                for h in host
            ]


class OutputRing:
    """`num_slots` sets of pinned host buffers plus the output copy stream.

    Host buffers are allocated per tensor name on first use at the capacity of the
    source's persistent buffer (`capacity[name]` rows, or the source's own shape), and
    only the launched prefix is copied, so a slot serves every batch size.
    """

    def __init__(self, device: torch.device, num_slots: int = DEFAULT_NUM_SLOTS, copy_stream: bool | None = None):
        """copy_stream: queue the copies on the output copy stream (default) or, False,
        on the compute stream right behind the step: two driver calls per step instead
        of four plus the next step's guard, for a copy (~2 us of device time) that no
        longer overlaps the next step. None: the env var GRAPHRUNNER_OUTPUT_COPY_STREAM
        ("0" turns it off), else on."""
        if num_slots < 2:
            raise ValueError(f"num_slots={num_slots} must be >= 2 (one output in flight while the next is made)")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_slots = num_slots
        self.is_cuda = self.device.type == "cuda"
        if copy_stream is None:
            copy_stream = os.environ.get(COPY_STREAM_ENV, "1") != "0"
        self.copy_stream = copy_stream
        self._host: list[dict[str, torch.Tensor]] = [{} for _ in range(num_slots)]
        self._views: dict[tuple[int, str], tuple[tuple, torch.Tensor]] = {}  # last prefix view per buffer
        self._owner: list[AsyncOutput | None] = [None] * num_slots
        self._next = 0
        self._stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        # The stream steps launch on, looked up once: torch.cuda.current_stream(device)
        # costs ~5-10 us of Python per call, and a step would make three. Steps must
        # therefore launch on the stream that is current when the ring is built (the
        # runner's: the device's current stream at construction, normally the default).
        self._compute = torch.cuda.current_stream(self.device) if self.is_cuda else None
        # Per-slot events, reused: a slot is only relaunched once its output was resolved.
        self._step_done = [torch.cuda.Event() for _ in range(num_slots)] if self.is_cuda else []
        self._copy_done = [torch.cuda.Event() for _ in range(num_slots)] if self.is_cuda else []
        self._last_copy_done: torch.cuda.Event | None = None
        # The driver fast path (capture.cuda_driver): raw handles, looked up once. It
        # needs this device to be the current one (the driver calls use its context).
        self._driver = None
        if self.is_cuda and self.device.index == torch.cuda.current_device():
            self._driver = CudaDriver.load()
        if self._driver is not None:
            for ev in self._step_done + self._copy_done:
                ev.record(self._compute)  # torch creates the CUDA event on first record
            self._step_done_h = [ev.cuda_event for ev in self._step_done]
            self._copy_done_h = [ev.cuda_event for ev in self._copy_done]
            assert self._stream is not None  # the driver fast path needs the copy stream
            self._copy_handle = self._stream.cuda_stream
            self._device_index = self.device.index
            self._raw_current_stream = torch._C._cuda_getCurrentRawStream

    @property
    def num_unresolved(self) -> int:
        return sum(o is not None for o in self._owner)

    def layout(self, tensors: dict[str, torch.Tensor], capacity: dict[str, int] | None = None) -> OutputLayout:
        """Resolve the copies of `tensors` for every slot (reusable while the tensors are)."""
        host = [{name: self._host_view(slot, name, t, (capacity or {}).get(name)) for name, t in tensors.items()}
                for slot in range(self.num_slots)]
        # Raw byte copies need both ends dense (a host view narrowed from a wider buffer is not).
        raw = (self._driver is not None
               and all(t.is_contiguous() and t.device == self.device for t in tensors.values())
               and all(v.is_contiguous() for h in host for v in h.values()))
        return OutputLayout(tensors, host, raw)

    def launch(self, tensors: dict[str, torch.Tensor], finalize: Finalize,
               capacity: dict[str, int] | None = None) -> AsyncOutput:
        """Queue the D2H copy of `tensors` (device tensors, written by the step just launched).

        `finalize(host_tensors)` runs in `get()`: it receives host views with the same
        shapes and must copy what it keeps (e.g. `.tolist()`), since the slot is reused.
        """
        return self.launch_layout(self.layout(tensors, capacity), finalize)

    def launch_layout(self, layout: OutputLayout, finalize: Finalize) -> AsyncOutput:
        """`launch` over a layout resolved before (the steady-decode path)."""
        slot = self._next
        if self._owner[slot] is not None:
            raise RuntimeError(
                f"all {self.num_slots} async output slots hold unresolved outputs; call get() on older "
                f"AsyncOutputs before sampling more steps (resolve step N before launching step N + {self.num_slots})"
            )
        host = layout.host[slot]
        copy_done = None
        if self.is_cuda:
            copy_done = self._copy_done[slot]
            drv = self._driver
            if drv is not None and layout.copies is not None:
                compute = self._raw_current_stream(self._device_index)
                if self.copy_stream:
                    copy = self._copy_handle
                    drv.event_record(self._step_done_h[slot], compute)
                    drv.stream_wait_event(copy, self._step_done_h[slot])  # the copy reads what the step wrote
                else:
                    copy = compute  # stream order covers both hazards: no events between the streams
                for dst, src, nbytes in layout.copies[slot]:
                    drv.memcpy_dtoh_async(dst, src, nbytes, copy)
                drv.event_record(self._copy_done_h[slot], copy)
            else:
                self._launch_torch(slot, layout, host)
            # The next step overwrites the copied tensors: it must wait for a side-stream copy.
            self._last_copy_done = copy_done if self.copy_stream else None
        else:
            for name, t in layout.tensors.items():
                host[name].copy_(t)
        out = AsyncOutput(self, slot, host, finalize, copy_done)
        self._owner[slot] = out
        self._next = (slot + 1) % self.num_slots
        return out

    def _launch_torch(self, slot: int, layout: OutputLayout, host: dict[str, torch.Tensor]) -> None:
        assert self._stream is not None
        if not self.copy_stream:
            for name, t in layout.tensors.items():
                host[name].copy_(t, non_blocking=True)
            self._copy_done[slot].record(self._compute)
            return
        step_done = self._step_done[slot]
        step_done.record(self._compute)
        self._stream.wait_event(step_done)  # the copy reads what the step wrote
        # set_stream rather than `with torch.cuda.stream(...)`: the context manager
        # re-queries current streams and devices (tens of us per step).
        assert self._stream is not None and self._compute is not None
        torch.cuda.set_stream(self._stream)
        try:
            for name, t in layout.tensors.items():
                host[name].copy_(t, non_blocking=True)
        finally:
            torch.cuda.set_stream(self._compute)
        self._copy_done[slot].record(self._stream)

    def guard_next_step(self) -> None:
        """Make the compute stream wait (device-side) for the last queued copy.

        Call before launching work that overwrites the tensors the last `launch()` copies.
        """
        if self._last_copy_done is not None:
            if self._driver is not None:
                self._driver.stream_wait_event(self._raw_current_stream(self._device_index),
                                               self._last_copy_done.cuda_event)
            else:
                assert self._compute is not None
                self._compute.wait_event(self._last_copy_done)
            self._last_copy_done = None

    def _host_view(self, slot: int, name: str, src: torch.Tensor, rows: int | None) -> torch.Tensor:
        shape = tuple(src.shape)
        key = (slot, name)
        cached = self._views.get(key)
        if cached is not None and cached[0] == shape and cached[1].dtype == src.dtype:
            return cached[1]  # steady batches: no per-step view construction
        view = self._make_host_view(slot, name, src, shape, rows)
        self._views[key] = (shape, view)
        return view

    def _make_host_view(self, slot: int, name: str, src: torch.Tensor, shape: tuple, rows: int | None) -> torch.Tensor:
        bufs = self._host[slot]
        full = ((rows,) + shape[1:]) if rows is not None and shape else shape
        buf = bufs.get(name)
        if buf is None or buf.dtype != src.dtype or buf.dim() != len(shape) or any(
            b < s for b, s in zip(buf.shape, shape, strict=True)
        ):
            full = tuple(max(f, s) for f, s in zip(full, shape, strict=True))
            buf = torch.empty(full, dtype=src.dtype, pin_memory=self.is_cuda)
            bufs[name] = buf
        view = buf
        for dim, size in enumerate(shape):
            view = view.narrow(dim, 0, size)
        return view

    def _copy_landed(self, copy_done: torch.cuda.Event | None) -> None:
        """The host saw `copy_done` complete: if it was the last copy, the next step needs
        no guard (sync scheduling resolves each step before launching the next)."""
        if copy_done is not None and copy_done is self._last_copy_done:
            self._last_copy_done = None

    def _release(self, slot: int, out: AsyncOutput) -> None:
        if self._owner[slot] is out:
            self._owner[slot] = None


@dataclass
class PendingStep:
    """What `execute_model` leaves for `sample_tokens`."""

    batch: InputBatch
    descriptor: BatchExecutionDescriptor
    produces_token: np.ndarray  # [num_reqs] bool: the chunk reached the end of the known tokens
    all_produce: bool  # produces_token.all(), computed once
    # Requests whose prompt logprobs completed in this step: req_id -> vLLM's PromptLogprobs.
    prompt_logprobs: dict[str, list] | None = None
    plan: Any = None  # the DecodePlan the step ran from (its layout and index), None without one
    verify: VerifyRecord | None = None  # speculative decoding: the entries that verified drafts


@dataclass
class DeferredStep:
    """A structured-output step waiting for its grammar masks: `sample_tokens` runs the rest.
    `sampling_graph`: the sampling half of a split step whose forward already ran, else None."""

    batch: InputBatch
    descriptor: BatchExecutionDescriptor
    plan: Any  # DecodePlan | None (step.plan builds on this module)
    sampling_graph: FullGraph | None


class StepOutputs:
    """Builds each step's `ModelRunnerOutput`, synchronously or through the output ring."""

    def __init__(self, ring: OutputRing, logprobs: LogprobBuffers, sampling: SamplingStates, max_num_reqs: int,
                 requests: RequestState, spec: SpecBuffers | None = None):
        self.ring = ring
        self.logprobs = logprobs
        self.sampling = sampling
        self.max_num_reqs = max_num_reqs
        self.requests = requests
        self.spec = spec  # speculative decoding: k + 1 token slots per entry, and the drafts
        self.slots = spec.tokens.shape[1] if spec is not None else 1
        self.drafts: DraftTokenIds | None = None  # the last built step's proposals

    def collect(self, pending: PendingStep, async_output: bool) -> ModelRunnerOutput | AsyncOutput:
        plan = pending.plan
        if plan is not None:
            # Steady decoding: the same output tensors every step, their copies resolved once.
            if plan.output_layout is None:
                plan.output_layout = self.layout(pending.batch)
            layout = plan.output_layout
        else:
            layout = self.layout(pending.batch)
        if async_output:
            return self.ring.launch_layout(layout, partial(self.build, pending))
        return self.build(pending, layout.tensors)

    def layout(self, batch: InputBatch) -> OutputLayout:
        """What a step copies to the host: its sampled tokens (and the logprob rows it asked for)."""
        R, cap, S = batch.num_reqs, self.max_num_reqs, self.slots
        spec = self.spec
        if spec is None:
            device_outputs = {"sampled": batch.sampled[:R]}  # [R] int32
        else:
            device_outputs = {
                "tokens": spec.tokens[:R], "num_accepted": spec.num_accepted[:R],  # [R, k + 1], [R] int32
                "proposed": spec.proposed[:R], "num_proposed": spec.num_proposed[:R],  # [R, k], [R] int32
            }
        capacity = dict.fromkeys(device_outputs, cap)
        if batch.sampling_features.wants_logprobs:
            # Whole rows (contiguous: one raw copy each); the host keeps the asked-for columns.
            lp = self.logprobs
            device_outputs["logprob_values"] = lp.values[: R * S]  # [R * S, K_all+1] float32
            device_outputs["logprob_token_ids"] = lp.token_ids[: R * S]  # [R * S, K_all+1] int32
            device_outputs["logprob_ranks"] = lp.ranks[: R * S]  # [R * S] int32
            capacity.update(logprob_values=cap * S, logprob_token_ids=cap * S, logprob_ranks=cap * S)
        return self.ring.layout(device_outputs, capacity)

    def build(self, pending: PendingStep, outputs: dict[str, torch.Tensor]) -> ModelRunnerOutput:
        """Host-side result of a step from its (host or device) output tensors."""
        if self.spec is not None:
            return self._build_speculative(pending, outputs)
        tokens = outputs["sampled"]
        if tokens.device.type != "cpu":
            tokens = tokens.cpu()  # the synchronous path: one blocking D2H copy
        tokens_np = tokens.numpy().copy()  # [R] int32; a copy: the host slot is reused
        index_source = pending.plan.req_id_to_index if pending.plan is not None else None
        return ModelRunnerOutput.from_token_array(
            list(pending.batch.req_ids), tokens_np, None if pending.all_produce else pending.produces_token.copy(),
            index_source, logprobs=self._sampled_logprobs(pending, outputs),
            prompt_logprobs_dict=pending.prompt_logprobs or {},
        )

    def _build_speculative(self, pending: PendingStep, outputs: dict[str, torch.Tensor]) -> ModelRunnerOutput:
        """k + 1 token slots per entry: entry i emitted its accepted drafts and one more token."""
        host = {name: (t if t.device.type == "cpu" else t.cpu()).numpy().copy() for name, t in outputs.items()}
        accepted = host["num_accepted"]  # [R] int32
        if pending.verify is not None:  # the host mirrors give back the rejected slots
            pending.verify.settle(accepted, self.requests)
        counts = np.where(pending.produces_token, accepted + 1, 0)  # [R] tokens emitted
        batch = pending.batch
        proposed, num_proposed = host["proposed"], host["num_proposed"]
        self.drafts = DraftTokenIds(list(batch.req_ids),
                                    [row[:n] for row, n in zip(proposed.tolist(), num_proposed.tolist(), strict=True)])
        index_source = pending.plan.req_id_to_index if pending.plan is not None else None
        return ModelRunnerOutput.from_token_rows(
            list(batch.req_ids), host["tokens"], counts, index_source,
            logprobs=self._sampled_logprobs(pending, outputs, counts),
            prompt_logprobs_dict=pending.prompt_logprobs or {},
        )

    def _sampled_logprobs(self, pending: PendingStep, outputs: dict[str, torch.Tensor],
                          counts: np.ndarray | None = None) -> list | None:
        """Per batch entry: one {token: Logprob} per emitted token (the token first, then the
        request's top-k), [] where it sampled nothing or asked for none; None when no entry
        asked. counts: [R] tokens emitted per entry (None: 1 where the entry produced)."""
        if "logprob_values" not in outputs:
            return None
        batch, S = pending.batch, self.slots
        if counts is None:
            counts = pending.produces_token.astype(np.int64)
        cols = batch.sampling_features.num_logprobs + 1
        host = {name: t.cpu().numpy() for name, t in outputs.items() if name.startswith("logprob")}
        wanted = self.sampling.logprobs_of(batch.idx_mapping_np)  # [R] K per entry, -1 = none
        dicts = logprob_dicts(host["logprob_values"][:, :cols], host["logprob_token_ids"][:, :cols],
                              host["logprob_ranks"])  # [R * S]
        return [[] if k < 0 else [_top_k(dicts[i * S + j], k) for j in range(n)]
                for i, (k, n) in enumerate(zip(wanted.tolist(), counts.tolist(), strict=True))]


def _top_k(d: dict, k: int) -> dict:
    """Column 0 (the sampled token) first, then the request's own top-k."""
    items = list(d.items())
    keep = dict(items[:1])
    for tok, lp in items[1:]:
        if lp.rank is not None and lp.rank <= k:
            keep.setdefault(tok, lp)
    return keep
