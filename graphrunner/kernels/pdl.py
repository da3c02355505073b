"""Programmatic dependent launch (PDL) for the decode step's chain of Triton kernels.

Inside a CUDA graph every kernel node still pays for its launch and for the drain of the
node before it: a batch-1 decode step is a chain of ~10 small kernels per layer, and on an
H100 a qwen2.5-0.5b-shaped chain of 4 GEMVs and 4 elementwise kernels per layer took 23.8
µs a layer plain and 18.6 with PDL (the result bit-identical, eager and replayed from a
graph). Hopper lets a kernel launched with the programmatic-serialization attribute start
while its predecessor is still running:

- `pdl_max_rows(kernel, device)` is decided once, when a layer or backend is built: the
  largest launch (in rows) that uses PDL on a device with properties `device`
  (graphrunner.kernels.device) under `KernelConfig` `kernel`, 0 when none does (PDL off, no
  Triton, not a GPU with compute capability >= 9.0).
- `pdl_launch(rows, max_rows)` gives the launch keyword (`launch_pdl=True`) of a launch of
  `rows` rows. Stream capture records the attribute as a programmatic edge, so captured
  graphs keep the overlap.
- `pdl_wait(GDC)` must run in such a kernel before it reads anything an earlier kernel
  wrote and before its first store (the earlier kernels may still be reading what it
  overwrites): it lets the next kernel start launching (`griddepcontrol.launch_dependents`)
  and then waits until every earlier kernel has finished and its memory is visible
  (`griddepcontrol.wait`). Before the wait a kernel may only read data no kernel of the
  step writes (weights): a GEMV loads its first weight tile there, overlapping the
  predecessor's tail.

A kernel compiled with GDC=True but launched without the attribute waits for nothing (the
instructions are no-ops then). Users: the GEMVs (layers/gemv.py), the fused add + RMSNorm
(layers/norm.py), rope + KV write (attention/kv_write.py) and the paged attention with its
split merge (attention/triton_attn.py). Non-Triton kernels (cuBLAS, inductor's) are launched
without it and keep the full dependency. GDC is False on CPU (the interpreter cannot run the
instructions).
"""

from __future__ import annotations

from graphrunner.config import KernelConfig
from graphrunner.kernels import HAS_TRITON
from graphrunner.kernels.device import DeviceProperties

__all__ = ["PDL_MIN_CAPABILITY", "pdl_launch", "pdl_max_rows", "pdl_wait"]

PDL_MIN_CAPABILITY = (9, 0)


def pdl_max_rows(kernel: KernelConfig, device: DeviceProperties | None) -> int:
    """The largest launch, in rows, that uses PDL on `device` (None: not a GPU; 0: none):
    `kernel.pdl_max_rows` where `kernel.pdl` is on and the device can (Triton, compute
    capability >= 9.0)."""
    if not (kernel.pdl and HAS_TRITON and device is not None and device.capability >= PDL_MIN_CAPABILITY):
        return 0
    return kernel.pdl_max_rows


def pdl_launch(rows: int, max_rows: int) -> dict[str, bool]:
    """The launch keywords of a kernel over `rows` rows: PDL's when `rows <= max_rows` (the
    `pdl_max_rows` of its layer), else none. The kernel's GDC constexpr must be `bool(` of the
    result `)`."""
    return {"launch_pdl": True} if 0 < rows <= max_rows else {}


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def pdl_wait(GDC: tl.constexpr):
        """Release the next kernel's launch, then wait for the earlier kernels (module docstring)."""
        if GDC:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
