"""Capture a CUDA graph of a callable in tests: warm it up on a side stream (Triton compiles there,
outside capture), then capture it. GPU-only tests use it; importing it needs no GPU."""

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
