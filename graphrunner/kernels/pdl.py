"""Programmatic dependent launch (PDL) for the decode step's chain of Triton kernels.

Inside a CUDA graph every kernel node still pays for its launch and for the drain of the
node before it: a batch-1 decode step is a chain of ~10 small kernels per layer, and on an
H100 a qwen2.5-0.5b-shaped chain of 4 GEMVs and 4 elementwise kernels per layer took 23.8
µs a layer plain and 18.6 with PDL (the result bit-identical, eager and replayed from a
graph). Hopper lets a kernel launched with
the programmatic-serialization attribute start while its predecessor is still running:

- `pdl_launch(device, rows)` gives the launch keyword (`launch_pdl=True`) on a GPU that
  has PDL (compute capability >= 9.0) for launches of at most `PDL_MAX_ROWS` rows (1: the
  batch-1 decode chain, where every projection is a Triton GEMV), unless
  `GRAPHRUNNER_PDL=0` (read once at import). Stream capture records the attribute as a
  programmatic edge, so captured graphs keep the overlap.
- `pdl_wait(GDC)` must run in such a kernel before it reads anything an earlier kernel
  wrote and before its first store (the earlier kernels may still be reading what it
  overwrites): it lets the next kernel start launching (`griddepcontrol.launch_dependents`)
  and then waits until every earlier kernel has finished and its memory is visible
  (`griddepcontrol.wait`). Before the wait a kernel may only read data no kernel of the
  step writes (weights): a GEMV loads its first weight tile there, overlapping the
  predecessor's tail.

A kernel compiled with GDC=True but launched without the attribute waits for nothing (the
instructions are no-ops then). Users: the GEMV (layers/decode_linear.py), the fused
add + RMSNorm (layers/norm.py), rope + KV write (attention/rope_kv.py) and the paged
attention with its split merge (attention/triton_attn.py). Non-Triton kernels
(cuBLAS, inductor's) are launched without it and keep the full dependency. GDC is False on
CPU (the interpreter cannot run the instructions).
"""

from __future__ import annotations

import functools
import os

import torch

from graphrunner.kernels import HAS_TRITON

__all__ = ["PDL", "pdl_enabled", "pdl_launch", "pdl_wait"]

PDL = os.environ.get("GRAPHRUNNER_PDL", "1") == "1"
# Launches of more rows than this keep the full dependency. Measured on an H100
# (qwen2.5-0.5b FULL, context 1024): PDL everywhere took batch 1 from 0.959 to 0.883 ms but batch 8
# from 1.218 to 1.259 and batch 256 from 2.820 to 3.052: past one row the projections are cuBLAS
# GEMMs (no PDL), and the Triton kernels launched early beside them only hold SM slots while they wait.
PDL_MAX_ROWS = int(os.environ.get("GRAPHRUNNER_PDL_MAX_ROWS", "1"))
_MIN_CAPABILITY = (9, 0)


@functools.cache
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= _MIN_CAPABILITY


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` may be compiled with GDC=True and launched with PDL."""
    if not (PDL and HAS_TRITON and device.type == "cuda"):
        return False
    return _device_has_pdl(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(device: torch.device, rows: int) -> dict[str, bool]:
    """The launch keywords of a kernel over `rows` tokens on `device`: PDL's when it is
    enabled there and `rows <= PDL_MAX_ROWS`, else none. The kernel's GDC constexpr must be
    `bool(` of the result `)`."""
    return {"launch_pdl": True} if rows <= PDL_MAX_ROWS and pdl_enabled(device) else {}


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def pdl_wait(GDC: tl.constexpr):
        """Release the next kernel's launch, then wait for the earlier kernels (module docstring)."""
        if GDC:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
