"""Distributed faults around `graphrunner launch`: a stopped (SIGSTOP) rank, a killed launcher and a
launcher whose parent dies each end every process, with a clear error, within the collective timeout
plus a few seconds, instead of leaving ranks behind or hanging."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux's")

# A rank that records its pid, then waits to be stopped from outside.
SLEEPER = "import os, sys, time; open(sys.argv[1] + os.environ['RANK'], 'w').write(str(os.getpid())); time.sleep(120)"

# Two ranks join a gloo world with a 3 s collective timeout; rank 1 stops itself (SIGSTOP) after the
# first all-reduce, so rank 0's second all-reduce can never complete.
STOPPED_PEER = """
import os, signal, torch
import torch.distributed as dist
from graphrunner.config import ParallelConfig
from graphrunner.distributed.groups import init_distributed

groups = init_distributed(ParallelConfig(tensor_parallel_size=2, collective_timeout_s=3.0), "cpu")
dist.all_reduce(torch.ones(4), group=groups.tp.cpu_group)
if groups.tp_rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
dist.all_reduce(torch.ones(4), group=groups.tp.cpu_group)
"""


def _launch_cmd(nproc: int, *cmd: str) -> list[str]:
    return [sys.executable, "-m", "graphrunner.cli", "launch", "--nproc", str(nproc), "--timeout", "110", "--", *cmd]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its re-parented owner) is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _rank_pids(prefix: Path, n: int, deadline_s: float = 60.0) -> list[int]:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        files = [Path(f"{prefix}{r}") for r in range(n)]
        if all(f.exists() and f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.05)
    raise AssertionError("the ranks did not start")


def _gone_within(pids: list[int], seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_a_stopped_rank_ends_the_launch_within_the_collective_timeout(tmp_path):
    script = tmp_path / "stopped_peer.py"
    script.write_text(STOPPED_PEER)
    start = time.monotonic()
    proc = subprocess.run(_launch_cmd(2, sys.executable, str(script)), env=_env(), capture_output=True, text=True,
                          timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode not in (0, 124), proc.stdout[-2000:] + proc.stderr[-2000:]
    # Rank 0 raised from its collective (naming the timeout); the launcher then stopped rank 1.
    assert "[rank 0]" in proc.stdout and "Traceback" in proc.stdout, proc.stdout[-2000:]
    assert "rank 0 exited with status 1; stopping the other ranks" in proc.stderr, proc.stderr[-2000:]
    assert elapsed < 60, elapsed  # start-up, 3 s of collective timeout, 5 s of grace: not the 110 s limit


def test_a_killed_launcher_takes_its_ranks_with_it(tmp_path):
    prefix = tmp_path / "pid"
    launcher = subprocess.Popen(_launch_cmd(2, sys.executable, "-c", SLEEPER, str(prefix)), env=_env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ranks = _rank_pids(prefix, 2)
        launcher.kill()  # SIGKILL: the launcher cannot stop anything itself
        launcher.wait(10)
        assert _gone_within(ranks, 10), [p for p in ranks if _alive(p)]
    finally:
        launcher.kill()


def test_a_launcher_whose_parent_dies_stops_every_rank(tmp_path):
    prefix = tmp_path / "pid"
    # The launcher's parent (as a shell or a relaunching `graphrunner generate` would be) reports
    # the launcher's pid, then is killed.
    parent_code = (
        "import subprocess, sys; p = subprocess.Popen(sys.argv[2:]); "
        "open(sys.argv[1], 'w').write(str(p.pid)); p.wait()"
    )
    launcher_pid_file = tmp_path / "launcher"
    parent = subprocess.Popen([sys.executable, "-c", parent_code, str(launcher_pid_file),
                               *_launch_cmd(2, sys.executable, "-c", SLEEPER, str(prefix))], env=_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ranks = _rank_pids(prefix, 2)
        launcher_pid = int(launcher_pid_file.read_text())
        parent.kill()
        parent.wait(10)
        assert _gone_within([launcher_pid, *ranks], 15), [p for p in (launcher_pid, *ranks) if _alive(p)]
    finally:
        parent.kill()
        for pid in _rank_pids(prefix, 2, 0.1) if all(Path(f"{prefix}{r}").exists() for r in range(2)) else []:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
