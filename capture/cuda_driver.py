"""The few CUDA driver calls a decode step makes, called directly (ctypes, libcuda).

Why: at 256 decoding requests the whole host side of a step has ~60 us. Through torch,
recording an event, making a stream wait, a non-blocking D2H copy into pinned memory
and a graph replay cost several microseconds each of Python and dispatcher work (the
copy also books the pinned block in the caching host allocator; the replay also
re-seeds the default generator's graph-safe RNG state with two fill kernels, which our
graphs do not use: sampling noise is stateless, keyed by seed and position). The
driver calls themselves take about a microsecond.

`CudaDriver.load()` returns None where libcuda is absent (a CPU machine) or the env
var GRAPHRUNNER_CUDA_DRIVER=0 turns the fast path off; callers then use torch. The
handles are the runtime's (torch's) streams, events and graph execs: the runtime and
the driver share them. Every call checks its result and raises `CudaDriverError`
naming the call and the CUDA error.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

logger = logging.getLogger("graphrunner.cuda_driver")

ENV_SWITCH = "GRAPHRUNNER_CUDA_DRIVER"


class CudaDriverError(RuntimeError):
    """A driver call failed."""


class CudaDriver:
    """Thin, checked wrappers over cuEventRecord, cuStreamWaitEvent, cuMemcpyDtoHAsync,
    cuMemcpyHtoDAsync and cuGraphLaunch. Handles are ints (torch's `.cuda_stream`, `.cuda_event`,
    `CUDAGraph.raw_cuda_graph_exec()`); pointers are ints (`data_ptr()`)."""

    _instance: CudaDriver | None = None
    _tried = False

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        vp, sz, u = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
        self._event_record = self._bind("cuEventRecord", [vp, vp])
        self._stream_wait_event = self._bind("cuStreamWaitEvent", [vp, vp, u])
        self._memcpy_dtoh = self._bind("cuMemcpyDtoHAsync_v2", [vp, ctypes.c_uint64, sz, vp])
        self._memcpy_htod = self._bind("cuMemcpyHtoDAsync_v2", [ctypes.c_uint64, vp, sz, vp])
        self._graph_launch = self._bind("cuGraphLaunch", [vp, vp])
        self._error_name = lib.cuGetErrorName
        self._error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def _bind(self, name: str, argtypes: list):
        fn = getattr(self._lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
        return fn

    @classmethod
    def load(cls) -> CudaDriver | None:
        """The process's driver binding, or None where it cannot (or must not) be used."""
        if cls._tried:
            return cls._instance
        cls._tried = True
        if os.environ.get(ENV_SWITCH, "1") == "0" or not torch.cuda.is_available():
            return None
        try:
            cls._instance = cls(ctypes.CDLL("libcuda.so.1"))
        except (OSError, AttributeError) as e:
            logger.info("CUDA driver fast path off (%s); using torch's calls", e)
            cls._instance = None
        return cls._instance

    def _check(self, result: int, call: str) -> None:
        if result != 0:
            name = ctypes.c_char_p()
            self._error_name(result, ctypes.byref(name))
            raise CudaDriverError(f"{call} failed: {(name.value or b'?').decode()} ({result})")

    def event_record(self, event: int, stream: int) -> None:
        r = self._event_record(event, stream)
        if r:
            self._check(r, "cuEventRecord")

    def stream_wait_event(self, stream: int, event: int) -> None:
        r = self._stream_wait_event(stream, event, 0)
        if r:
            self._check(r, "cuStreamWaitEvent")

    def memcpy_dtoh_async(self, dst_host: int, src_device: int, nbytes: int, stream: int) -> None:
        r = self._memcpy_dtoh(dst_host, src_device, nbytes, stream)
        if r:
            self._check(r, f"cuMemcpyDtoHAsync({nbytes} bytes)")

    def memcpy_htod_async(self, dst_device: int, src_host: int, nbytes: int, stream: int) -> None:
        """Asynchronous only from pinned memory; the caller keeps `src_host` unchanged until the
        copy has completed (no caching-allocator bookkeeping here, unlike torch's copy_)."""
        r = self._memcpy_htod(dst_device, src_host, nbytes, stream)
        if r:
            self._check(r, f"cuMemcpyHtoDAsync({nbytes} bytes)")

    def graph_launch(self, graph_exec: int, stream: int) -> None:
        r = self._graph_launch(graph_exec, stream)
        if r:
            self._check(r, "cuGraphLaunch")

    @staticmethod
    def graph_exec_handle(graph: torch.cuda.CUDAGraph) -> int | None:
        """The graph's cudaGraphExec_t as an int; None where this torch cannot say."""
        fn = getattr(graph, "raw_cuda_graph_exec", None)
        if fn is None:
            return None
        try:
            handle = int(fn())
        except (RuntimeError, TypeError, ValueError):
            return None
        return handle or None
