"""Split-K row projections whose reduction is folded into the next residual add.

At decode batch sizes a row projection (o, down) has few output tiles: qwen2.5-0.5b's down
projection at 256 rows is 14 tiles of 128 x 128 for 132 SMs, each walking K = 4864. cuBLAS then
either leaves most SMs idle or splits K itself and adds a reduce kernel; either way the residual
add + RMSNorm kernel (`layers/norm.py`) follows. Here the projection is a strided batched GEMM
over S slices of K with fp32 outputs (no copies: the slices are views of x and W), and the add +
RMSNorm kernel sums the S partials itself: one launch less, S times more tiles.

The partial sums travel as one fp32 tensor [S, T, N] in place of the projection's [T, N] output
(`is_partials`); every consumer of a row projection's output in this package is a residual add
(`RMSNorm.add_norm`, `norm.add_rms_norm`), which sums them in fp32, rounds the sum to the
activation dtype as the GEMM would have rounded its output, then adds the residual as before.
`settle` turns partials into the plain output where something else needs it (a pipeline stage's
output). The result equals a GEMM that sums K in another order, as cuBLAS's own split-K does.

`split_k_parts` is a table of the shapes measured on an H100 (the projection chain with its add +
RMSNorm, 20 per CUDA graph, docs/bench/decode_fusion/splitk_norm_s22.py, docs/bench/s22/call7):
only those shapes split, only on sm_90 parts, only at one tensor-parallel rank (a TP rank's
partial output is all-reduced as it is), never under torch.compile (whose traced shapes are
symbolic) and never for one row (the GEMV path). GRAPHRUNNER_SPLIT_K=0 turns it off (read once).
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["SPLIT_K", "is_partials", "settle", "split_k_partials", "split_k_parts"]

SPLIT_K = os.environ.get("GRAPHRUNNER_SPLIT_K", "1") != "0"
# Tests set this to force a split count on any device (0: the table).
FORCE_PARTS = 0

# (N, K) of a bf16 / fp16 projection -> ((largest row count, S), ...) by increasing row count; more rows
# than the last entry: no split. Chain times on an H100 (µs, cuBLAS + add_rms_norm -> split-K + summing norm):
# qwen2.5-0.5b down 8.41 -> 6.58 at 8 rows, 9.16 -> 6.98 at 64, 11.46 -> 9.30 at 256; o 5.20 -> 4.77 at 8,
# 5.37 -> 4.99 at 64, even at 256. llama-3.2-1b down 10.98 -> 9.65 at 8, 12.37 -> 10.19 at 32 (S = 2),
# 19.72 -> 16.60 at 128, worse at 256; o 7.00 -> 6.03 at 8, 8.13 -> 7.75 at 128. llama-3.1-8b down
# 47.66 -> 45.34 at 8, 56.20 -> 50.90 at 128, 61.81 -> 58.33 at 256; o 11.34 -> 9.43 at 8, worse from 32.
_TABLE: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {
    (896, 4864): ((256, 4),),  # qwen2.5-0.5b down
    (896, 896): ((128, 2),),  # qwen2.5-0.5b o
    (2048, 8192): ((8, 4), (32, 2), (128, 4)),  # llama-3.2-1b down
    (2048, 2048): ((128, 2),),  # llama-3.2-1b o
    (4096, 14336): ((256, 2),),  # llama-3.1-8b down
    (4096, 4096): ((16, 2),),  # llama-3.1-8b o
}
_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _measured_part(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def split_k_parts(x: torch.Tensor, weight: torch.Tensor) -> int:
    """S for x [T, K] . weight [N, K]^T: 1 (a plain GEMM) unless the module docstring's conditions hold."""
    if not SPLIT_K or torch.compiler.is_compiling():  # before any shape test: traced sizes are symbolic
        return 1
    rows, k = x.shape
    n = weight.shape[0]
    if rows < 2:
        return 1
    if FORCE_PARTS:
        return FORCE_PARTS if k % FORCE_PARTS == 0 else 1
    if not (x.is_cuda and x.dtype in _DTYPES and weight.dtype == x.dtype):
        return 1
    if not _measured_part(x.device.index if x.device.index is not None else torch.cuda.current_device()):
        return 1
    for max_rows, parts in _TABLE.get((n, k), ()):
        if rows <= max_rows:
            return parts if k % (8 * parts) == 0 else 1
    return 1


def split_k_partials(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """x [T, K] . weight [N, K]^T as `parts` fp32 partial sums over consecutive K slices: [S, T, N].

    CUDA: one strided batched GEMM over views of x and weight (`torch.bmm` with fp32 output).
    Elsewhere: the same products in fp32 (exact for half-precision inputs)."""
    (rows, k), n = x.shape, weight.shape[0]
    if k % parts or weight.shape[1] != k:
        raise ValueError(f"split_k_partials: x {tuple(x.shape)} and weight {tuple(weight.shape)} must share K, "
                         f"a multiple of parts={parts}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"split_k_partials needs unit stride along K, got {x.stride()} and {weight.stride()}")
    x_s = x.view(rows, parts, k // parts).transpose(0, 1)  # [S, T, K/S]
    w_s = weight.view(n, parts, k // parts).permute(1, 2, 0)  # [S, K/S, N]
    if x.is_cuda:
        return torch.bmm(x_s, w_s, out_dtype=torch.float32)
    return torch.bmm(x_s.float(), w_s.float())


def is_partials(x: torch.Tensor) -> bool:
    """Whether x is `split_k_partials`' [S, T, N] fp32 form rather than a plain [T, N] output."""
    return x.dim() == 3 and x.dtype == torch.float32


def settle(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The plain [T, N] output in `dtype` of partials (the fp32 sum, rounded once); x itself otherwise."""
    return x.sum(0).to(dtype) if is_partials(x) else x
