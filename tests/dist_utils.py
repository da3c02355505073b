"""Run a function in a gloo world of N CPU processes (test helper).

    results = run_world(2, fn, arg1, arg2, timeout_s=30)   # [fn's return on rank 0, on rank 1]
    world = start_world(2, fn, ...); ...; results = world.wait()   # several worlds side by side

Each child: OMP_NUM_THREADS=1 and torch.set_num_threads(1) (a 2-core CI machine runs
several ranks), the torchrun env variables set, joins a gloo world on a free localhost
port with `init_process_group` (unless init_pg=False), calls `fn(rank, world_size,
*args)`, and sends back its return value (picklable) or its formatted traceback. The
parent raises `WorldError` naming each failed rank with its traceback, and kills (by
pid: only processes it started) any rank that has not reported within `timeout_s`,
naming it as hung, with the Python stacks of all its threads: each child registers
faulthandler on SIGUSR1 into a file of its own, and the parent signals a hung rank and
puts what it wrote into the `WorldError` (a rank stuck in C code, even holding the GIL,
still dumps). Children leave through `os._exit` after reporting, so a stalled peer can
never hang the teardown of the process group.

Children are forked (torch is already imported; fork costs milliseconds where spawn
costs an interpreter and a torch import per rank). Set GRAPHRUNNER_TEST_START=spawn
to use spawn, then `fn` must be importable (a module-level function).
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["EIGHT_HEADS", "World", "WorldError", "free_port", "register_eight_heads", "run_world", "start_world"]


class WorldError(RuntimeError):
    """One or more ranks failed or hung; the message names each with its traceback."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        parts = [f"--- rank {r} ---\n{msg}" for r, msg in sorted(failures.items())]
        super().__init__(f"{len(failures)} rank(s) failed: {sorted(failures)}\n" + "\n".join(parts))


def free_port() -> int:
    """A free localhost TCP port (closed again: a tiny race, fine for tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_STACK_WAIT_S = 3.0  # for a hung rank's faulthandler dump after the signal


def _child(
    rank: int, world_size: int, port: int, pg_timeout_s: float, init_pg: bool, conn: Any, fn: Callable, args: tuple,
    stack_path: str | None = None,
) -> None:
    code = 0
    stacks = open(stack_path, "w") if stack_path else None  # noqa: SIM115 - open until os._exit
    if stacks is not None:
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        # torchrun's variables, so code under test can also join the world itself (init_pg=False).
        os.environ.update(
            OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is already initialized in the forked child (the test process joined a "
                "world itself); run with GRAPHRUNNER_TEST_START=spawn or keep the parent out of any world"
            )
        if init_pg:
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                timeout=timedelta(seconds=pg_timeout_s),
            )
        result = fn(rank, world_size, *args)
        conn.send(("ok", result))
    except BaseException:  # noqa: BLE001 - everything goes to the parent
        code = 1
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
    finally:
        conn.close()
        # No destroy_process_group: a stalled or dead peer could hang it. The OS tears down.
        os._exit(code)


def run_world(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = 60.0,
    pg_timeout_s: float = 30.0,
    allow_hang: frozenset[int] = frozenset(),
    init_pg: bool = True,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; their return values, by rank.

    timeout_s: wall-clock budget of the whole world; ranks that have not reported by then
    are killed and reported as hung. allow_hang: ranks expected not to report (a stalled
    rank in a timeout test): killed at the end without error, their result is None.
    pg_timeout_s: the default-group timeout of each rank.
    init_pg: join the gloo world before calling fn (False: fn joins it, e.g. through
    `init_distributed`, from the torchrun variables RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*
    that every child has set either way).
    """
    return start_world(world_size, fn, *args, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s,
                       allow_hang=allow_hang, init_pg=init_pg).wait()


def start_world(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = 60.0,
    pg_timeout_s: float = 30.0,
    allow_hang: frozenset[int] = frozenset(),
    init_pg: bool = True,
) -> World:
    """`run_world` without waiting: the ranks start now, `World.wait()` returns (or raises) what
    `run_world` does. Worlds that mostly wait (out a timeout) can run side by side."""
    method = os.environ.get("GRAPHRUNNER_TEST_START", "fork")
    ctx = mp.get_context(method)
    port = free_port()
    procs, conns = [], []
    stack_dir = tempfile.mkdtemp(prefix="world-stacks-")
    for rank in range(world_size):
        parent_end, child_end = ctx.Pipe(duplex=False)
        stack_path = os.path.join(stack_dir, f"rank{rank}.txt")
        child_args = (rank, world_size, port, pg_timeout_s, init_pg, child_end, fn, args, stack_path)
        p = ctx.Process(target=_child, args=child_args, daemon=True)
        p.start()
        child_end.close()
        procs.append(p)
        conns.append(parent_end)
    return World(procs, conns, timeout_s, allow_hang, time.monotonic() + timeout_s, stack_dir)


