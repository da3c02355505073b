"""NcclConnector: KV blocks sent point to point from a prefill instance to a decode instance.

Two instances meet at `kv_ip:kv_port` (`kv_connector_extra_config`): the `kv_producer` is rank 0 of a
two-rank process group of their own, the `kv_consumer` rank 1. The group is NCCL between two GPUs
(`backend`, default "nccl" on CUDA) or gloo (the default on a CPU, and what CPU tests use); it is
built by a background thread, so neither instance waits for the other to start, and it never
touches the instance's own tensor-parallel groups.

The producer plans saves as SharedStorageConnector does (every prompt block it computes, named
by its prefix hash) and, when a prefill is first scheduled, announces the hashes of the prompt
blocks it will send. After the step the runner gathers the blocks on its stream; a sender thread
sends them (outside the graphs, on the process group's own stream under NCCL) while the instance
goes on. A receiver thread on the consumer keeps what arrives in a bounded LRU store
(`kv_buffer_size` bytes, on the device the group moves tensors on).

The consumer's store is also the link's flow control: the consumer publishes its size at connect
and, as blocks leave it (loaded into the paged cache, unwanted, stale, refused, or arrived twice),
the bytes freed; the producer sends blocks only while the bytes it has sent and the consumer has not
freed leave room for them (a message larger than the room goes in parts), and meanwhile keeps sending
announcements and heartbeats. Without it, a producer ahead of the consumer's admissions overflowed
the store: on two H200s (8k-token prompts, a 4 GiB store) the consumer let 4,525 received blocks go
before any request loaded them, and prefilled those prompts itself. Blocks that find no room within
`timeout_s` are dropped (logged) and their announcement withdrawn.

The consumer's scheduler side matches a waiting request's blocks in that store, chained from its
local prefix-cache hit. When the first block it misses has been announced and not yet arrived, the
request waits (`get_num_new_matched_tokens` returns None) while running requests go on; it is
admitted once its blocks are there, or after `timeout_s` without them, or at once when the store is
full (its blocks cannot come before others leave), computing what is missing.
The producer withdraws an announcement it cannot keep (blocks dropped past the buffer, a request
ended before its blocks were computed), so nothing waits for blocks that will not come.

Faults never give wrong tokens or a hang: blocks of another model, geometry or dtype are refused on
arrival (logged); a block is used only for the tokens it was sent with; a peer that dies or falls
silent (the producer sends a heartbeat every third of `timeout_s`) ends the link (logged), and
every request computes what has not arrived. A message is one int64 pair (header bytes, payload
bytes), a JSON header, then the payload: the blocks' K and V of every layer, [num_layers, 2, n,
block_size, kv_heads, head_dim] in the cache's dtype, sent as bytes.

The pair and the header travel on a gloo group (host memory), only the payload on the NCCL group.
A receive posted on the GPU before a message is known to come would sit there until the producer's
next message (a heartbeat: up to a third of `timeout_s`, 20 s by default), and every device-wide wait
of the instance meanwhile (`torch.cuda.synchronize` as each FULL graph capture begins, `empty_cache`,
memory profiling) would wait with it: a consumer capturing its graphs before the producer had sent
anything took minutes to start. Now both ends post a payload's NCCL calls only once its header has
passed, so a device-wide wait waits at most for a transfer under way; the NCCL communicator itself
is created by both link threads at the first payload. Every wait of the link threads is bounded by
`timeout_s` and fails naming the peer, the message and its request (`LinkTimeout`), which ends the link.
"""

from __future__ import annotations

import atexit
import itertools
import json
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from graphrunner.config import KVTransferConfig
from graphrunner.kv_shape import KVCacheShape
from graphrunner.kv_transfer.base import block_keys, connector_extra, logger
from graphrunner.kv_transfer.shared_storage import PrefixBlockScheduler, PrefixBlockWorker

_EXTRA_KEYS = ("kv_ip", "kv_port", "backend", "timeout_s", "kv_buffer_size", "nccl_num_channels")
_MAX_CHANNELS = 64  # NCCL's MAXCHANNELS
_RECEIVE_SPANS = 4096
_BACKENDS = ("nccl", "gloo")
_PREFIX = "graphrunner_kv_p2p"
_SENT_MEMORY = 1 << 20  # block hashes a producer remembers as sent (not sent again)
_POLL_S = 0.001  # between checks of an NCCL transfer's completion (a block transfer takes ~1 ms or more)
_CREDIT_POLL_S = 0.002  # between a waiting producer's reads of the bytes the consumer has freed


