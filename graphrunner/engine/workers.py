"""In-process parallel workers: `LLM(tensor_parallel_size=2)` from a plain Python process.

Parallel runs are SPMD: every rank constructs the same `LLM` and calls the same methods (under
`torchrun` or `graphrunner launch`). When a plain process (no WORLD_SIZE in its environment)
asks for a world of more than one rank, `LLM(...)` returns a `WorkerLLM` instead: it starts the
ranks itself as spawned processes (torch.multiprocessing, the `spawn` start method, so CUDA is
initialised afresh in each), gives each the torchrun variables, and drives them: every call is
sent to every rank, every rank runs it, and rank 0's result comes back. An error in any rank is
raised in the caller with that rank's traceback (a bad request's ValueError or TypeError as
itself, caused by a `WorkerError` with the traceback, as `LLM` raises it); a rank that fails to
start shuts the others down. A rank that exits, or stays silent longer than the collective timeout
(plus a margin) after another rank replied (stopped, or hung outside a collective), ends the
workers: the caller gets a WorkerError naming it, and every later call raises with that cause. A
call may take as long as it needs while no rank has replied. `shutdown()`, the context manager and
interpreter exit stop every worker (joined, then killed after a grace period), so no process is
left behind.

It also drives the engine loop a server runs (`add_request`, `abort_request`, `step_outputs`,
`has_unfinished_requests`, `scheduler_stats`): under data parallelism each request goes to the
ranks of one replica (the one with the fewest live requests), every rank steps, and the
replicas' outputs are merged.
"""

from __future__ import annotations

import atexit
import os
import pickle
import threading
import time
import traceback
import weakref
from collections.abc import Sequence
from typing import Any

GRACE_SECONDS = 10.0
STARTUP_TIMEOUT_S = 600.0  # model load + capture on every rank
# Past the collective timeout, the time a rank may take to notice it and send its error back.
REPLY_MARGIN_S = 10.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0  # LLM's default


class WorkerError(RuntimeError):
    """A worker rank raised; the message carries its traceback."""


# A rank's exception of these types is the caller's mistake (a bad model, prompt or parameter),
# refused before anything changed: the driver raises it as itself, as `LLM` would.
REQUEST_ERRORS = (ValueError, TypeError, FileNotFoundError)


