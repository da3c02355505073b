"""In-process parallel workers: `LLM(tensor_parallel_size=2)` from a plain Python process.

Parallel runs are SPMD: every rank constructs the same `LLM` and calls the same methods (under
`torchrun` or `graphrunner launch`). When a plain process (no WORLD_SIZE in its environment)
asks for a world of more than one rank, `LLM(...)` returns a `WorkerLLM` instead: it starts the
ranks itself as spawned processes (torch.multiprocessing, the `spawn` start method, so CUDA is
initialised afresh in each), gives each the torchrun variables, and drives them: every call is
sent to every rank, every rank runs it, and rank 0's result comes back. An error in any rank is
raised in the caller with that rank's traceback. A rank that exits, or stays silent longer than
the collective timeout (plus a margin) after another rank replied (stopped, or hung outside a
collective), ends the workers: the caller gets a WorkerError naming it, and every later call
raises with that cause. A call may take as long as it needs while no rank has replied. `shutdown()`,
the context manager and interpreter exit stop every worker (joined, then killed after a grace
period), so no process is left behind.
"""

from __future__ import annotations

import atexit
import os
import time
import traceback
import weakref
from typing import Any

GRACE_SECONDS = 10.0
STARTUP_TIMEOUT_S = 600.0  # model load + capture on every rank
# Past the collective timeout, the time a rank may take to notice it and send its error back.
REPLY_MARGIN_S = 10.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0  # LLM's default


class WorkerError(RuntimeError):
    """A worker rank raised; the message carries its traceback."""


def _worker_main(rank: int, world: int, port: int, conn: Any, llm_cls: type, args: tuple, kwargs: dict) -> None:
    """One rank: build the LLM (`llm_cls`, pickled by reference), then run the driver's calls until "shutdown"."""
    from graphrunner.distributed.launch import rank_env

    os.environ.update(rank_env(rank, world, port, base={}))
    try:
        llm = llm_cls(*args, **kwargs)
    except BaseException:
        conn.send(("error", rank, traceback.format_exc()))
        conn.close()
        return
    conn.send(("ready", rank, None))
    try:
        while True:
            method, call_args, call_kwargs = conn.recv()
            if method == "shutdown":
                break
            try:
                result = getattr(llm, method)(*call_args, **call_kwargs)
            except BaseException:
                conn.send(("error", rank, traceback.format_exc()))
                continue
            conn.send(("ok", rank, result if rank == 0 else None))
    finally:
        llm.shutdown()
        conn.close()