class LinkError(RuntimeError):
    """The link failed; the message names the peer, the message under way and its request."""


class LinkTimeout(LinkError, TimeoutError):
    """A wait of the link past `timeout_s` (same naming)."""


@dataclass(frozen=True)
class LinkGroups:
    """The link's two groups: `control` (gloo: sizes, headers, heartbeats) and `payload` (the blocks:
    NCCL between GPUs, else gloo)."""

    control: Any
    payload: Any


@dataclass(frozen=True)
class LinkConfig:
    """Where and how the two instances meet (`kv_connector_extra_config`)."""

    ip: str
    port: int
    backend: str
    timeout_s: float
    buffer_bytes: int
    num_channels: int = 8


def link_config(config: KVTransferConfig, device: torch.device | str) -> LinkConfig:
    """The connector's options, checked; ValueError naming the key, the value and what is allowed."""
    extra = connector_extra(config, _EXTRA_KEYS)
    if config.kv_role not in ("kv_producer", "kv_consumer"):
        raise ValueError(f"NcclConnector links a kv_producer with a kv_consumer; kv_role={config.kv_role!r} is "
                         "neither")
    port = extra.get("kv_port")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError(f"NcclConnector needs kv_connector_extra_config['kv_port'], a TCP port in 1..65535, "
                         f"got {port!r}")
    ip = extra.get("kv_ip", "127.0.0.1")
    if not isinstance(ip, str) or not ip:
        raise ValueError(f"NcclConnector: kv_ip must be a host name or address, got {ip!r}")
    on_cuda = torch.device(device).type == "cuda"
    backend = extra.get("backend", "nccl" if on_cuda else "gloo")
    if backend not in _BACKENDS or (backend == "nccl" and not on_cuda):
        raise ValueError(f"NcclConnector: backend={backend!r} is not one of {list(_BACKENDS)}"
                         + ("" if backend not in ("nccl",) else f" on device {device} (nccl needs CUDA)"))
    timeout = extra.get("timeout_s", 30.0)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise ValueError(f"NcclConnector: timeout_s must be a positive number of seconds, got {timeout!r}")
    # vLLM's P2P NCCL connector's default (1e9 bytes) in GiB. Under NCCL the blocks wait on the GPU,
    # outside the KV cache's memory budget: gpu_memory_utilization must leave room for them.
    buffer = extra.get("kv_buffer_size", 1 << 30)
    if not isinstance(buffer, int) or isinstance(buffer, bool) or buffer <= 0:
        raise ValueError(f"NcclConnector: kv_buffer_size must be a positive number of bytes, got {buffer!r}")
    # vLLM's P2P NCCL connector's name and default. Each channel is a CTA that holds an SM while a
    # transfer runs, beside the decode steps of the same GPU.
    channels = extra.get("nccl_num_channels", 8)
    if not isinstance(channels, int) or isinstance(channels, bool) or not 1 <= channels <= _MAX_CHANNELS:
        raise ValueError(f"NcclConnector: nccl_num_channels must be an integer in 1..{_MAX_CHANNELS}, got "
                         f"{channels!r}")
    return LinkConfig(ip, port, backend, float(timeout), buffer, channels)


