"""Host cost of the CUDA calls a decode step makes, through torch and through the driver.

    python -m graphrunner_tools.bench.api_costs [--iters 2000]

A diagnostic for the per-step host budget (issue #4: <= 60 us at 256 requests): each
line is the mean host time of one call, measured over `iters` calls on an otherwise
idle device (the queue is drained every 64 calls so launches never block on a full
queue). Prints one line per primitive; no figure here is a benchmark result.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch


def _mean_us(fn, iters: int, drain=None) -> float:
    for _ in range(16):
        fn()
    if drain:
        drain()
    total = 0.0
    done = 0
    while done < iters:
        n = min(64, iters - done)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        total += time.perf_counter() - t0
        done += n
        if drain:
            drain()
    return total / iters * 1e6


def _one_kernel_graph(dev: torch.device, rows: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A captured graph of one small kernel (warmed up on a side stream first), and the
    tensor it writes: keep that alive for as long as the graph replays."""
    compute = torch.cuda.current_stream(dev)
    x = torch.zeros(rows, device=dev)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(dev)
    s.wait_stream(compute)
    with torch.cuda.stream(s):
        x.add_(1)
    compute.wait_stream(s)
    with torch.cuda.graph(graph):
        x.add_(1)
    return graph, x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--rows", type=int, default=256)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("api_costs needs a CUDA device")
        return 1
    from capture.cuda_driver import CudaDriver

    dev = torch.device("cuda", torch.cuda.current_device())
    compute = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)
    ev = torch.cuda.Event()
    src = torch.zeros(args.rows, dtype=torch.int32, device=dev)
    dst = torch.empty(args.rows, dtype=torch.int32, pin_memory=True)
    graph, _graph_tensor = _one_kernel_graph(dev, args.rows)
    sync = torch.cuda.synchronize
    drv = CudaDriver.load()
    rows: list[tuple[str, float]] = []

    def add(label, fn, drain=None):
        rows.append((label, _mean_us(fn, args.iters, drain)))

    add("torch Event.record(stream)", lambda: ev.record(compute))
    add("torch Stream.wait_event", lambda: side.wait_event(ev))
    add("torch.cuda.set_stream", lambda: torch.cuda.set_stream(compute))
    add("torch.cuda.current_stream(dev)", lambda: torch.cuda.current_stream(dev))
    add(f"torch pinned.copy_(dev[{args.rows}], non_blocking)", lambda: dst.copy_(src, non_blocking=True), sync)
    add("torch CUDAGraph.replay", graph.replay, sync)
    add("torch Event.query", ev.query)
    add("torch._C._cuda_getCurrentRawStream", lambda: torch._C._cuda_getCurrentRawStream(dev.index))
    if drv is not None:
        stream_h, side_h, ev_h = compute.cuda_stream, side.cuda_stream, ev.cuda_event
        nbytes = src.numel() * src.element_size()
        exec_h = drv.graph_exec_handle(graph)
        add("driver cuEventRecord", lambda: drv.event_record(ev_h, stream_h))
        add("driver cuStreamWaitEvent", lambda: drv.stream_wait_event(side_h, ev_h))
        add(
            f"driver cuMemcpyDtoHAsync({nbytes} B)",
            lambda: drv.memcpy_dtoh_async(dst.data_ptr(), src.data_ptr(), nbytes, side_h),
            sync,
        )
        if exec_h is not None:
            add("driver cuGraphLaunch", lambda: drv.graph_launch(exec_h, stream_h), sync)
    a = np.arange(args.rows, dtype=np.int32)
    add(f"numpy [{args.rows}].reshape(-1,1).tolist()", lambda: a.reshape(-1, 1).tolist())
    ids = [f"req-{i}" for i in range(args.rows)]
    index = {r: i for i, r in enumerate(ids)}
    add(f"dict copy ({args.rows})", lambda: dict(index))
    width = max(len(label) for label, _ in rows)
    print(f"host cost per call on {torch.cuda.get_device_name(dev)} (torch {torch.__version__}), mean of {args.iters}")
    for label, us in rows:
        print(f"  {label:<{width}}  {us:7.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
