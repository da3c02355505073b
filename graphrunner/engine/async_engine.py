"""`AsyncEngine`: the reference engine behind an asyncio application (the HTTP server).

One background thread owns the `LLM`: it is the only thread that calls into it. Coroutines
submit requests and aborts through a command queue; the thread applies them between steps,
runs steps while any request is live, and hands each request's outputs back to its asyncio
queue (`loop.call_soon_threadsafe`), so the event loop never waits on a step.

    engine = AsyncEngine(llm)
    async for out in engine.generate(prompt, params, request_id="cmpl-1"):   # stream deltas
        ...                                          # leaving the loop early aborts the request

`generate` admits a request only while fewer than `max_live` are live (`QueueFull` otherwise:
the server's HTTP 429); a bad request raises ValueError from the first iteration.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from graphrunner.engine.request import RequestOutput
from graphrunner.protocol import LoRARequest, SamplingParams

logger = logging.getLogger(__name__)

_END = object()  # a request's queue gets this after its last output
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class QueueFull(RuntimeError):
    """More requests are live than the engine admits (`max_live`)."""


class EngineDead(RuntimeError):
    """The engine thread stopped: no request can be served."""


@dataclass
class _Live:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    stream: bool
    lora_request: LoRARequest | None = None


@dataclass
class EngineStats:
    """Counters and gauges the /metrics endpoint reports (written by the engine thread)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    ttft_buckets: list[int] = field(default_factory=lambda: [0] * len(TTFT_BUCKETS))
    ttft_sum: float = 0.0
    ttft_count: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    prefix_cache_hit_rate: float = 0.0


class AsyncEngine:
    """Runs an `LLM` on a background thread for asyncio callers (module docstring).

    Args:
        llm: the engine (an `LLM`, or the `WorkerLLM` of a parallel one); from now on only the engine
            thread touches it, through `add_request`, `abort_request`, `step_outputs`,
            `has_unfinished_requests` and `scheduler_stats`.
        max_live: most requests live at once (running, waiting and not yet admitted); more
            raise `QueueFull`.
    """

    def __init__(self, llm: Any, max_live: int) -> None:
        self.llm = llm
        self.max_live = max_live
        self.stats = EngineStats()
        self._commands: deque[tuple[str, Any]] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._live: dict[str, _Live] = {}  # touched by the engine thread only
        self._num_live = 0  # touched by the event loop only: admitted, not yet ended
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="graphrunner-engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- event loop side
    @property
    def num_live(self) -> int:
        return self._num_live

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str, stream: bool = True,
                       lora_request: LoRARequest | None = None) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs: deltas when `stream`, else its one final output. Leaving early
        (or the task being cancelled) aborts it. `lora_request`: the adapter it runs on (None: the
        base model); a bad adapter raises ValueError from the first iteration."""
        if self.error is not None or not self._thread.is_alive():
            raise EngineDead(f"the engine thread stopped: {self.error!r}")
        if self._num_live >= self.max_live:
            raise QueueFull(f"the server is at its request limit ({self._num_live} live of max_num_seqs + "
                            f"--max-queued-requests = {self.max_live}); retry later")
        self._num_live += 1
        queue: asyncio.Queue = asyncio.Queue()
        self._send("add", (request_id, prompt, params, _Live(queue, asyncio.get_running_loop(), stream,
                                                                 lora_request)))
        finished = False
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
        finally:
            self._num_live -= 1
            if not finished:
                self._send("abort", request_id)

    def abort(self, request_id: str) -> None:
        """End a live request (its output stream ends); unknown ids are ignored."""
        self._send("abort", request_id)

    def shutdown(self) -> None:
        """Stop the engine thread (live requests end with an error) and shut the `LLM` down."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=60)
        self.llm.shutdown()

    def _send(self, kind: str, payload: Any) -> None:
        self._commands.append((kind, payload))
        self._wake.set()

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while not self._stop:
                self._apply_commands()
                if self.llm.has_unfinished_requests():
                    self._step()
                else:
                    self._publish_gauges()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
        except BaseException as e:  # a bug: every live request learns of it, new ones are refused
            logger.exception("the engine thread stopped")
            self.error = e
        finally:
            for request_id in list(self._live):
                self._deliver(request_id, EngineDead(f"the engine stopped: {self.error!r}"), end=True)

    def _apply_commands(self) -> None:
        while self._commands:
            kind, payload = self._commands.popleft()
            if kind == "add":
                request_id, prompt, params, live = payload
                try:
                    self.llm.add_request(request_id, prompt, params, stream=live.stream,
                                         lora_request=live.lora_request)
                except (ValueError, TypeError) as e:
                    live.loop.call_soon_threadsafe(live.queue.put_nowait, e)
                    continue
                self._live[request_id] = live
            elif kind == "abort" and payload in self._live:
                del self._live[payload]  # nobody reads its outputs any more
                self.llm.abort_request(payload)

    def _step(self) -> None:
        try:
            finished, deltas = self.llm.step_outputs()
        except Exception as e:  # a failed step (the LLM aborted its requests): they end with the error
            logger.exception("an engine step failed; its requests are aborted")
            for request_id in list(self._live):
                self._deliver(request_id, RuntimeError(f"engine step failed: {type(e).__name__}: {e}"), end=True)
            return
        self.stats.num_steps += 1
        for out in deltas:
            self.stats.generation_tokens += sum(len(c.token_ids) for c in out.outputs)
            live = self._live.get(out.request_id)
            if live is not None and live.stream:
                self._deliver(out.request_id, out, end=out.finished)
        for out in finished:
            self._count_finished(out)
            live = self._live.get(out.request_id)
            if live is not None and not live.stream:
                self.stats.generation_tokens += sum(len(c.token_ids) for c in out.outputs)
                self._deliver(out.request_id, out, end=True)
            elif live is not None:
                self._deliver(out.request_id, None, end=True)  # its last delta went out above
        self._publish_gauges()

    def _deliver(self, request_id: str, item: Any, end: bool) -> None:
        live = self._live.pop(request_id) if end else self._live[request_id]
        if item is not None:
            live.loop.call_soon_threadsafe(live.queue.put_nowait, item)
        if end:
            live.loop.call_soon_threadsafe(live.queue.put_nowait, _END)

    def _count_finished(self, out: RequestOutput) -> None:
        stats = self.stats
        stats.prompt_tokens += len(out.prompt_token_ids)
        for c in out.outputs:
            reason = c.finish_reason or "abort"
            stats.finished[reason] = stats.finished.get(reason, 0) + 1
        metrics = out.metrics
        if metrics is not None and metrics.first_token_time is not None and metrics.arrival_time is not None:
            ttft = metrics.first_token_time - metrics.arrival_time
            stats.ttft_sum += ttft
            stats.ttft_count += 1
            for i, bound in enumerate(TTFT_BUCKETS):
                if ttft <= bound:
                    stats.ttft_buckets[i] += 1

    def _publish_gauges(self) -> None:
        now_ = self.llm.scheduler_stats()
        self.stats.num_running = now_.num_running
        self.stats.num_waiting = now_.num_waiting
        self.stats.kv_cache_usage = now_.kv_cache_usage
        self.stats.num_preemptions = now_.num_preemptions
        self.stats.prefix_cache_hit_rate = now_.prefix_cache_hit_rate


def now() -> int:
    """Seconds since the epoch (OpenAI's `created`)."""
    return int(time.time())