def _geometry(shape: KVCacheShape, model_id: str) -> dict[str, Any]:
    return {"model": model_id, "dtype": str(shape.dtype).removeprefix("torch."), "block_size": shape.block_size,
            "num_layers": shape.num_layers, "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim}


class PeerLink:
    """One end of the two-rank group and its background thread: rank 0 sends (`announce`,
    `send_blocks`), rank 1 receives into a bounded store (`lookup`, `in_flight`, `wait`)."""

    def __init__(self, cfg: LinkConfig, rank: int, shape: KVCacheShape, model_id: str, device: torch.device) -> None:
        self.cfg, self.rank, self.shape, self.model_id = cfg, rank, shape, model_id
        self.geometry = _geometry(shape, model_id)
        self.wire = torch.device(device) if cfg.backend == "nccl" else torch.device("cpu")
        self.alive = True
        self.connected = threading.Event()
        self._lock = threading.Condition()
        # (priority, order, header, payload, ready event): announcements go before queued payloads (a
        # request waits on them), the closing message after everything.
        self._outbox: queue.PriorityQueue[tuple[int, int, dict[str, Any], torch.Tensor | None, Any]] = \
            queue.PriorityQueue()
        self._order = itertools.count()
        self._pending_bytes = 0
        self._expected: set[str] = set()  # producer: announced blocks not yet handed to the sender
        self._sent: OrderedDict[str, None] = OrderedDict()
        # hash -> (the tokens it was sent for, the block, when it arrived or was last looked up)
        self._blocks: OrderedDict[str, tuple[tuple[int | str, ...], torch.Tensor, float]] = OrderedDict()
        self._block_bytes = 0
        self._per_block = (shape.num_layers * 2 * shape.block_size * shape.num_kv_heads * shape.head_dim
                           * shape.dtype.itemsize)
        # Flow control (module docstring): the store both ends reach, the consumer's size as it
        # published it (None: no flow control), bytes sent, and the consumer's freed bytes as last read.
        self._unwanted: OrderedDict[str, None] = OrderedDict()  # announced blocks let go as they arrive
        self._kv_store: Any = None
        self._credit_lock = threading.Lock()
        self.peer_capacity: int | None = None
        self._sent_bytes = self._freed_seen = 0
        self._announced: dict[str, float] = {}
        self.num_sent_blocks = self.num_received_blocks = self.num_refused_blocks = self.num_dropped_blocks = 0
        self.num_evicted_unused_blocks = 0  # received, then let go before any request loaded them
        # (began, ended) on the monotonic clock of the last payloads received: the transfers a step ran beside
        self.receive_spans: deque[tuple[float, float]] = deque(maxlen=_RECEIVE_SPANS)
        self._thread = threading.Thread(target=self._run, name=f"kv-p2p-rank{rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producer
    def was_sent(self, block_hash: str) -> bool:
        with self._lock:
            return block_hash in self._sent

    def announce(self, hashes: Sequence[str], req_id: str = "") -> None:
        """Tell the consumer these blocks are coming (those not sent before)."""
        with self._lock:
            todo = [h for h in hashes if h not in self._sent]
            self._expected.update(todo)
        if todo and self.alive:
            self._outbox.put((0, next(self._order), {"kind": "announce", "hashes": todo, "req_id": req_id}, None, None))

    def has_room(self, num_blocks: int, reserved_blocks: int = 0) -> bool:
        """Whether a prefill of `num_blocks` more blocks fits in `kv_buffer_size` beside the blocks waiting
        to be sent, those announced and not yet computed, and `reserved_blocks` (prefills admitted and
        not yet announced); always when nothing waits (a prompt larger than the buffer goes alone), and
        when the link is down (nothing will be sent)."""
        with self._lock:
            outstanding = self._pending_bytes + (len(self._expected) + reserved_blocks) * self._per_block
            return (not self.alive or outstanding == 0
                    or outstanding + num_blocks * self._per_block <= self.cfg.buffer_bytes)

    def withdraw(self, hashes: Sequence[str]) -> None:
        """Tell the consumer these announced blocks will not come (dropped, or their request ended
        first), so no request waits for them."""
        with self._lock:
            self._expected.difference_update(hashes)
            self._lock.notify_all()
        if hashes and self.alive:
            self._outbox.put((0, next(self._order), {"kind": "withdraw", "hashes": list(hashes)}, None, None))

    def send_blocks(self, hashes: list[str], tokens: list[list[int | str]], data: torch.Tensor,
                    req_id: str = "") -> None:
        """Queue `data` [num_layers, 2, n, block_size, kv_heads, head_dim] (gathered by the step's
        stream) for sending; dropped (logged, counted) past `kv_buffer_size` bytes waiting or with the
        link down: the consumer then computes those blocks."""
        nbytes = data.numel() * data.element_size()
        with self._lock:
            dropped = not self.alive or self._pending_bytes + nbytes > self.cfg.buffer_bytes
            if dropped:
                self.num_dropped_blocks += len(hashes)
                logger.warning("NcclConnector: %d blocks not sent (%s)", len(hashes),
                               "link down" if not self.alive else f"over kv_buffer_size={self.cfg.buffer_bytes} "
                               "bytes waiting")
            else:
                self._pending_bytes += nbytes
                self._expected.difference_update(hashes)
                for h in hashes:
                    self._sent[h] = None
                    if len(self._sent) > _SENT_MEMORY:
                        self._sent.popitem(last=False)
        if dropped:
            self.withdraw(hashes)
            return
        ready = None
        if data.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(data.device))
        if self.wire != data.device:
            data = data.to(self.wire)  # gloo: a host copy (it waits for the step)
        self._enqueue_blocks({"kind": "blocks", **self.geometry, "hashes": hashes, "tokens": tokens,
                              "req_id": req_id}, data, ready)

    def _enqueue_blocks(self, header: dict[str, Any], data: torch.Tensor, ready: Any) -> None:
        self._outbox.put((1, next(self._order), header, data, ready))

    # ------------------------------------------------------------------ consumer
    def lookup(self, block_hash: str, tokens: Sequence[int | str]) -> torch.Tensor | None:
        """The block received as `block_hash` for exactly `tokens`, else None."""
        with self._lock:
            entry = self._blocks.get(block_hash)
            if entry is None:
                return None
            self._blocks[block_hash] = (entry[0], entry[1], time.monotonic())
            self._blocks.move_to_end(block_hash)
        if entry[0] != tuple(tokens):  # ints compare equal to the numpy ints block_keys made plain
            logger.warning("NcclConnector: block %s arrived for other tokens; refused", block_hash[:12])
            return None
        if entry[1].is_cuda:
            # Read on the caller's stream after the store lets it go: its memory, allocated on the
            # link's stream, must not be reused before that read.
            entry[1].record_stream(torch.cuda.current_stream(entry[1].device))
        return entry[1]

    def release(self, hashes: Sequence[str], unwanted: Sequence[str] = ()) -> None:
        """These blocks are loaded into the paged cache (its prefix cache holds them now): they leave
        the store, and the producer may send as many bytes more. Kept as a cache, last used first, a
        long prompt's loaded blocks outlived the next prompts' unloaded ones: with 8k-token prompts and
        a 4 GiB store on two H200s only 60% of the prompt tokens were loaded, the rest prefilled again
        on the decode instance (p99 inter-token latency 17.8x its median). `unwanted`: blocks of the
        same prompt no request will load (computed, or hit locally): let go now, or as they arrive."""
        with self._lock:
            gone = sum(self._blocks.pop(h, None) is not None for h in (*hashes, *unwanted))
            for h in unwanted:
                if self._announced.pop(h, None) is not None:
                    self._unwanted[h] = None
            while len(self._unwanted) > _SENT_MEMORY:
                self._unwanted.popitem(last=False)
            self._block_bytes -= gone * self._per_block
            self._lock.notify_all()
        self._free(gone * self._per_block)

    def _free(self, nbytes: int) -> None:
        """Tell the producer `nbytes` more of the store are free (consumer; flow control)."""
        if nbytes and self._kv_store is not None:
            with self._credit_lock:
                try:
                    self._kv_store.add("freed", nbytes)
                except Exception as e:  # the producer is gone: its sends end the link anyway
                    logger.debug("NcclConnector: cannot publish freed bytes: %s", e)

    def store_full(self) -> bool:
        """No room in the consumer's store for one more block: blocks on their way come only after
        others leave it, so a waiting request takes what is there."""
        with self._lock:
            return self._block_bytes + self._per_block > self.cfg.buffer_bytes

    def in_flight(self, block_hash: str) -> bool:
        """Announced, not arrived, and the link is up."""
        with self._lock:
            return self.alive and block_hash in self._announced and block_hash not in self._blocks

    def wait(self, timeout: float) -> None:
        """Up to `timeout` seconds, returning early when blocks arrive or the link goes down."""
        with self._lock:
            self._lock.wait(timeout)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            groups = self._connect()
            if groups is None:
                return
            self.connected.set()
            # The thread's copies and host reads go on a stream of its own: on the legacy default
            # stream they would order against every blocking stream of the instance's device.
            with torch.cuda.stream(torch.cuda.Stream(self.wire)) if self.wire.type == "cuda" else nullcontext():
                if self.rank == 0:
                    self._send_loop(groups)
                else:
                    self._receive_loop(groups)
        except Exception as e:  # the peer died, timed out or sent garbage: requests compute instead
            logger.warning("NcclConnector (rank %d, %s:%d): link down: %s: %s; requests compute their KV",
                           self.rank, self.cfg.ip, self.cfg.port, type(e).__name__, e)
        finally:
            with self._lock:
                self.alive = False
                self._announced.clear()
                self._lock.notify_all()

    @property
    def peer(self) -> str:
        """The other end, for messages: 'the consumer at 10.0.0.1:14579'."""
        return f"the {'consumer' if self.rank == 0 else 'producer'} at {self.cfg.ip}:{self.cfg.port}"

    def _complete(self, work: Any, what: str, on_gpu: bool = False) -> None:
        """Wait for a send or receive, at most `timeout_s`: LinkTimeout (or LinkError when the peer is gone)
        naming the peer and `what`."""
        timeout = self.cfg.timeout_s
        if not on_gpu:  # gloo: wait() blocks up to the timeout, then raises
            try:
                work.wait(timedelta(seconds=timeout))
            except RuntimeError as e:
                cls = LinkTimeout if "timed out" in str(e).lower() else LinkError
                raise cls(f"NcclConnector (rank {self.rank}): {what}: failed with {self.peer} within "
                          f"timeout_s={timeout:g} s: {e}") from e
            return
        # NCCL: wait() only orders the current stream after the transfer; the host polls for it instead.
        deadline = time.monotonic() + timeout
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise LinkTimeout(f"NcclConnector (rank {self.rank}): {what}: not done with {self.peer} within "
                                  f"timeout_s={timeout:g} s")
            time.sleep(_POLL_S)
        work.wait()

    def _connect(self) -> LinkGroups | None:
        timeout = timedelta(seconds=self.cfg.timeout_s)
        while True:  # the consumer may start much earlier than the producer it connects to
            try:
                store = dist.TCPStore(self.cfg.ip, self.cfg.port, 2, self.rank == 0, timeout=timeout,
                                      wait_for_workers=False)
                break
            except Exception as e:
                if self.rank == 0:  # the producer listens: a port it cannot bind is an error, not a wait
                    raise RuntimeError(f"cannot listen on {self.cfg.ip}:{self.cfg.port} ({e})") from e
                if not self.alive:
                    return None
                logger.debug("NcclConnector: waiting for the producer at %s:%d (%s)", self.cfg.ip, self.cfg.port, e)
                time.sleep(0.2)
        prefixed = dist.PrefixStore(_PREFIX, store)
        # The group's rendezvous times out after timeout_s: the producer builds it only once the
        # consumer is there, however late that is.
        if self.rank == 1:
            prefixed.set("capacity", str(self.cfg.buffer_bytes))  # before "consumer": the producer reads both
            prefixed.set("consumer", "here")
        else:
            while not prefixed.check(["consumer"]):
                if not self.alive:
                    return None
                time.sleep(0.2)
            self.peer_capacity = int(prefixed.get("capacity").decode())
        self._kv_store = prefixed
        # Both ranks build the gloo group here (its constructor meets the peer within `timeout`); the
        # NCCL group's communicator comes up lazily, in both link threads, at the first payload.
        control = dist.ProcessGroupGloo(dist.PrefixStore("control", prefixed), self.rank, 2, timeout)
        if self.cfg.backend == "gloo":
            return LinkGroups(control, dist.ProcessGroupGloo(dist.PrefixStore("payload", prefixed), self.rank, 2,
                                                             timeout))
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        options.config.max_ctas = self.cfg.num_channels
        torch.cuda.set_device(self.wire)  # per thread: this one makes every NCCL call of the link
        return LinkGroups(control, dist.ProcessGroupNCCL(dist.PrefixStore("payload", prefixed), self.rank, 2, options))

    @staticmethod
    def _describe(header: dict[str, Any]) -> str:
        kind, hashes = header.get("kind"), header.get("hashes") or []
        what = f"a {kind} message"
        if hashes:
            what += f" of {len(hashes)} blocks from {hashes[0][:12]}"
        if header.get("req_id"):
            what += f" (request {header['req_id']!r})"
        return what

    def _send_message(self, groups: LinkGroups, header: dict[str, Any], payload: torch.Tensor | None) -> None:
        what = "sending " + self._describe(header)
        head = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
        body = None if payload is None else payload.contiguous().view(torch.uint8).reshape(-1)
        sizes = torch.tensor([head.numel(), 0 if body is None else body.numel()], dtype=torch.int64)
        self._complete(groups.control.send([sizes], 1, 0), what)
        self._complete(groups.control.send([head], 1, 0), what)
        if body is not None:  # the consumer posts its receive once the header has passed
            body = body.to(self.wire)
            self._complete(groups.payload.send([body], 1, 0), what, body.is_cuda)

    def _send_loop(self, groups: LinkGroups) -> None:
        beat = self.cfg.timeout_s / 3
        while True:
            try:
                _, _, header, payload, ready = self._outbox.get(timeout=beat)
            except queue.Empty:
                self._send_message(groups, {"kind": "heartbeat"}, None)
                continue
            if header["kind"] == "close":
                self._send_message(groups, header, None)
                return
            if ready is not None:  # the step that gathered the blocks
                deadline = time.monotonic() + self.cfg.timeout_s
                while not ready.query():
                    if time.monotonic() > deadline:
                        raise LinkTimeout(f"NcclConnector: the step gathering {self._describe(header)} for "
                                          f"{self.peer} did not finish within timeout_s={self.cfg.timeout_s:g} s")
                    time.sleep(_POLL_S)
            if payload is None:
                self._send_message(groups, header, None)
            else:
                self._send_payload(groups, header, payload)

    def _send_payload(self, groups: LinkGroups, header: dict[str, Any], payload: torch.Tensor) -> None:
        """Send a blocks message as the consumer's store makes room (flow control, module docstring), in
        parts of the blocks that fit: a message larger than the room left would otherwise wait while the
        consumer waits for it. What finds no room within `timeout_s` is dropped (logged) and withdrawn."""
        hashes, tokens = header["hashes"], header["tokens"]
        n = len(hashes)
        nbytes = payload.numel() * payload.element_size()
        per_block = nbytes // n
        i = 0
        while i < n:
            k = self._await_room(groups, per_block, n - i)
            if not k:
                self.num_dropped_blocks += n - i
                self._send_message(groups, {"kind": "withdraw", "hashes": hashes[i:]}, None)
                break
            part = payload if k == n else payload[:, :, i:i + k]  # [L, 2, k, block_size, kv_heads, head_dim]
            self._send_message(groups, {**header, "hashes": hashes[i:i + k], "tokens": tokens[i:i + k]}, part)
            self._sent_bytes += k * per_block
            self.num_sent_blocks += k
            i += k
        with self._lock:
            self._pending_bytes -= nbytes
            self._lock.notify_all()  # a prefill held back for room may start (`has_room`)

    def _await_room(self, groups: LinkGroups, per_block: int, want: int) -> int:
        """How many of `want` blocks of `per_block` bytes the consumer's store has room for, at least one:
        waits up to `timeout_s` for the room of one, sending announcements and heartbeats meanwhile.
        All of them without flow control; 0 (logged) when no room came."""
        capacity = self.peer_capacity
        if capacity is None or self._kv_store is None:
            return want
        if per_block > capacity:
            logger.warning("NcclConnector: a block of %d bytes never fits the consumer's kv_buffer_size=%d; "
                           "dropped", per_block, capacity)
            return 0
        deadline = time.monotonic() + self.cfg.timeout_s
        beat = time.monotonic() + self.cfg.timeout_s / 3
        while True:
            room = (capacity - (self._sent_bytes - self._freed_seen)) // per_block
            if room >= want:
                return want
            self._freed_seen = self._kv_store.add("freed", 0)
            room = (capacity - (self._sent_bytes - self._freed_seen)) // per_block
            if room >= 1:
                return min(room, want)
            now = time.monotonic()
            if now > deadline:
                logger.warning("NcclConnector: the consumer's store had no room for a block within timeout_s=%g s; "
                               "%d blocks dropped", self.cfg.timeout_s, want)
                return 0
            self._send_control(groups)
            if now > beat:
                self._send_message(groups, {"kind": "heartbeat"}, None)
                beat = now + self.cfg.timeout_s / 3
            time.sleep(_CREDIT_POLL_S)

    def _send_control(self, groups: LinkGroups) -> None:
        """Send the announcements and withdrawals queued meanwhile (they go before queued payloads)."""
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return
            if item[0] != 0:
                self._outbox.put(item)
                return
            self._send_message(groups, item[2], None)

    def _recv(self, group: Any, numel: int, dtype: torch.dtype, device: torch.device, what: str) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype, device=device)
        self._complete(group.recv([t], 0, 0), what, t.is_cuda)
        return t

    def _receive_loop(self, groups: LinkGroups) -> None:
        cpu = torch.device("cpu")
        while True:
            # The producer's heartbeat comes every third of timeout_s: a silence of timeout_s ends the link.
            head_len, body_len = self._recv(groups.control, 2, torch.int64, cpu, "waiting for a message").tolist()
            header = json.loads(bytes(self._recv(groups.control, head_len, torch.uint8, cpu,
                                                 "receiving a message header").numpy()))
            body = None
            if body_len:
                began = time.monotonic()
                body = self._recv(groups.payload, body_len, torch.uint8, self.wire,
                                  "receiving " + self._describe(header))
                self.receive_spans.append((began, time.monotonic()))
            kind = header.get("kind")
            if kind == "close":
                logger.info("NcclConnector: the producer closed the link")
                return
            if kind == "announce":
                now = time.monotonic()
                with self._lock:
                    self._announced.update((h, now) for h in header["hashes"])
            elif kind == "withdraw":
                with self._lock:
                    for h in header["hashes"]:
                        self._announced.pop(h, None)
                    self._lock.notify_all()
            elif kind == "blocks" and body is not None:
                self._store(header, body)
            self._sweep()

    def _sweep(self) -> None:
        """Let go the blocks no request has looked up for `timeout_s` (their requests went elsewhere,
        ended, or computed them): under flow control they would hold the producer's sends back for good."""
        stale = time.monotonic() - self.cfg.timeout_s
        gone = 0
        with self._lock:
            while self._blocks and next(iter(self._blocks.values()))[2] < stale:
                self._blocks.popitem(last=False)
                gone += 1
            self._block_bytes -= gone * self._per_block
            self.num_evicted_unused_blocks += gone
        if gone:
            logger.warning("NcclConnector: %d received blocks unused for timeout_s=%g s let go", gone,
                           self.cfg.timeout_s)
            self._free(gone * self._per_block)

    def _store(self, header: dict[str, Any], body: torch.Tensor) -> None:
        hashes, tokens = header["hashes"], header["tokens"]
        wrong = {k: header.get(k) for k, v in self.geometry.items() if header.get(k) != v}
        s, per_block = self.shape, self._per_block
        if wrong or body.numel() != per_block * len(hashes) or len(tokens) != len(hashes):
            self.num_refused_blocks += len(hashes)
            logger.warning("NcclConnector: %d blocks refused: %s", len(hashes),
                           wrong or f"{body.numel()} payload bytes for {len(hashes)} blocks of {per_block}")
            with self._lock:
                for h in hashes:
                    self._announced.pop(h, None)
                self._lock.notify_all()
            self._free(body.numel())
            return
        data = body.view(s.dtype).reshape(s.num_layers, 2, len(hashes), s.block_size, s.num_kv_heads, s.head_dim)
        with self._lock:
            fresh = [j for j, h in enumerate(hashes) if h not in self._blocks and h not in self._unwanted]
            for h in hashes:
                self._unwanted.pop(h, None)
        # Blocks are kept as views of the message (the transfer has completed on the device): a copy
        # per block doubled each message's memory on the device, 1 GiB more per 8k-token prompt. A
        # message's memory goes with its last block; its blocks are one prefill chunk's, loaded together.
        kept = unused = 0
        with self._lock:
            for j in fresh:
                h = hashes[j]
                if h in self._blocks:
                    continue
                self._blocks[h] = (tuple(block_keys(tokens[j])), data[:, :, j], time.monotonic())
                self._block_bytes += per_block
                self._announced.pop(h, None)
                self.num_received_blocks += 1
                kept += 1
            # Under flow control the producer sends only what fits; a producer without it (or a
            # store smaller than one message) can still overflow it: the oldest blocks go.
            while self._block_bytes > self.cfg.buffer_bytes and self._blocks:
                self._blocks.popitem(last=False)
                self._block_bytes -= per_block
                unused += 1
            self.num_evicted_unused_blocks += unused
            self._lock.notify_all()
        self._free((len(hashes) - kept + unused) * per_block)  # blocks arrived twice, and those let go
        if unused:
            logger.warning("NcclConnector: %d received blocks let go before any request loaded them (over "
                           "kv_buffer_size=%d bytes); their requests compute that KV", unused, self.cfg.buffer_bytes)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def close(self) -> None:
        """Producer: tell the consumer the link ends (after what is queued); both: stop the thread."""
        if self.rank == 0 and self.connected.is_set() and self.alive:
            self._outbox.put((2, next(self._order), {"kind": "close"}, None, None))
        else:
            with self._lock:
                self.alive = False
                self._lock.notify_all()