def _error_reply(rank: int, exc: BaseException) -> tuple[str, int, tuple[str, BaseException | None]]:
    """("error", rank, (traceback, the exception when it is a request error and pickles, else None))."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    own: BaseException | None = None
    if isinstance(exc, REQUEST_ERRORS):
        try:
            own = pickle.loads(pickle.dumps(exc))
        except Exception:  # an exception that does not round-trip travels as its traceback only
            own = None
    return ("error", rank, (text, own))


def _worker_main(rank: int, world: int, port: int, conn: Any, llm_cls: type, args: tuple, kwargs: dict,
                 reports: bool) -> None:
    """One rank: build the LLM (`llm_cls`, pickled by reference), then run the driver's calls until
    "shutdown". `reports`: this rank leads a DP replica and sends its results (the others send None)."""
    from graphrunner.distributed.launch import rank_env

    os.environ.update(rank_env(rank, world, port, base={}))
    try:
        llm = llm_cls(*args, **kwargs)
    except BaseException as e:
        conn.send(_error_reply(rank, e))
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
            except BaseException as e:
                conn.send(_error_reply(rank, e))
                continue
            conn.send(("ok", rank, result if reports else None))
    finally:
        llm.shutdown()
        conn.close()


class WorkerLLM:
    """Drives the spawned ranks of one `LLM` (module docstring). Use like `LLM`: `generate`, `chat`,
    `beam_search`, the engine loop of `AsyncEngine`, `shutdown`, `with ...:`; `tokenizer`, `config`
    and `max_model_len` are rank 0's, copied at start; the runner and scheduler live in the ranks.
    Calls from several threads run one at a time."""

    def __init__(self, world_size: int, llm_cls: type, args: tuple, kwargs: dict) -> None:
        import torch.multiprocessing as mp

        from graphrunner.distributed.launch import free_port

        ctx = mp.get_context("spawn")
        port = free_port()
        self.world_size = world_size
        # DP replica r holds the global ranks [r * size, (r + 1) * size) (distributed/groups.py); its first leads.
        self.data_parallel_size = int(kwargs.get("data_parallel_size", 1))
        replica = world_size // self.data_parallel_size
        self._replicas = [list(range(r * replica, (r + 1) * replica)) for r in range(self.data_parallel_size)]
        # The ranks' peers raise within the collective timeout of a stalled rank's silence.
        self.reply_timeout_s = float(kwargs.get("collective_timeout_s", DEFAULT_COLLECTIVE_TIMEOUT_S)) + REPLY_MARGIN_S
        self._failure: WorkerError | None = None  # what ended the workers, raised again by every later call
        self._conns, self._procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, daemon=True,
                               args=(rank, world_size, port, child, llm_cls, args, kwargs, rank % replica == 0))
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._finalizer = weakref.finalize(self, _stop, self._conns, self._procs)
        atexit.register(self._finalizer)
        self._owner: dict[str, int] = {}  # live request id -> its DP replica (add_request's routing)
        self._lock = threading.Lock()  # one call at a time on the pipes, whichever thread makes it
        self._gather("start", range(world_size), STARTUP_TIMEOUT_S)
        # What callers read as attributes, fetched now, so reading one never talks to the ranks.
        self.tokenizer, self.config, self.max_model_len = (
            self._call_ranks([0], "__getattribute__", name)[0] for name in ("tokenizer", "config", "max_model_len"))

    def _gather(self, what: str, ranks: Sequence[int], timeout: float | None = None) -> list[Any]:
        """The replies of `ranks` to one call, in rank order: each replica leader's result (None
        from the others).

        `timeout`: the most seconds before the first reply (None: no limit). Once a rank replied,
        the others get `reply_timeout_s`; a rank that exits or stays silent ends the workers
        (WorkerError, raised again by every later call). A rank's request error is raised as
        itself, caused by a WorkerError with the tracebacks; any other error as WorkerError."""
        from multiprocessing.connection import wait

        results: dict[int, Any] = {}
        errors: list[str] = []
        lost: list[str] = []
        request_error: BaseException | None = None
        pending = {r: self._conns[r] for r in ranks}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else deadline - time.monotonic()
            ready = set(wait([*pending.values(), *(self._procs[r].sentinel for r in pending)],
                             None if left is None else max(left, 0.0)))
            if not ready:  # past the deadline: the ranks still silent are stalled, and are stopped now
                limit = timeout if len(pending) == len(ranks) and timeout is not None else self.reply_timeout_s
                lost += [f"rank {r}: no reply to {what} within {limit:.0f} s (stalled)" for r in sorted(pending)]
                for r in pending:
                    self._procs[r].kill()  # a stalled rank would only take the shutdown's grace period
                break
            for r, conn in list(pending.items()):
                proc = self._procs[r]
                if conn not in ready and proc.sentinel not in ready:
                    continue
                try:
                    status, _, payload = conn.recv()
                except (EOFError, OSError):
                    proc.join(1.0)
                    lost.append(f"rank {r} exited (code {proc.exitcode}) during {what}")
                    del pending[r]
                    continue
                del pending[r]
                if status == "error":
                    text, own = payload
                    errors.append(f"rank {r} raised during {what}:\n{text}")
                    request_error = request_error or own
                    results[r] = None
                else:
                    results[r] = payload if status == "ok" else None
            if pending:  # some rank replied (or exited) in this pass: the others have reply_timeout_s
                reply_deadline = time.monotonic() + self.reply_timeout_s
                deadline = reply_deadline if deadline is None else min(deadline, reply_deadline)
        if lost or (errors and what == "start"):
            # A rank is gone or stalled (or the start failed): the others cannot go on without it.
            self._failure = WorkerError("\n".join(lost + errors))
            self.shutdown()
            if request_error is not None and not lost:  # a bad argument: raised as itself, as LLM raises it
                raise request_error from self._failure
            raise self._failure
        if errors:
            failure = WorkerError("\n".join(errors))
            if request_error is not None:  # the root cause; the others' errors (a peer gone) follow from it
                raise request_error from failure
            raise failure
        return [results[r] for r in ranks]

    def _call_ranks(self, ranks: Sequence[int], method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """`method` on each of `ranks`; their replies (`_gather`)."""
        with self._lock:
            if self._failure is not None:
                raise WorkerError(f"{method}(): the worker ranks are gone; they ended on:\n{self._failure}")
            if not self._finalizer.alive:
                raise RuntimeError(f"{method}() after shutdown(): the worker ranks are gone")
            for rank in ranks:
                try:
                    self._conns[rank].send((method, args, kwargs))
                except OSError:  # BrokenPipeError: the rank exited since the last call
                    self._procs[rank].join(1.0)
                    self._failure = WorkerError(f"rank {rank} exited (code {self._procs[rank].exitcode}) before "
                                                f"{method}()")
                    self.shutdown()
                    raise self._failure from None
            return self._gather(f"{method}()", ranks)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`method` on every rank (SPMD); rank 0's result."""
        return self._call_ranks(range(self.world_size), method, *args, **kwargs)[0]

    def _leader_results(self, method: str, *args: Any) -> list[Any]:
        """`method` on each replica's leader only (it reads the replica's state; no collective runs)."""
        return self._call_ranks([ranks[0] for ranks in self._replicas], method, *args)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """`LLM.generate` on every rank; rank 0's outputs."""
        return self._call("generate", *args, **kwargs)

    def chat(self, *args: Any, **kwargs: Any) -> Any:
        """`LLM.chat` on every rank; rank 0's outputs."""
        return self._call("chat", *args, **kwargs)

    def beam_search(self, *args: Any, **kwargs: Any) -> Any:
        """`LLM.beam_search` on every rank; rank 0's outputs."""
        return self._call("beam_search", *args, **kwargs)

    def embed(self, *args: Any, **kwargs: Any) -> Any:
        """`LLM.embed` (a pooling runner) on every rank; rank 0's outputs."""
        return self._call("embed", *args, **kwargs)

    def classify(self, *args: Any, **kwargs: Any) -> Any:
        """`LLM.classify` on every rank; rank 0's outputs."""
        return self._call("classify", *args, **kwargs)

    def score(self, *args: Any, **kwargs: Any) -> Any:
        """`LLM.score` on every rank; rank 0's outputs."""
        return self._call("score", *args, **kwargs)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        """`LLM.encode` on every rank; rank 0's outputs."""
        return self._call("encode", *args, **kwargs)

    def get_tokenizer(self) -> Any:
        """Rank 0's tokenizer (None without one)."""
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """`LLM.reset_prefix_cache` on every rank."""
        return bool(self._call("reset_prefix_cache"))

    # ---------------------------------------------------------------- the engine loop (AsyncEngine)
    def add_request(self, request_id: str, prompt: Any, params: Any = None, *, stream: bool = True,
                    lora_request: Any = None) -> None:
        """`LLM.add_request` on the ranks of the replica with the fewest live requests; ValueError
        (nothing queued anywhere) for a bad request."""
        load = [0] * self.data_parallel_size
        for replica in self._owner.values():
            load[replica] += 1
        replica = min(range(self.data_parallel_size), key=load.__getitem__)
        self._call_ranks(self._replicas[replica], "add_request", request_id, prompt, params, stream=stream,
                         lora_request=lora_request)
        self._owner[request_id] = replica

    def abort_request(self, request_id: str) -> None:
        """`LLM.abort_request` on the ranks of the request's replica; unknown ids are ignored."""
        replica = self._owner.get(request_id)
        if replica is not None:
            self._call_ranks(self._replicas[replica], "abort_request", request_id)

    def step_outputs(self) -> tuple[list[Any], list[Any]]:
        """`LLM.step_outputs` on every rank (each replica steps its own requests); the replicas'
        finished outputs and stream deltas, merged. A failed step forgets every request (the
        ranks aborted them)."""
        finished: list[Any] = []
        deltas: list[Any] = []
        try:
            for part in self._call_ranks(range(self.world_size), "step_outputs"):
                if part is not None:
                    finished += part[0]
                    deltas += part[1]
        except BaseException:
            self._owner.clear()
            raise
        for out in finished:
            self._owner.pop(out.request_id, None)
        return finished, deltas

    def has_unfinished_requests(self) -> bool:
        """Whether any replica holds a live request or unreported output."""
        return any(self._leader_results("has_unfinished_requests"))

    def scheduler_stats(self) -> Any:
        """The replicas' `SchedulerStats`, summed."""
        from graphrunner.engine.scheduler import SchedulerStats

        return SchedulerStats.merge(self._leader_results("scheduler_stats"))

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
