"""PPHandler: the last PP stage's sampled tokens, broadcast to the other stages.

Under pipeline parallelism only the last stage samples. The other stages still keep
per-request state (the first stage embeds the next step's input ids from it), so each
step the last stage broadcasts its sampled tokens over a *sibling* device group of the
PP group -- a second communicator, so the broadcast never queues on the wire behind the
stage-to-stage hidden-state P2P traffic -- and the other stages apply them later:

    step T    last stage:  post_sample(rows, R_pad, sampled=batch.sampled)  -> async broadcast
              other stages: post_sample(rows, R_pad)                          -> async receive, queued
    step T+d  other stages: for got in consume(): got.write_into(...)        -> applied (d = depth)

Everything is asynchronous: on CUDA the broadcast runs on a side stream and the main
stream waits on its event only when the tokens are consumed; on a CPU (gloo) it is an
`async_op=True` work handle waited at consume time. Nothing here runs inside a graph.

Requests churn while a receive is in flight: the row that sampled at step T may be
freed (request finished or preempted) and handed to a new request before step T+d.
`RowGenerations` counts, per row, how many times it changed hands; each queued receive
snapshots the counters of its rows, and consuming keeps only rows whose counter is
unchanged, so a token is never applied to a row that now belongs to someone else.

Wire format, one int32 tensor per step: `[tokens of the R_pad padded rows..., R]`: the
padded token row as the step produced it, then how many leading rows are real. With
`width` W > 1 each row carries W int32 values (speculative decoding: its emitted tokens,
counts and next drafts), row-major, and `ReceivedTokens.tokens` is [k, W]. The
receiver sizes its buffer from its own R_pad (every stage runs the same batch shape)
and checks R against its own count on a CPU, where reading it costs no device sync.

A group of one (pp_size 1, or `group=None`) makes the handler a no-op: the rank is the
last stage, nothing is sent, nothing is ever queued.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from graphrunner.distributed.row_generations import RowGenerations

__all__ = ["PPHandler", "ReceivedTokens", "RowGenerations", "StepTokens"]


@dataclass(frozen=True)
class ReceivedTokens:
    """One consumed broadcast, filtered to the rows that still belong to their request.

    rows:      [k] int64 request rows to update (unique), in the step's batch order
    tokens:    [k] int32 on the handler's device, the token sampled for each row ([k, W]
               with a handler of width W > 1)
    positions: [k] int64 or None: what the caller passed at receive time (typically the
               index in the row's token history where the token belongs), same filter
    step:      the step (count of `post_sample` calls before it) that sent the tokens
    num_dropped: rows of that step left out (freed/reused since, or not sampling)
    """

    step: int
    rows: np.ndarray
    tokens: torch.Tensor
    positions: np.ndarray | None
    num_dropped: int

    def write_into(self, last_sampled: torch.Tensor, all_token_ids: torch.Tensor | None = None) -> None:
        """Apply on the current stream: last_sampled[rows] = tokens; with `all_token_ids`
        ([num_rows, max_len]) also all_token_ids[rows, positions] = tokens."""
        if len(self.rows) == 0:
            return
        device = last_sampled.device
        rows = torch.from_numpy(self.rows).to(device, non_blocking=True)
        tokens = self.tokens.to(device=device, dtype=last_sampled.dtype)
        last_sampled.index_copy_(0, rows, tokens)
        if all_token_ids is not None:
            if self.positions is None:
                raise ValueError("write_into(all_token_ids=...) needs positions, but none were given at receive time")
            pos = torch.from_numpy(self.positions).to(device, non_blocking=True)
            all_token_ids.index_put_((rows, pos), tokens.to(all_token_ids.dtype))


@dataclass
class StepTokens:
    """Every real row's token of one received step, for its output: `get()` gives [R] (or [R, W])
    int32 on the CPU. On CUDA a pinned copy enqueued right behind the broadcast, so `get()` waits
    for that broadcast only, not for the forwards launched since (as `.cpu()` would)."""

    values: torch.Tensor
    ready: torch.cuda.Event | None = None

    def get(self) -> torch.Tensor:
        if self.ready is not None:
            self.ready.synchronize()
        return self.values


class _Inflight:
    """Completion of one async broadcast: a CUDA event, a gloo work handle, or (loopback) a fill."""

    def __init__(
        self,
        work: dist.Work | None = None,
        event: torch.cuda.Event | None = None,
        fill: Callable[[], None] | None = None,
    ) -> None:
        self.work, self.event, self.fill = work, event, fill

    def wait(self, what: str, timeout_s: float | None) -> None:
        """CUDA: make the current stream wait (no host sync). Work handle: block, bounded."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
            return
        if self.fill is not None:
            fill, self.fill = self.fill, None
            fill()
            return
        if self.work is None:
            return
        try:
            if timeout_s is None:
                self.work.wait()
            else:
                self.work.wait(timeout=timedelta(seconds=timeout_s))
        except RuntimeError as e:
            limit = "the group's timeout" if timeout_s is None else f"timeout_s={timeout_s}"
            raise RuntimeError(
                f"{what} did not complete within {limit}: a peer PP stage is stalled, dead, "
                f"or running a different batch ({e})"
            ) from e
        self.work = None


class _LoopbackHub:
    """In-process stand-in for the broadcast group (`PPHandler.loopback`): the n-th
    receive of each stage gets a copy of the last stage's n-th send, as a collective would."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []
        self.received: dict[int, int] = {}  # stage -> broadcasts joined so far

    def join(self, stage: int, buf: torch.Tensor, is_sender: bool) -> _Inflight:
        seq = self.received.get(stage, 0)
        self.received[stage] = seq + 1
        if is_sender:
            self.sent.append(buf.clone())
            return _Inflight()

        def fill() -> None:
            if seq >= len(self.sent):
                raise RuntimeError(
                    f"loopback: stage {stage} waits on broadcast #{seq}, the last stage sent {len(self.sent)}"
                )
            src = self.sent[seq]
            if src.shape != buf.shape:
                raise RuntimeError(
                    f"loopback: broadcast #{seq} sent {tuple(src.shape)} but stage {stage} receives {tuple(buf.shape)}"
                )
            buf.copy_(src)

        return _Inflight(fill=fill)


@dataclass
class _Pending:
    step: int
    slot: int
    inflight: _Inflight
    rows: np.ndarray  # [n] int64
    keep: np.ndarray  # [n] bool: rows that produce a token this step
    gen: np.ndarray  # [n] int64 generation snapshot
    positions: np.ndarray | None
    num_padded: int
    host: torch.Tensor | None = None  # CUDA: the pinned copy of the wire, made behind the broadcast


@dataclass
class _Ring:
    """Persistent wire buffers, reused round-robin; a slot is reused only after its op completed."""

    buffers: list[torch.Tensor]
    inflight: list[_Inflight | None] = field(default_factory=list)
    next: int = 0

    def __post_init__(self) -> None:
        self.inflight = [None] * len(self.buffers)


class PPHandler:
    """Sampled-token broadcast from the last PP stage, with a FIFO of pending receives elsewhere.

    group: the sibling PP device group (gloo on a CPU, NCCL on CUDA); None = pp_size 1.
    max_num_reqs: the largest padded request count of a step (the wire buffers' size).
    depth: how many steps a receive waits before `consume` returns it; default pp_size,
        the steps a token takes to come round the pipeline. 0 = the same step.
    generations: the runner's `RowGenerations`; default a new one of `num_rows` rows
        (default max_num_reqs + 1: the live rows and the scratch row).
    timeout_s: on a CPU, how long a receive/send may take when waited before a clear
        RuntimeError (None: the group's own timeout). On CUDA the NCCL watchdog applies.
    width: int32 values per row (1: one token; speculative decoding sends more).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        max_num_reqs: int,
        device: torch.device | str,
        *,
        depth: int | None = None,
        generations: RowGenerations | None = None,
        num_rows: int | None = None,
        timeout_s: float | None = None,
        width: int = 1,
        _roles: tuple[int, int, _LoopbackHub] | None = None,
    ) -> None:
        if not isinstance(max_num_reqs, int) or max_num_reqs < 1:
            raise ValueError(f"max_num_reqs={max_num_reqs!r} must be an int >= 1")
        self.device = torch.device(device)
        self.group = group
        self._hub: _LoopbackHub | None = None
        if _roles is not None:  # PPHandler.loopback
            self.pp_size, self.pp_rank, self._hub = _roles
            self.src = self.pp_size - 1
        elif group is None:
            self.pp_size, self.pp_rank, self.src = 1, 0, 0
        else:
            self.pp_size = dist.get_world_size(group)
            self.pp_rank = dist.get_rank(group)
            # broadcast() takes the source as a global rank.
            self.src = dist.get_global_rank(group, self.pp_size - 1) if self.pp_size > 1 else dist.get_rank()
        self.depth = self.pp_size if depth is None else depth
        if not isinstance(self.depth, int) or self.depth < 0:
            raise ValueError(f"depth={depth!r} must be an int >= 0")
        self.max_num_reqs = max_num_reqs
        if not isinstance(width, int) or width < 1:
            raise ValueError(f"width={width!r} must be an int >= 1")
        self.width = width
        self.timeout_s = timeout_s
        if generations is None:
            generations = RowGenerations(num_rows if num_rows is not None else max_num_reqs + 1)
        self.generations = generations
        self._step = 0
        self._queue: deque[_Pending] = deque()
        self._ring: _Ring | None = None
        self._stream: torch.cuda.Stream | None = None
        if self.enabled:
            # At most depth + 1 receives are queued between consumes (one per step); one
            # more slot lets a step's receive start before the oldest is consumed.
            n_slots = self.depth + 2
            size = max_num_reqs * width + 1
            buffers = [torch.zeros(size, dtype=torch.int32, device=self.device) for _ in range(n_slots)]
            self._ring = _Ring(buffers)
            if self.device.type == "cuda" and self._hub is None:
                self._stream = torch.cuda.Stream(self.device)

    @classmethod
    def loopback(
        cls, pp_size: int, max_num_reqs: int, device: torch.device | str = "cpu", **kwargs: Any
    ) -> list[PPHandler]:
        """One handler per stage of an in-process pipeline (tests, single-process simulation):
        the last stage's broadcasts reach the others without torch.distributed. Receives are
        filled when consumed, so drive every stage's `post_sample` for a step before any
        stage consumes it. kwargs go to the constructor (depth, timeout_s, num_rows)."""
        if not isinstance(pp_size, int) or pp_size < 1:
            raise ValueError(f"pp_size={pp_size!r} must be an int >= 1")
        hub = _LoopbackHub()
        return [cls(None, max_num_reqs, device, _roles=(pp_size, stage, hub), **kwargs) for stage in range(pp_size)]

    # ---- roles ---------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """False for a pipeline of one stage: every call is a no-op."""
        return self.pp_size > 1

    @property
    def is_last_rank(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def step(self) -> int:
        """Steps seen so far (calls of `post_sample`)."""
        return self._step

    @property
    def num_pending(self) -> int:
        """Receives queued and not yet consumed (always 0 on the last stage)."""
        return len(self._queue)

    # ---- per step ------------------------------------------------------------------
    def post_sample(
        self,
        rows: np.ndarray,
        num_reqs_padded: int,
        *,
        sampled: torch.Tensor | None = None,
        produces: np.ndarray | None = None,
        positions: np.ndarray | None = None,
    ) -> bool:
        """After a step's sampling, on every stage: the last one broadcasts, the others queue a receive.

        rows: [R] the real request rows of the step in batch order (idx_mapping[:R]).
        num_reqs_padded: R_pad, the step's padded request count (the same on every stage).
        sampled: last stage only: [>= R_pad] int32 on the device, the step's tokens
            ([>= R_pad, width] with width > 1).
        produces: [R] bool, which rows sample a token this step (non-final prefill chunks
            do not); None = all. Every stage must pass the same rows/produces: it decides
            whether the step is broadcast at all.
        positions: [R] int64, optional, carried to `ReceivedTokens.positions`.
        Returns True when a broadcast was sent/queued (False: nothing sampled, or pp_size 1).
        """
        step = self._step
        self._step += 1
        if not self.enabled:
            return False
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        num_reqs = len(rows)
        if not num_reqs <= num_reqs_padded <= self.max_num_reqs:
            raise ValueError(
                f"step {step}: need num_reqs={num_reqs} <= num_reqs_padded={num_reqs_padded} "
                f"<= max_num_reqs={self.max_num_reqs}"
            )
        keep = np.ones(num_reqs, dtype=bool) if produces is None else np.asarray(produces, dtype=bool).reshape(-1)
        if len(keep) != num_reqs:
            raise ValueError(f"step {step}: produces has {len(keep)} entries for {num_reqs} rows")
        if positions is not None:
            positions = np.asarray(positions, dtype=np.int64).reshape(-1)
            if len(positions) != num_reqs:
                raise ValueError(f"step {step}: positions has {len(positions)} entries for {num_reqs} rows")
        # Empty step, or only non-final prefill chunks: nobody needs tokens, nobody talks.
        if num_reqs == 0 or not keep.any():
            return False
        if self.is_last_rank:
            if sampled is None:
                raise ValueError("the last PP stage must pass sampled= (the step's sampled tokens)")
            self._send(step, sampled, num_reqs, num_reqs_padded)
        else:
            self._receive(step, rows, keep, positions, num_reqs_padded)
        return True

    def consume(self) -> list[ReceivedTokens]:
        """Receives at least `depth` steps old, oldest first, filtered by generation.

        Call at the start of a step, before its `post_sample` (a receive queued at step T
        comes back at step T + depth). On CUDA the current stream is made to wait for
        each broadcast; on a CPU this blocks (bounded by timeout_s). Apply the results in
        order (a later step's token for a row overwrites an earlier one's).
        """
        out: list[ReceivedTokens] = []
        while self._queue and self._queue[0].step <= self._step - self.depth:
            got = self._finish(self._queue.popleft())
            if got is not None:
                out.append(got)
        return out

    def take_oldest(self) -> tuple[ReceivedTokens | None, StepTokens]:
        """The oldest queued receive, whatever its age: a runner that resolves its steps in
        order (pipelined PP) takes each step's tokens when the engine asks for that step.

        Returns (its live rows as `consume` gives them, or None when every row changed hands,
        and every real row's token for the step's output, `StepTokens`).
        """
        if not self._queue:
            raise RuntimeError("take_oldest(): no PP receive is queued (every stage must post_sample each step)")
        return self._take(self._queue.popleft())

    def take_for(self, rows: np.ndarray) -> list[tuple[ReceivedTokens | None, StepTokens]]:
        """Before a step of these request rows ([R] int64) prepares its inputs: the queued receives,
        oldest first, up to the newest one holding a token for any of them (`take_oldest`'s pairs).
        A stage that runs a request while its last token is still on its way applies it from here."""
        last = -1
        for i, p in enumerate(self._queue):
            if np.isin(p.rows[p.keep], rows).any():
                last = i
        return [self._take(self._queue.popleft()) for _ in range(last + 1)]

    def _take(self, p: _Pending) -> tuple[ReceivedTokens | None, StepTokens]:
        got = self._finish(p)
        assert self._ring is not None
        R, W = len(p.rows), self.width
        if p.host is not None:  # ready with the broadcast's event (recorded after the copy)
            values = p.host[: R * W].view(R, W) if W > 1 else p.host[:R]
            return got, StepTokens(values, p.inflight.event)
        wire = self._ring.buffers[p.slot]
        return got, StepTokens(wire[: R * W].view(R, W).clone() if W > 1 else wire[:R].clone())

    def drain(self) -> list[ReceivedTokens]:
        """Everything still pending, whatever its age (shutdown, or the engine needs tokens now).

        On the last stage, waits until its own broadcasts have gone out. Safe to call repeatedly.
        """
        out: list[ReceivedTokens] = []
        while self._queue:
            got = self._finish(self._queue.popleft())
            if got is not None:
                out.append(got)
        if self._ring is not None:
            for i, inflight in enumerate(self._ring.inflight):
                if inflight is not None:
                    inflight.wait("PP sampled-token broadcast (drain)", self.timeout_s)
                    self._ring.inflight[i] = None
        return out

    def close(self) -> None:
        """Drain (results dropped) and release the wire buffers. Call before the groups are destroyed."""
        self.drain()
        self._ring = None
        self._stream = None

    # ---- internals -----------------------------------------------------------------
    def _take_slot(self, what: str) -> tuple[int, torch.Tensor]:
        ring = self._ring
        assert ring is not None
        slot = ring.next
        ring.next = (slot + 1) % len(ring.buffers)
        if any(p.slot == slot for p in self._queue):
            raise RuntimeError(
                f"{len(self._queue)} PP receives pending with depth={self.depth}: call consume() every step "
                f"(or drain()) before queuing more"
            )
        prev = ring.inflight[slot]
        if prev is not None:  # the op that last used this buffer must be done before it is rewritten
            prev.wait(what, self.timeout_s)
        return slot, ring.buffers[slot]

    def _launch(self, buf: torch.Tensor, host: torch.Tensor | None = None) -> _Inflight:
        """Broadcast `buf` from the last stage, asynchronously (CUDA, `host`: then copy it there)."""
        if self._hub is not None:
            return self._hub.join(self.pp_rank, buf, self.is_last_rank)
        if self._stream is not None:
            main = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(main)  # the tokens (sender) / last readers of the slot (receiver)
            with torch.cuda.stream(self._stream):
                dist.broadcast(buf, src=self.src, group=self.group)
                if host is not None:
                    host.copy_(buf, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            return _Inflight(None, event)
        work = dist.broadcast(buf, src=self.src, group=self.group, async_op=True)
        return _Inflight(work, None)

    def _send(self, step: int, sampled: torch.Tensor, num_reqs: int, num_reqs_padded: int) -> None:
        W = self.width
        shape_ok = sampled.dim() == 1 if W == 1 else (sampled.dim() == 2 and sampled.shape[1] == W)
        if sampled.dtype != torch.int32 or not shape_ok or sampled.shape[0] < num_reqs_padded:
            want = "a 1-D int32 tensor" if W == 1 else f"a [rows, {W}] int32 tensor"
            raise ValueError(
                f"step {step}: sampled must be {want} of >= num_reqs_padded={num_reqs_padded} "
                f"rows, got {sampled.dtype} {tuple(sampled.shape)}"
            )
        what = f"PP sampled-token broadcast of step {step} (send)"
        slot, buf = self._take_slot(what)
        n = num_reqs_padded * W
        wire = buf[: n + 1]  # [R_pad * W + 1] int32
        # Copy on the main stream: `sampled` is a persistent buffer the next step rewrites.
        wire[:n].copy_(sampled[:num_reqs_padded].reshape(-1), non_blocking=True)
        wire[n].fill_(num_reqs)
        assert self._ring is not None
        self._ring.inflight[slot] = self._launch(wire)

    def _receive(
        self, step: int, rows: np.ndarray, keep: np.ndarray, positions: np.ndarray | None, num_reqs_padded: int
    ) -> None:
        what = f"PP sampled-token broadcast of step {step} (receive)"
        slot, buf = self._take_slot(what)
        wire = buf[: num_reqs_padded * self.width + 1]
        # A fresh pinned block each step (the caching host allocator recycles it once its copy is done).
        host = torch.empty(wire.shape, dtype=wire.dtype, pin_memory=True) if self._stream is not None else None
        inflight = self._launch(wire, host)
        assert self._ring is not None
        self._ring.inflight[slot] = inflight
        gen = self.generations.snapshot(rows)
        self._queue.append(_Pending(step, slot, inflight, rows, keep, gen, positions, num_reqs_padded, host))

    def _finish(self, p: _Pending) -> ReceivedTokens | None:
        p.inflight.wait(f"PP sampled-token broadcast of step {p.step} (receive)", self.timeout_s)
        assert self._ring is not None
        self._ring.inflight[p.slot] = None
        W = self.width
        wire = self._ring.buffers[p.slot][: p.num_padded * W + 1]
        num_reqs = len(p.rows)
        if wire.device.type == "cpu":  # free to check here; on CUDA it would be a host sync
            sent = int(wire[p.num_padded * W])
            if sent != num_reqs:
                raise RuntimeError(
                    f"PP stages disagree on step {p.step}: the last stage sent {sent} real rows, "
                    f"this stage (rank {self.pp_rank} of {self.pp_size}) ran {num_reqs}"
                )
        live = p.keep & self.generations.unchanged(p.rows, p.gen)
        idx = np.flatnonzero(live)
        if len(idx) == 0:
            return None
        # A copy, not a view of the ring slot: the slot is rewritten depth + 2 steps later.
        rows = wire[: num_reqs * W].view(num_reqs, W) if W > 1 else wire[:num_reqs]  # [R, W] or [R]
        tokens = rows.index_select(0, torch.from_numpy(idx).to(wire.device, non_blocking=True))  # [k] or [k, W]
        positions = None if p.positions is None else p.positions[idx]
        return ReceivedTokens(p.step, p.rows[idx], tokens, positions, num_reqs - len(idx))
