"""Multi-GPU benchmark worlds: each configuration runs as its own `graphrunner launch` world.

A benchmark module runs itself as the worker (`--worker KIND --result PATH`): every rank builds the
engine, rank 0 writes its JSON result. `run_worlds` launches one world per configuration (skipping
those that need more GPUs than there are), collects the results with each world's exit status and
wall time, and rewrites OUT/STEM.json after every world, so a killed run keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def add_world_args(p: argparse.ArgumentParser) -> None:
    """The options every world benchmark has: the per-world timeout and the hidden worker role."""
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per world before it is killed")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)


def run_as_worker(args: argparse.Namespace, worker: Callable[[argparse.Namespace], None]) -> bool:
    """In a worker rank (`--worker KIND`): run `worker(args)` and exit at once (never hang in
    interpreter teardown after a clean shutdown). Returns False in the driver."""
    if not args.worker:
        return False
    worker(args)
    sys.stdout.flush()
    os._exit(0)


def run_worlds(module: str, kinds: Sequence[str], nproc_of: Callable[[str], int], worker_args: Sequence[str],
               out: Path, stem: str, timeout: float, device: str = "cuda") -> list[dict]:
    """Launch `python -m module --worker KIND --result PATH *worker_args` on nproc_of(KIND) ranks, per KIND
    (one GPU per rank: a KIND needing more GPUs than there are is skipped; device "cpu": gloo ranks)."""
    import torch

    from graphrunner.distributed.launch import launch

    out.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count() if device == "cuda" else sys.maxsize
    results: list[dict] = []
    for kind in kinds:
        nproc = nproc_of(kind)
        if nproc > gpus:
            results.append({"config": kind, "skipped": f"needs {nproc} GPUs, found {gpus}"})
            continue
        path = out / f"{stem}_{kind}.json"
        path.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", module, "--worker", kind, "--result", str(path), *worker_args]
        start = time.perf_counter()
        status = launch(cmd, nproc, timeout=timeout)
        entry = json.loads(path.read_text()) if status == 0 and path.is_file() else {"config": kind}
        entry.update(status=status, wall_s=round(time.perf_counter() - start, 1))
        results.append(entry)
        (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    return results


def write_result(llm: object, result: dict, path: str) -> None:
    """End a worker: shut its engine down (graphs, cache, groups), then rank 0 writes `result`."""
    rank = llm.groups.rank  # type: ignore[attr-defined]
    llm.shutdown()  # type: ignore[attr-defined]
    if rank == 0:
        Path(path).write_text(json.dumps(result, indent=1))


def all_ok(results: Sequence[dict]) -> int:
    """The process exit code: 0 when every world exited cleanly."""
    return 0 if all(r.get("status", 0) == 0 for r in results) else 1


__all__ = ["add_world_args", "all_ok", "run_as_worker", "run_worlds", "write_result"]
