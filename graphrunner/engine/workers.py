"""In-process parallel workers: `LLM(tensor_parallel_size=2)` from a plain Python process.

Parallel runs are SPMD: every rank constructs the same `LLM` and calls the same methods (under
`torchrun` or `graphrunner launch`). When a plain process (no WORLD_SIZE in its environment)
asks for a world of more than one rank, `LLM(...)` returns a `WorkerLLM` instead: it starts the
ranks itself as spawned processes (torch.multiprocessing, the `spawn` start method, so CUDA is
initialised afresh in each), gives each the torchrun variables, and drives them: every call is
sent to every rank, every rank runs it, and rank 0's result comes back. An error in any rank is
raised in the caller with that rank's traceback; the ranks are then shut down. `shutdown()`,
the context manager and interpreter exit stop every worker (joined, then killed after a grace
period), so no process is left behind.
"""

from __future__ import annotations

import atexit
import os
import traceback
import weakref
from typing import Any

GRACE_SECONDS = 10.0
STARTUP_TIMEOUT_S = 600.0  # model load + capture on every rank


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
        """Every rank's reply to one call; rank 0's result. Raises WorkerError on any rank's error."""
        result, errors = None, []
        for conn, proc in zip(self._conns, self._procs, strict=True):
            if timeout is not None and not conn.poll(timeout):
                errors.append(f"rank {self._procs.index(proc)}: no reply to {what} in {timeout:.0f} s")
                continue
            try:
                status, rank, payload = conn.recv()
            except EOFError:
                errors.append(f"rank {self._procs.index(proc)} exited (code {proc.exitcode}) during {what}")
                continue
            if status == "error":
                errors.append(f"rank {rank} raised during {what}:\n{payload}")
            elif rank == 0:
                result = payload
        if errors:
            if what == "start":
                self.shutdown()
            raise WorkerError("\n".join(errors))
        return result

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if not self._finalizer.alive:
            raise RuntimeError(f"{method}() after shutdown(): the worker ranks are gone")
        for conn in self._conns:
            conn.send((method, args, kwargs))
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
