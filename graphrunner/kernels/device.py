"""What a kernel plan may know about a GPU: its measurable properties, never its name.

`device_properties(device)` reads them once per CUDA device (host-side and cached, so safe
during capture); CPU devices have none. Plans are keyed by shapes and by the classes below,
so a new part falls into the class its properties put it in.

Peak memory bandwidth is `2 * memory_clock_rate * memory_bus_width / 8` (double data rate),
as `torch.cuda._device_limits` computes it: an H100 SXM (80 GB HBM3, 5120-bit bus at 2619 MHz)
gives 3.35 TB/s, an H200 (141 GB HBM3e, 6144-bit bus at 3201 MHz) 4.92 TB/s.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["WIDE_MEMORY_BYTES", "WIDE_MEMORY_BYTES_PER_S", "DeviceProperties", "device_properties"]

# Parts at or above this peak bandwidth get the wide-memory GEMV plans (graphrunner.layers.gemv):
# between an H100 SXM's 3.35 TB/s and an H200's 4.92 TB/s.
WIDE_MEMORY_BYTES_PER_S = 4.0e12
# Where the driver reports no memory clock, the memory size stands in: HBM3e parts carry more
# than this (an H200 141 GB), HBM3 ones less (an H100 80 GB, an H100 NVL 94 GB).
WIDE_MEMORY_BYTES = 120 << 30


@dataclass(frozen=True)
class DeviceProperties:
    """The properties of a GPU that kernel plans depend on."""

    capability: tuple[int, int]  # compute capability (major, minor)
    multi_processor_count: int
    total_memory: int  # bytes
    l2_cache_size: int  # bytes
    memory_bytes_per_s: float  # peak DRAM bandwidth; 0 when the driver does not report the clock

    @property
    def wide_memory(self) -> bool:
        """HBM3e-class bandwidth (an H200): the GEMV wants more bytes in flight per program."""
        if self.memory_bytes_per_s > 0:
            return self.memory_bytes_per_s >= WIDE_MEMORY_BYTES_PER_S
        return self.total_memory >= WIDE_MEMORY_BYTES

    @classmethod
    def from_torch(cls, props) -> DeviceProperties:
        """From `torch.cuda.get_device_properties` (memory_clock_rate in kHz, memory_bus_width in bits)."""
        bandwidth = 2.0 * props.memory_clock_rate * 1000 * props.memory_bus_width / 8
        return cls((props.major, props.minor), props.multi_processor_count, props.total_memory,
                   props.L2_cache_size, bandwidth)


@functools.cache
def _cuda_properties(index: int) -> DeviceProperties:
    return DeviceProperties.from_torch(torch.cuda.get_device_properties(index))


def device_properties(device: torch.device | str | None) -> DeviceProperties | None:
    """The properties of a CUDA `device` (cached); None for any other device."""
    device = torch.device(device if device is not None else "cpu")
    if device.type != "cuda":
        return None
    return _cuda_properties(device.index if device.index is not None else torch.cuda.current_device())
