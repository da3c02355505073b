"""CUDA helpers of the tests: capture a CUDA graph of a callable (warmed up on a side stream, where
Triton compiles, outside capture), and run a callable where any wait for the device raises. GPU-only
tests use them; importing this needs no GPU."""

from __future__ import annotations

from collections.abc import Callable


def capture_cuda_graph(fn: Callable[[], object]):
    """Run `fn` once on a side stream, then capture it; returns the torch.cuda.CUDAGraph to replay."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def never_syncing(fn: Callable[..., object]) -> Callable[..., object]:
    """`fn` under CUDA's sync debug mode "error": a call that waits for the device raises."""
    import torch

    def call(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return call