class WorkerLLM:
    """Drives the spawned ranks of one `LLM` (module docstring). Use like `LLM`: `generate`,
    `shutdown`, `with ...:`; attributes that live in the ranks (runner, scheduler) are not here."""

    def __init__(self, world_size: int, llm_cls: type, args: tuple, kwargs: dict) -> None:
        import torch.multiprocessing as mp

        from graphrunner.distributed.launch import free_port

        ctx = mp.get_context("spawn")
        port = free_port()
        self.world_size = world_size
        # The ranks' peers raise within the collective timeout of a stalled rank's silence.
        self.reply_timeout_s = float(kwargs.get("collective_timeout_s", DEFAULT_COLLECTIVE_TIMEOUT_S)) + REPLY_MARGIN_S
        self._failure: WorkerError | None = None  # what ended the workers, raised again by every later call
        self._conns, self._procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(rank, world_size, port, child, llm_cls, args, kwargs),
                               daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._finalizer = weakref.finalize(self, _stop, self._conns, self._procs)
        atexit.register(self._finalizer)
        self._gather("start", STARTUP_TIMEOUT_S)

    def _gather(self, what: str, timeout: float | None = None) -> Any:
        """Every rank's reply to one call; rank 0's result. Raises WorkerError on any rank's error.

        `timeout`: the most seconds before the first reply (None: no limit). Once a rank replied,
        the others get `reply_timeout_s`; a rank that exits or stays silent ends the workers."""
        from multiprocessing.connection import wait

        result, errors, lost = None, [], []
        pending = dict(enumerate(self._conns))
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else deadline - time.monotonic()
            ready = set(wait([*pending.values(), *(self._procs[r].sentinel for r in pending)],
                             None if left is None else max(left, 0.0)))
            if not ready:  # past the deadline: the ranks still silent are stalled, and are stopped now
                limit = timeout if len(pending) == len(self._conns) else self.reply_timeout_s
                lost += [f"rank {r}: no reply to {what} within {limit:.0f} s (stalled)" for r in sorted(pending)]
                for r in pending:
                    self._procs[r].kill()  # a stalled rank would only take the shutdown's grace period
                break
            for r, conn in list(pending.items()):
                proc = self._procs[r]
                if conn not in ready and proc.sentinel not in ready:
                    continue
                try:
                    status, rank, payload = conn.recv()
                except (EOFError, OSError):
                    proc.join(1.0)
                    lost.append(f"rank {r} exited (code {proc.exitcode}) during {what}")
                    del pending[r]
                    continue
                del pending[r]
                if status == "error":
                    errors.append(f"rank {rank} raised during {what}:\n{payload}")
                elif rank == 0:
                    result = payload
            if pending:  # some rank replied (or exited) in this pass: the others have reply_timeout_s
                reply_deadline = time.monotonic() + self.reply_timeout_s
                deadline = reply_deadline if deadline is None else min(deadline, reply_deadline)
        if lost or (errors and what == "start"):
            # A rank is gone or stalled (or the start failed): the others cannot go on without it.
            self._failure = WorkerError("\n".join(lost + errors))
            self.shutdown()
            raise self._failure
        if errors:
            raise WorkerError("\n".join(errors))
        return result

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._failure is not None:
            raise WorkerError(f"{method}(): the worker ranks are gone; they ended on:\n{self._failure}")
        if not self._finalizer.alive:
            raise RuntimeError(f"{method}() after shutdown(): the worker ranks are gone")
        for rank, conn in enumerate(self._conns):
            try:
                conn.send((method, args, kwargs))
            except OSError:  # BrokenPipeError: the rank exited since the last call
                self._procs[rank].join(1.0)
                self._failure = WorkerError(f"rank {rank} exited (code {self._procs[rank].exitcode}) before "
                                            f"{method}()")
                self.shutdown()
                raise self._failure from None
        return self._gather(f"{method}()")

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """`LLM.generate` on every rank; rank 0's outputs."""
        return self._call("generate", *args, **kwargs)

    def chat(self, *args: Any, **kwargs: Any) -> Any:
        """`LLM.chat` on every rank; rank 0's outputs."""
        return self._call("chat", *args, **kwargs)

    def beam_search(self, *args: Any, **kwargs: Any) -> Any:
        """`LLM.beam_search` on every rank; rank 0's outputs."""
        return self._call("beam_search", *args, **kwargs)

    def shutdown(self) -> None:
        """Stop every rank (each shuts its LLM down first). Idempotent."""
        self._finalizer()

    def __enter__(self) -> WorkerLLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    @property
    def processes(self) -> list[Any]:
        return list(self._procs)


def _stop(conns: list, procs: list) -> None:
    for conn in conns:
        try:
            conn.send(("shutdown", (), {}))
        except (BrokenPipeError, OSError):
            pass
    for proc in procs:
        proc.join(GRACE_SECONDS)
        if proc.is_alive():
            proc.kill()
            proc.join(GRACE_SECONDS)
    for conn in conns:
        conn.close()


def wants_workers(world_size: int) -> bool:
    """A world of several ranks asked for by a process that is not one of them (no WORLD_SIZE)."""
    return world_size > 1 and "WORLD_SIZE" not in os.environ


__all__ = ["WorkerError", "WorkerLLM", "wants_workers"]
