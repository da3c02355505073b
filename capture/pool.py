"""The one memory pool and capture stream every graph of a runner shares.

Graphs captured into one pool share memory, which is safe because only one graph
replays at a time on one stream and each graph's outputs are copied (inside the graph)
into persistent buffers allocated outside the pool. On a CPU there is no pool: the
object exists so callers need no branches.
"""

from __future__ import annotations

import torch

# cudaStreamCaptureMode of every capture. Under the default "global" a CUDA call that may
# synchronise (a cudaMalloc, NCCL setting up a communicator) made by *any* thread while a
# capture runs fails and invalidates that capture. Engines keep such threads running during
# start-up: a KV-transfer link whose peer arrived while its instance captured graph 103 of 121
# failed with "operation not permitted when stream is capturing" and took the capture down.
# "thread_local" still refuses those calls on the capturing thread, the one whose work the
# graph records; the other threads' work runs on their own streams and is not recorded.
CAPTURE_MODE = "thread_local"


class GraphPool:
    """Owns the CUDA graph memory pool handle and the side stream captures run on."""

    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.handle = torch.cuda.graph_pool_handle() if self.is_cuda else None
        # Capturing on a side stream keeps the capture off the legacy default stream,
        # which cannot be captured.
        self.stream = torch.cuda.Stream(device) if self.is_cuda else None

    def free_bytes(self) -> int:
        """Free device memory now (0 on CPU)."""
        if not self.is_cuda:
            return 0
        return torch.cuda.mem_get_info(self.device)[0]

    def reserved_bytes(self) -> int:
        if not self.is_cuda:
            return 0
        return torch.cuda.memory_reserved(self.device)

    def release(self) -> None:
        """Drop the handle; memory returns once every graph that used it is gone.

        cuBLAS keeps a workspace (32 MiB on Hopper) per stream it ran on, held for the
        life of the process; the capture stream dies with this pool, so its workspace
        is dropped too (the others are recreated on next use), or every
        create/capture/destroy cycle would leak one.
        """
        self.handle = None
        self.stream = None
        if self.is_cuda:
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                torch.cuda.synchronize(self.device)
                clear()
