"""Plain greedy decoding without materialized logits: the LM head GEMM with an argmax epilogue.

A plain-greedy step (the GREEDY graph variant: argmax of the raw logits and nothing else)
otherwise writes fp32 logits [R, V] from the LM head and reads them back in the argmax: at
256 rows x 151,936 that is 156 MB each way, ~100 us of a qwen2.5-0.5b step on an H100 next to
the head's 272 MB weight read. Here one Triton GEMM computes each [BM, BN] tile of
logits in fp32 registers and reduces it at once, per row, to the argmax module's partials:
the tile's max, that max's first column and the first NaN column (`sample/argmax.py`'s rules,
which are torch.argmax's). The argmax's combine kernel then reduces a row's V / BN partials.

The logits are the same fp32 sums as the head's (bf16 products, fp32 accumulation) up to the
summation order, so a row whose two best logits tie to within that order may pick the other
one, as cuBLAS itself may between shapes. Programs walk the M tiles of one N tile next to each
other, so a W tile is read from DRAM once and from L2 by its other M tiles.

The LM head's `greedy` (layers/embedding.py) calls it for a plain-greedy batch of at least two
rows (`greedy_head_serves`) when the head was built for it: `KernelConfig.greedy_head` on, one rank
holding the whole half-precision head on a CUDA device (`greedy_head_fits`); otherwise it keeps
the logits and the separate argmax. Works on CPU under TRITON_INTERPRET=1 (fp32 inputs: the
interpreter's half-precision dot is unreliable).

x and W are read in one of two ways (`greedy_head_loads`): pointer tiles, one program per tile,
below PERSISTENT_MIN_ROWS rows; from that many rows, tensor descriptors (the tensor-memory
accelerator) with one program per SM looping over the tiles, so that a tile's epilogue overlaps
the next tile's first loads. On an H100, qwen2.5-0.5b's head (151,936 x 896): 256 rows pointer 153.8 ->
136.4 us (four stages), 64 rows 111.9 -> 102.5 us, against cuBLAS logits + argmax 233.8 / 142.5 us.
Fewer rows were not timed per kernel, and the batch-8 step ran 3-5% slower with the persistent
kernel on one H100, so they keep the pointer kernel. Inputs a descriptor cannot describe (rows
not 16-byte aligned) take the pointer kernel.
"""

from __future__ import annotations

import torch

from graphrunner.kernels import HAS_TRITON, check_tensor, sm_count
from graphrunner.sample.argmax import MAX_CHUNKS, combine_partials

__all__ = ["LOADS", "PERSISTENT_MIN_ROWS", "descriptors_fit", "greedy_head_fits", "greedy_head_loads",
           "greedy_head_plan", "greedy_head_serves", "greedy_head_triton", "vocab_fits"]

# What `greedy_tokens` sends here: half-precision heads. An fp32 head keeps its exact logits + argmax
# (the kernel would take fp32 dots in IEEE mode, several times slower than cuBLAS's).
_SERVED_DTYPES = (torch.bfloat16, torch.float16)
_MIN_ROWS = 2  # one row keeps the GEMV head (layers/decode_linear.py) and the split argmax
LOADS = ("pointer", "tma_persistent")  # how the kernel reads x and W (module docstring)
PERSISTENT_MIN_ROWS = 64  # the persistent descriptor kernel from this many rows