_LINKS: dict[tuple[str, int, int], PeerLink] = {}
_LINKS_LOCK = threading.Lock()
_CLOSE_WAIT_S = 2.0  # at exit, per link: a producer's queued blocks and closing message go out first


@atexit.register
def _close_links() -> None:
    """Producers close their links (the consumer's receiver then returns), so no group is torn down
    under a thread still in a send or receive."""
    with _LINKS_LOCK:
        links = sorted(_LINKS.values(), key=lambda link: link.rank)  # producers first
    for link in links:
        link.close()
    for link in links:
        link.join(_CLOSE_WAIT_S)


def peer_link(config: KVTransferConfig, shape: KVCacheShape, model_id: str, device: torch.device | str) -> PeerLink:
    """The link of this instance's end (one per address and role in a process, shared by the scheduler
    side and the runner side)."""
    cfg = link_config(config, device)
    rank = 0 if config.kv_role == "kv_producer" else 1
    key = (cfg.ip, cfg.port, rank)
    with _LINKS_LOCK:
        link = _LINKS.get(key)
        if link is None or not link.alive:
            link = _LINKS[key] = PeerLink(cfg, rank, shape, model_id, torch.device(device))
        return link


class NcclScheduler(PrefixBlockScheduler):
    """Announces the producer's prefills; matches arrived blocks and waits for announced ones (module
    docstring)."""

    def __init__(self, config: KVTransferConfig, shape: KVCacheShape, model_id: str,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(config, shape, model_id)
        self.link = peer_link(config, shape, model_id, device)
        self._waiting_since: dict[str, float] = {}
        self._announced: dict[str, list[str]] = {}  # producer: request id -> the blocks it announced
        self._reserved: dict[str, int] = {}  # producer: request id -> blocks of a prefill admitted, not announced

    def get_num_new_matched_tokens(self, req: Any, num_computed_tokens: int) -> int | None:
        if self.config.is_consumer:
            return super().get_num_new_matched_tokens(req, num_computed_tokens)
        # The producer starts a prefill only when its blocks will fit in the link's buffer: past it they
        # were dropped and the decode instance prefilled those prompts again (on two H200s, 992 blocks
        # of 8k-token prompts with a 4 GiB buffer).
        # One schedule() may admit several prefills before any is announced: each counts the others'.
        blocks = -(-req.num_prompt_tokens // self.block_size)
        if not (self.link.has_room(blocks, sum(n for r, n in self._reserved.items() if r != req.req_id))
                or self._waited_out(req, f"room in kv_buffer_size={self.link.cfg.buffer_bytes} bytes; prefilled "
                                         "now, its blocks may not all be sent")):
            return None
        self._waiting_since.pop(req.req_id, None)
        self._reserved[req.req_id] = blocks
        return 0

    def _waited_out(self, req: Any, what: str) -> bool:
        """Whether `req` has waited `timeout_s` for `what` since it first waited (logged when it has)."""
        since = self._waiting_since.setdefault(req.req_id, time.monotonic())
        if time.monotonic() - since <= self.link.cfg.timeout_s:
            return False
        logger.warning("NcclConnector: request %r waited %.1f s for %s", req.req_id, self.link.cfg.timeout_s, what)
        return True

    def prefill_started(self, req: Any) -> None:
        self._reserved.pop(req.req_id, None)  # counted as announced from now on
        hashes = self.prompt_hashes(req)
        self._announced[req.req_id] = hashes
        self.link.announce(hashes, req.req_id)

    def fetch_block(self, req: Any, index: int, block_hash: str, tokens: Sequence[int | str]) -> torch.Tensor | None:
        return self.link.lookup(block_hash, tokens)

    def in_flight(self, req: Any, block_hash: str) -> bool:
        if not self.link.in_flight(block_hash) or self.link.store_full():
            self._waiting_since.pop(req.req_id, None)
            return False
        return not self._waited_out(req, "announced KV; it computes the rest")

    def wait_for_kv(self, timeout: float) -> None:
        self.link.wait(timeout)

    def blocks_admitted(self, req: Any, hashes: Sequence[str]) -> None:
        loaded = set(hashes)
        prompt = self.prompt_hashes(req)
        self.link.release(hashes, [h for h in prompt if h not in loaded])

    def request_finished(self, req: Any) -> None:
        super().request_finished(req)
        self._waiting_since.pop(req.req_id, None)
        self._reserved.pop(req.req_id, None)
        # Ended (or aborted) before all its announced blocks were sent: the consumer stops waiting.
        announced = self._announced.pop(req.req_id, [])
        self.link.withdraw([h for h in announced if not self.link.was_sent(h)])


class NcclWorker(PrefixBlockWorker):
    """Hands computed blocks to the sender thread."""

    def __init__(self, config: KVTransferConfig, shape: KVCacheShape, model_id: str, device: torch.device) -> None:
        super().__init__(config, shape, model_id, device)
        self.link = peer_link(config, shape, model_id, device)

    def stored(self, block_hash: str) -> bool:
        return self.link.was_sent(block_hash)

    def store_blocks(self, hashes: list[str], tokens: list[list[int | str]], data: torch.Tensor,
                     req_id: str = "") -> None:
        self.link.send_blocks(hashes, tokens, data, req_id)
        self.num_saved_blocks += len(hashes)


__all__ = ["LinkConfig", "LinkError", "LinkGroups", "LinkTimeout", "NcclScheduler", "NcclWorker", "PeerLink",
           "link_config", "peer_link"]
