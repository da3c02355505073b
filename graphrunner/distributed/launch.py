"""`graphrunner launch --nproc N -- COMMAND...`: start N ranks of a command, torchrun-style.

Each child gets the standard env variables (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT=a free port) and
OMP_NUM_THREADS (default: cores / N, at least 1) unless already set. Output lines are
streamed with a `[rank R]` prefix. When one child fails (non-zero exit or a signal)
the others are terminated (SIGTERM, then SIGKILL after a grace period) and the
launcher exits with that child's status; `--timeout` bounds the whole run.

No rank outlives the launcher, and the launcher does not outlive its own parent: each rank
asks the kernel for SIGTERM when the launcher dies (Linux `PR_SET_PDEATHSIG`, so even a
SIGKILLed launcher takes its ranks with it), and a launcher whose parent exits (a shell or
`graphrunner generate` that was killed) stops every rank and exits with status 129. A rank
that is stopped (SIGSTOP) or hangs leaves its peers' collectives to raise within the
collective timeout; they exit, and the launcher then stops the silent rank too.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

GRACE_SECONDS = 5.0


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, nproc: int, port: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of rank `rank` of `nproc` (a copy of `base`, default os.environ)."""
    env = dict(os.environ if base is None else base)
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


_PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_GONE_STATUS = 129  # 128 + SIGHUP: what a shell reports for a job whose terminal went away


def _die_with(parent_pid: int):
    """A `preexec_fn`: SIGTERM this child when the launcher dies; exit at once if it already has
    (the kernel only watches from the prctl call on). A no-op where prctl does not exist."""
    def setup() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent_pid:
            os._exit(PARENT_GONE_STATUS)
    return setup


def _pump(stream, rank: int, out, lock: threading.Lock, prefix: bool) -> None:
    for line in iter(stream.readline, b""):
        text = line.decode(errors="replace")
        with lock:
            out.write(f"[rank {rank}] {text}" if prefix else text)
            out.flush()
    stream.close()


def launch(
    command: Sequence[str],
    nproc: int,
    *,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    prefix: bool = True,
    out=None,
) -> int:
    """Run `command` as `nproc` ranks; returns 0, or the first failing rank's exit status.

    A rank killed by a signal counts as status 128 + signal; a timeout returns 124 after
    killing every rank.
    """
    if nproc < 1:
        raise ValueError(f"nproc={nproc} must be >= 1")
    if not command:
        raise ValueError("launch needs a command to run")
    out = out or sys.stdout
    port = free_port()
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    for rank in range(nproc):
        p = subprocess.Popen(
            list(command), env=rank_env(rank, nproc, port, env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: we can stop it and its children
            preexec_fn=_die_with(os.getpid()) if sys.platform.startswith("linux") else None,
        )
        procs.append(p)
        t = threading.Thread(target=_pump, args=(p.stdout, rank, out, lock, prefix), daemon=True)
        t.start()
        pumps.append(t)
    deadline = None if timeout is None else time.monotonic() + timeout
    parent = os.getppid()
    status = 0
    try:
        while True:
            if os.getppid() != parent:  # re-parented: whoever started the launcher is gone
                with lock:
                    print(f"[launch] the launcher's parent (pid {parent}) exited; stopping every rank", file=sys.stderr)
                status = PARENT_GONE_STATUS
                break
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                status = 128 - code if code < 0 else code
                with lock:
                    print(f"[launch] rank {rank} exited with status {code}; stopping the other ranks", file=sys.stderr)
                break
            if all(c == 0 for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                with lock:
                    print(f"[launch] timeout after {timeout:.0f} s; stopping every rank", file=sys.stderr)
                status = 124
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        status = 130
    finally:
        _stop(procs)
        for t in pumps:
            t.join(timeout=2.0)
    return status


def _stop(procs: list[subprocess.Popen]) -> None:
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        _signal_group(p, signal.SIGTERM)
    end = time.monotonic() + GRACE_SECONDS
    for p in alive:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # the child's own session/process group (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `launch` subcommand to the `graphrunner` parser."""
    p = subparsers.add_parser(
        "launch",
        help="run a command as N ranks with torchrun's env variables",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nproc", type=int, required=True, help="number of ranks (processes)")
    p.add_argument("--timeout", type=float, default=None, help="seconds before every rank is killed (exit 124)")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with [rank R]")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise SystemExit(
            "graphrunner launch: give the command after --, e.g. graphrunner launch --nproc 2 -- python x.py"
        )
    if args.nproc < 1:
        raise SystemExit(f"graphrunner launch: --nproc={args.nproc} must be >= 1")
    return launch(cmd, args.nproc, timeout=args.timeout, prefix=not args.no_prefix)


__all__ = ["free_port", "launch", "rank_env", "register", "run"]