if HAS_TRITON:
    import triton
    import triton.language as tl

    _NEG_INF = tl.constexpr(float("-inf"))
    _NONE = tl.constexpr(2147483647)  # argmax.py's "no index"

    @triton.jit
    def _store_tile_partials(acc, rm, rn, pid_n, M, V, max_ptr, idx_ptr, nan_ptr, BN: tl.constexpr):
        # acc [BM, BN] fp32 logits of rows rm, columns rn: per row (max, its first column, first NaN
        # column) at partial [row, n tile].
        m_ok, n_ok = rm < M, rn < V
        cols = tl.broadcast_to(rn[None, :], acc.shape)
        nan = acc != acc
        s = tl.where(nan | ~n_ok[None, :], _NEG_INF, acc)  # NaN never enters the max; it wins below
        best = tl.max(s, 1)  # [BM]
        # A row of only -inf gives its first column, as torch.argmax does (columns >= V come last).
        first = tl.min(tl.where(s == best[:, None], cols, _NONE), 1)
        first_nan = tl.min(tl.where(nan & n_ok[None, :], cols, _NONE), 1)
        at = rm * tl.cdiv(V, BN) + pid_n  # [BM]: entries of the [M, V / BN] partials
        tl.store(max_ptr + at, best, mask=m_ok)
        tl.store(idx_ptr + at, first, mask=m_ok)
        tl.store(nan_ptr + at, first_nan, mask=m_ok)

    @triton.jit
    def _head_argmax_kernel(x_ptr, w_ptr, max_ptr, idx_ptr, nan_ptr, M, V, K, stride_xm, stride_wv,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                            IEEE: tl.constexpr):
        # Program (m tile, n tile), m fastest: the tile's logits x[rm] . W[rn]^T in fp32, reduced per
        # row to (max, its first column, first NaN column) at partial [row, n tile].
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BM)
        pid_m, pid_n = pid % num_m, pid // num_m
        rm = pid_m * BM + tl.arange(0, BM)  # [BM]
        rn = pid_n * BN + tl.arange(0, BN)  # [BN]
        rk = tl.arange(0, BK)  # [BK]
        m_ok, n_ok = rm < M, rn < V
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wv  # [BN, 1]
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + rk
            if EVEN_K:
                a = tl.load(x_rows + ks[None, :], mask=m_ok[:, None], other=0.0)  # [BM, BK]
                b = tl.load(w_rows + ks[None, :], mask=n_ok[:, None], other=0.0)  # [BN, BK]
            else:
                a = tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & (ks[None, :] < K), other=0.0)
                b = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & (ks[None, :] < K), other=0.0)
            if IEEE:  # fp32 inputs: exact fp32 products, as the logits path (not TF32)
                acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc)
        _store_tile_partials(acc, rm, rn, pid_n, M, V, max_ptr, idx_ptr, nan_ptr, BN)

    @triton.jit
    def _head_argmax_persistent_kernel(x_desc, w_desc, max_ptr, idx_ptr, nan_ptr, M, V, K, num_programs,
                                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
        # The same tiles, loaded by the tensor-memory accelerator: x_desc [M, K] in [BM, BK] boxes, w_desc
        # [V, K] in [BN, BK] boxes; boxes past M, V or K arrive as zeros (masked in the epilogue, or adding
        # nothing to the sums). Program p serves tiles p, p + num_programs, ... (m fastest), num_programs
        # at most the SM count.
        num_m = tl.cdiv(M, BM)
        num_tiles = num_m * tl.cdiv(V, BN)
        # The tile and K loops flattened into one software pipeline, so that the next tile's first boxes
        # load during this tile's epilogue.
        for tile in tl.range(tl.program_id(0), num_tiles, num_programs, flatten=True):
            pid_m, pid_n = tile % num_m, tile // num_m
            acc = tl.zeros([BM, BN], tl.float32)
            for k0 in range(0, K, BK):
                a = x_desc.load([pid_m * BM, k0])  # [BM, BK]
                b = w_desc.load([pid_n * BN, k0])  # [BN, BK]
                if IEEE:
                    acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, tl.trans(b), acc)
            rm = pid_m * BM + tl.arange(0, BM)
            rn = pid_n * BN + tl.arange(0, BN)
            _store_tile_partials(acc, rm, rn, pid_n, M, V, max_ptr, idx_ptr, nan_ptr, BN)


