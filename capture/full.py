"""FULL graphs: capture and replay of a whole step function over static buffers.

A `FullGraph` owns one captured step for one graph key. The step function reads and
writes only persistent buffers (docs/architecture.md §4), so replay needs no arguments: the caller
writes the per-step host inputs into their static buffers and calls `replay()`.

On CUDA the step is captured into a `torch.cuda.CUDAGraph` in the shared pool. On a
CPU there are no graphs, so capture *records* the step and replay re-runs it over the
same buffers (docs/architecture.md §7): CI still exercises dispatch, padding and buffer discipline.

A replay that raises (a CUDA error surfacing at the launch, or the CPU stand-in's step
failing) is re-raised as `GraphReplayError` naming the graph key, the original kept as
`__cause__`. (A fault inside a kernel is asynchronous: it surfaces at the next sync, such
as the output copy, not in `replay()`.)

Debug mode (a flag, not a log level): capture snapshots the addresses of the static
tensors the step reads; each replay checks them and then runs the caller's invariant
check, raising `GraphReplayError` that names the graph key.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable

import torch

from capture.cuda_driver import CudaDriver
from capture.pool import CAPTURE_MODE, GraphPool
from capture.report import CaptureRecord, read_graph_dot

StaticTensors = Callable[[], dict[str, torch.Tensor]]


def _new_graph(keep_graph: bool) -> torch.cuda.CUDAGraph:
    """A CUDA graph; `keep_graph` keeps its node list after instantiation (for DOT dumps).

    Newer torch versions free the captured node list at instantiation unless asked to
    keep it; older ones have no such argument and keep it in debug mode.
    """
    if keep_graph:
        try:
            return torch.cuda.CUDAGraph(keep_graph=True)
        except TypeError:
            pass
    return torch.cuda.CUDAGraph()


class GraphReplayError(RuntimeError):
    """A replay that failed (its `__cause__` the device's error), whose inputs moved, or whose
    padding broke an invariant; the message names the graph key."""


class FullGraph:
    """One step function captured for one key (a CUDA graph, or its CPU stand-in)."""

    def __init__(
        self,
        key: str,
        step: Callable[[], None],
        pool: GraphPool,
        *,
        static_tensors: StaticTensors | None = None,
        check_invariants: Callable[[], None] | None = None,
        debug: bool = False,
    ):
        self.key = key
        self._step = step
        self._pool = pool
        self._static_tensors = static_tensors
        self._check_invariants = check_invariants
        self.debug = debug
        self._graph: torch.cuda.CUDAGraph | None = None
        self._captured_ptrs: dict[str, int] = {}
        self.captured = False
        # The driver fast path: cuGraphLaunch of the exec handle on the current raw stream
        # (see capture.cuda_driver); None: torch's replay.
        self._launch: Callable[[], None] | None = None

    def capture(self, *, warmup: int = 1, inspect_nodes: bool = False) -> CaptureRecord:
        """Warm up, then capture (CUDA) or record (CPU) the step. Returns its cost."""
        reserved_before = self._pool.reserved_bytes()
        start = time.perf_counter()
        if self._pool.is_cuda:
            stream = self._pool.stream
            assert stream is not None, "a CUDA pool has its capture stream"
            stream.wait_stream(torch.cuda.current_stream(self._pool.device))
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    self._step()
            torch.cuda.current_stream(self._pool.device).wait_stream(stream)
            graph = _new_graph(keep_graph=inspect_nodes)
            if inspect_nodes:
                graph.enable_debug_mode()
            with torch.cuda.graph(graph, pool=self._pool.handle, stream=stream, capture_error_mode=CAPTURE_MODE):
                self._step()
            if inspect_nodes and hasattr(graph, "instantiate"):
                graph.instantiate()  # a kept graph instantiates lazily; do it inside capture time
            torch.cuda.synchronize(self._pool.device)
            self._graph = graph
            self._launch = self._driver_launch(graph)
        else:
            for _ in range(warmup):
                self._step()
        seconds = time.perf_counter() - start
        self._captured_ptrs = self._snapshot()
        self.captured = True
        num_nodes, kernels = (self._dump_nodes() if inspect_nodes and self._graph is not None else (None, {}))
        return CaptureRecord(self.key, seconds, self._pool.reserved_bytes() - reserved_before, num_nodes, kernels)

    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError(f"graph {self.key} replayed before capture")
        if self.debug:
            self._check_addresses()
        try:  # free in CPython >= 3.11 while nothing raises: the hot path pays nothing
            if self._launch is not None:
                self._launch()
            elif self._graph is not None:
                self._graph.replay()
            else:
                self._step()
        except GraphReplayError:
            raise
        except RuntimeError as e:  # a CUDA error (or the CPU stand-in's): say which graph
            raise GraphReplayError(f"graph {self.key}: replay failed: {e}") from e
        if self.debug and self._check_invariants is not None:
            try:
                self._check_invariants()
            except AssertionError as e:
                raise GraphReplayError(f"graph {self.key}: padding invariant broken: {e}") from None

    def write_dot(self, path: str | os.PathLike) -> None:
        """Graphviz DOT of the captured graph (CUDA, captured with inspect_nodes=True)."""
        if self._graph is None:
            raise RuntimeError(f"graph {self.key} has no CUDA graph to dump (CPU emulation or not captured)")
        self._graph.debug_dump(str(path))

    def _driver_launch(self, graph: torch.cuda.CUDAGraph) -> Callable[[], None] | None:
        """A replay that skips torch's wrapper: a graph launch on the current stream.

        torch's replay also re-seeds the default generator's graph-safe RNG state (two
        fill kernels per replay); step graphs draw no torch random numbers (sampling
        noise is stateless), so the bare launch replays them exactly.
        """
        drv = CudaDriver.load()
        device = self._pool.device
        if drv is None or device.index is None or device.index != torch.cuda.current_device():
            return None
        handle = drv.graph_exec_handle(graph)
        if handle is None:
            return None
        launch, raw_stream, index = drv.graph_launch, torch._C._cuda_getCurrentRawStream, device.index
        return lambda: launch(handle, raw_stream(index))

    def release(self) -> None:
        self._launch = None
        if self._graph is not None:
            self._graph.reset()
        self._graph = None
        self.captured = False

    # ---- internals ----------------------------------------------------------------
    def _snapshot(self) -> dict[str, int]:
        if self._static_tensors is None:
            return {}
        return {name: t.data_ptr() for name, t in self._static_tensors().items()}

    def _check_addresses(self) -> None:
        now = self._snapshot()
        for name, ptr in self._captured_ptrs.items():
            if now.get(name) != ptr:
                raise GraphReplayError(
                    f"graph {self.key}: static input {name!r} moved since capture "
                    f"(captured at {ptr:#x}, now at {now.get(name, 0):#x}); a graph only reads captured addresses"
                )

    def _dump_nodes(self) -> tuple[int | None, dict[str, int]]:
        fd, path = tempfile.mkstemp(suffix=".dot")
        os.close(fd)
        try:
            if self._graph is None:
                return None, {}
            self._graph.debug_dump(path)
            return read_graph_dot(path)
        except Exception:  # node introspection is best effort across torch/CUDA versions
            return None, {}
        finally:
            os.unlink(path)