class World:
    """The ranks of a started world (`start_world`)."""

    def __init__(self, procs: list, conns: list, timeout_s: float, allow_hang: frozenset[int],
                 deadline: float, stack_dir: str | None = None) -> None:
        self.procs, self.conns, self.timeout_s = procs, conns, timeout_s
        self.allow_hang, self.deadline, self.stack_dir = allow_hang, deadline, stack_dir

    def _stacks(self, ranks: set[int]) -> dict[int, str]:
        """The Python stacks of every thread of `ranks` (still running), dumped by faulthandler on SIGUSR1."""
        if self.stack_dir is None or not ranks:
            return {}
        paths = {r: os.path.join(self.stack_dir, f"rank{r}.txt") for r in ranks}
        for r in ranks:
            if self.procs[r].is_alive():
                os.kill(self.procs[r].pid, signal.SIGUSR1)  # this child's pid only
        deadline = time.monotonic() + _STACK_WAIT_S
        dumps: dict[int, str] = {}
        while time.monotonic() < deadline and len(dumps) < len(ranks):
            time.sleep(0.1)
            for r, path in paths.items():
                text = open(path).read() if os.path.exists(path) else ""
                if "most recent call first" in text and r not in dumps:
                    time.sleep(0.2)  # the other threads' stacks follow the first one's
                    dumps[r] = open(path).read()
        return dumps

    def wait(self) -> list[Any]:
        """The ranks' return values; `WorldError` naming each rank that failed or hung."""
        procs, conns = self.procs, self.conns
        results: list[Any] = [None] * len(procs)
        failures: dict[int, str] = {}
        pending = set(range(len(procs))) - set(self.allow_hang)
        try:
            while pending and time.monotonic() < self.deadline:
                left = max(0.0, self.deadline - time.monotonic())
                ready = multiprocessing.connection.wait([conns[r] for r in pending], timeout=left)
                for conn in ready:
                    rank = conns.index(conn)
                    pending.discard(rank)
                    try:
                        status, payload = conn.recv()
                    except EOFError:
                        procs[rank].join(5)
                        failures[rank] = f"exited without a result (exit code {procs[rank].exitcode})"
                        continue
                    if status == "ok":
                        results[rank] = payload
                    else:
                        failures[rank] = payload
            stacks = self._stacks(pending)
            for rank in pending:
                failures[rank] = (f"no result within timeout_s={self.timeout_s} (hung); killed; its threads' stacks:\n"
                                  + stacks.get(rank, "(no faulthandler dump)"))
        finally:
            for rank, p in enumerate(procs):
                # Ranks that reported are on their way out; give them a moment, then kill.
                if p.is_alive() and rank not in self.allow_hang and rank not in failures:
                    p.join(2)
                if p.is_alive():
                    p.kill()  # SIGKILL to this child's pid only
                p.join(5)
            for c in conns:
                c.close()
            if self.stack_dir is not None:
                shutil.rmtree(self.stack_dir, ignore_errors=True)
        if failures:
            raise WorldError(failures)
        return results


EIGHT_HEADS = "builtin:tiny-llama-8h"  # 8 query / 4 KV heads: TP4 (tiny-llama's 2 KV heads do not split in 4)


def register_eight_heads() -> None:
    """Add EIGHT_HEADS (tiny-llama, 256 wide, 8 query / 4 KV heads) to this process's built-ins."""
    import dataclasses
    from types import MappingProxyType

    from graphrunner.models import registry

    if EIGHT_HEADS in registry.BUILTIN_MODELS:
        return
    tiny = registry.BUILTIN_MODELS["builtin:tiny-llama"]
    eight = dataclasses.replace(tiny, name=EIGHT_HEADS, hidden_size=256, intermediate_size=512,
                                num_attention_heads=8, num_key_value_heads=4)
    registry.BUILTIN_MODELS = MappingProxyType({**registry.BUILTIN_MODELS, EIGHT_HEADS: eight})