def greedy_head_plan(num_rows: int, hidden: int, device: torch.device,
                     dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages): 128 x 256 tiles of 64-wide K steps at 8 warps, the
    usual Hopper bf16 GEMM shape, four stages deep (three: 143.7 µs at 256 rows on an H100, four:
    136.4); 64-row tiles for up to 64 rows, three stages (the fastest there); K steps halved for
    fp32 (the stages' tiles must fit the 227 KiB of shared memory); small tiles on CPU (the
    interpreter)."""
    if device.type != "cuda":
        return 16, 32, 16, 4, 1
    bk = (64 if hidden % 64 == 0 else 32) // (2 if dtype == torch.float32 else 1)
    if num_rows <= 64:
        return 64, 256, bk, 8, 3
    return 128, 256, bk, 8, (3 if dtype == torch.float32 else 4)


def greedy_head_fits(weight: torch.Tensor) -> bool:
    """Whether the fused kernel can serve a head of this weight [V, K] at all, decided once when the
    head is built: Triton, a half-precision CUDA weight, unit stride along K, a vocabulary whose
    partials fit the combine (the CUDA plans' tiles are all 256 wide)."""
    return (HAS_TRITON and weight.is_cuda and weight.dim() == 2 and weight.dtype in _SERVED_DTYPES
            and weight.stride(1) == 1
            and vocab_fits(weight.shape[0], greedy_head_plan(_MIN_ROWS, weight.shape[1], weight.device, weight.dtype)))


def greedy_head_serves(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused kernel runs for these rows of a head that `greedy_head_fits` (else logits + argmax)."""
    return (hidden.is_cuda and hidden.dim() == 2 and hidden.shape[0] >= _MIN_ROWS and hidden.dtype == weight.dtype
            and hidden.stride(1) == 1 and weight.shape[1] == hidden.shape[1])


def vocab_fits(vocab: int, tiles: tuple[int, int, int, int, int]) -> bool:
    """Whether a row's vocab-tile partials fit the combine kernel (MAX_CHUNKS): at 256-wide tiles a
    vocabulary of up to 262,144; a larger one keeps logits + argmax rather than failing."""
    return -(-vocab // tiles[1]) <= MAX_CHUNKS


def greedy_head_triton(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                       tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """hidden [R, K] . weight [V, K]^T -> out [R] (int32 | int64): each row's argmax, no logits. `tiles`
    (BM, BN, BK, warps, stages) overrides the plan (tests: several tiles per row at small sizes)."""
    if not HAS_TRITON:
        raise RuntimeError("greedy_head_triton needs triton, which failed to import")
    (num_rows, k), (vocab, k_w) = hidden.shape, weight.shape
    if k != k_w or hidden.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must share K with unit "
                         f"stride along it (strides {hidden.stride()}, {weight.stride()})")
    check_tensor("out", out, (num_rows,), (torch.int32, torch.int64))
    bm, bn, bk, warps, stages = tiles or greedy_head_plan(num_rows, k, hidden.device, hidden.dtype)
    num_n = triton.cdiv(vocab, bn)
    if not vocab_fits(vocab, (bm, bn, bk, warps, stages)):
        raise ValueError(f"vocab {vocab} in {bn}-wide tiles gives {num_n} partials per row; the combine takes "
                         f"at most {MAX_CHUNKS}")
    if num_rows == 0:
        return out
    part = {name: torch.empty(num_rows, num_n, dtype=dtype, device=hidden.device)
            for name, dtype in (("max", torch.float32), ("idx", torch.int32), ("nan", torch.int32))}
    num_tiles = triton.cdiv(num_rows, bm) * num_n
    ieee = hidden.dtype == torch.float32
    if greedy_head_loads(num_rows) == "tma_persistent" and descriptors_fit(hidden, weight, (bm, bn, bk)):
        from triton.tools.tensor_descriptor import TensorDescriptor

        programs = min(num_tiles, sm_count(hidden.device, cpu=2))
        _head_argmax_persistent_kernel[(programs,)](
            TensorDescriptor.from_tensor(hidden, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]),
            part["max"], part["idx"], part["nan"], num_rows, vocab, k, programs, BM=bm, BN=bn, BK=bk, IEEE=ieee,
            num_warps=warps, num_stages=stages)
    else:
        _head_argmax_kernel[(num_tiles,)](
            hidden, weight, part["max"], part["idx"], part["nan"], num_rows, vocab, k, hidden.stride(0),
            weight.stride(0), BM=bm, BN=bn, BK=bk, EVEN_K=k % bk == 0, IEEE=ieee, num_warps=warps,
            num_stages=stages)
    return combine_partials(part["max"], part["idx"], part["nan"], out)


def greedy_head_loads(num_rows: int) -> str:
    """How the kernel reads x and W for `num_rows` rows (one of LOADS): tma_persistent from
    PERSISTENT_MIN_ROWS rows, pointer below (where the persistent kernel was not measured ahead)."""
    return "tma_persistent" if num_rows >= PERSISTENT_MIN_ROWS else "pointer"


def descriptors_fit(hidden: torch.Tensor, weight: torch.Tensor, box: tuple[int, int, int]) -> bool:
    """Whether tensor descriptors can describe hidden [R, K] and weight [V, K] in (BM, BN, BK) boxes: row
    strides and base addresses 16-byte aligned, unit stride along K, K-wide boxes of whole 16 bytes, every
    box side at most 256 (the accelerator's limits)."""
    elem = hidden.element_size()
    return (all(t.stride(1) == 1 and t.stride(0) * elem % 16 == 0 and t.data_ptr() % 16 == 0
                for t in (hidden, weight))
            and box[2] * elem % 16 == 0 and max(box) <= 256)
