"""Row-wise argmax of the logits (greedy sampling), split over many programs per row.

`torch.argmax(x, dim=-1)` reduces one row per thread block: at 256 rows x 151,936
fp32 logits an H100 gets 256 blocks for 132 SMs (under two per SM), each streaming
600 KB on its own, and takes 79-88 us against a read floor of ~52 us. Here every row
is cut into C chunks of whole blocks:

1. partial (R x C programs): each program streams its chunk with unmasked,
   aligned loads (the chunk starts at a multiple of BLOCK; only the row's last,
   partial block is masked) and keeps per lane a running max with its first index
   and the first NaN index; it reduces those over its lanes and writes
   (max, first index of the max, first NaN index) to scratch [R, C].
2. combine: reduces a row's C partials with the same rules. The last program of a row
   to finish does it inside the same launch: after storing its partials each program
   adds one to the row's arrival counter (acq_rel, GPU scope); the one that sees C - 1
   reads the row's partials past L1, writes the token and puts the counter back to zero
   for the next launch (graph replays). The counters are one persistent zeroed int32
   buffer per device (`_COUNTERS`), so a device must not run two argmax launches at once
   (the sampler runs on one stream). On a first use inside a graph capture, or with more rows
   than the buffer holds, a second kernel of R programs combines instead. On an H200 the
   in-launch combine takes one call at 256 rows from 45.3 / 40.7 us (one-call replay / in-graph,
   second kernel) to 43.3 / 39.9, at no cost in a qwen2.5-0.5b batch-1 step.
   A row of one chunk writes its token directly either way.

The result is torch.argmax's, bit for bit (CPU and CUDA agree on these rules):
- a row with a NaN gives the index of its first NaN (torch ranks NaN above every number);
- else the FIRST index of its maximum (+inf included; -0.0 and 0.0 are equal);
- so a row of only -inf gives 0 (every entry ties at the max, -inf).
The tie rule is explicit (smallest index among the lanes or chunks that hold the
max), never left to `tl.argmax`. fp32, bf16 and fp16 inputs compare in fp32, which
represents bf16 and fp16 values exactly.

The chunk plan (`chunk_plan`) is a pure function of R, V and the SM count: the most chunks
for which R x C stays within `_PROGRAMS_PER_SM` programs per SM (one wave: 3 chunks at 256
rows left 768 programs for 528 slots on 132 SMs, a second wave a third full; an H200 took
45.1 us there, 40.9 with 2 chunks, and 64 rows 14.6 -> 14.1 us with 8 chunks instead of 9),
with chunks of at least `_MIN_CHUNK`
elements (37 chunks for one row of 152k). The grid comes from Python ints only, and the
outputs and scratch are `torch.empty` (no memset): graph-safe, no host sync.
"""

from __future__ import annotations

import dataclasses

import torch

from graphrunner.kernels import HAS_TRITON, check_tensor, sm_count, use_triton

__all__ = ["MAX_CHUNKS", "ChunkPlan", "argmax_rows", "argmax_rows_triton", "chunk_plan", "combine_partials",
           "partial_num_warps"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.int32, torch.int64)
_BLOCK = 2048  # elements per loop step
# Warps: BLOCK / (32 x elements per thread), so small test blocks get fewer. Long chunks (at least
# _LONG_CHUNK_BLOCKS blocks) take 4 elements a thread (16 warps at BLOCK, one 16-byte load each): 4 programs x
# 16 warps fill an SM's 64 warp slots, and more warps hide the compare-and-select between loads. Short chunks
# (one row: 37 chunks of 2 blocks) keep 8 (8 warps), where the wider cross-warp reduction costs more than it
# hides. In-graph, 8 / 16 warps for long chunks, interleaved: 256 rows H200 40.2 -> 39.5 µs,
# H100 56.2 -> 55.2; 64 rows unchanged; 1 row 3.63 -> 3.73 with 16 warps, hence the rule.
_ELEMS_PER_THREAD = 8
_LONG_CHUNK_ELEMS_PER_THREAD = 4
_LONG_CHUNK_BLOCKS = 8
_MAX_WARPS = 16
# The logits are read once: "evict_first" keeps them from pushing out of L2 what the step reads next.
_EVICT = "evict_first"
_MIN_CHUNK = 4096  # shorter chunks would cost more in per-program setup and partials than they spread
_PROGRAMS_PER_SM = 4  # all resident at once (4 x 16 warps: the 64 an SM holds): one even wave
MAX_CHUNKS = 1024  # the combine kernel reduces a row's partials in one tile
_INTERPRETER_SMS = 2  # CPU (TRITON_INTERPRET=1): few programs, as tests force their own chunks
_MAX_VOCAB = 1 << 30  # indices and chunk offsets stay well inside int32
_NO_INDEX = 2147483647  # "none" for the index minima: larger than every real index
_COUNTER_CAPACITY = 1 << 14  # rows of the per-device arrival counters (module docstring)
_COUNTERS: dict[torch.device, torch.Tensor] = {}


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """How a row is split: `num_chunks` chunks of `chunk` elements (a multiple of `block`)."""

    block: int
    chunk: int
    num_chunks: int


def chunk_plan(num_rows: int, vocab_size: int, num_sms: int, *, block: int | None = None,
               num_chunks: int | None = None, one_wave: bool = False) -> ChunkPlan:
    """The split of the partial kernel's grid: (R, num_chunks) programs over [R, V].

    Default: enough chunks that R x C reaches `_PROGRAMS_PER_SM` per SM, each chunk at
    least `_MIN_CHUNK` elements; with `one_wave`, the most chunks for which R x C stays
    within that (one wave of resident programs, at least one chunk). `block` (a power of
    two >= 16) and `num_chunks` override it (tests force several chunks per row at small V).
    Chunks are whole blocks and none is empty, so C may come out smaller than asked.
    """
    if block is None:
        block = min(_BLOCK, max(16, 1 << (vocab_size - 1).bit_length()))
    elif block < 16 or block & (block - 1):
        raise ValueError(f"block={block} must be a power of two >= 16")
    num_blocks = -(-vocab_size // block)
    if num_chunks is None:
        resident = _PROGRAMS_PER_SM * num_sms
        wanted = max(1, resident // max(num_rows, 1)) if one_wave else -(-resident // max(num_rows, 1))
        num_chunks = min(wanted, vocab_size // _MIN_CHUNK)
    num_chunks = max(1, min(num_chunks, num_blocks, MAX_CHUNKS))
    chunk_blocks = -(-num_blocks // num_chunks)
    return ChunkPlan(block, chunk_blocks * block, -(-num_blocks // chunk_blocks))


def partial_num_warps(plan: ChunkPlan) -> int:
    """Warps of the partial kernel for `plan`: 16 for long chunks, 8 for short ones (`_ELEMS_PER_THREAD` says
    why), fewer for blocks too small to give each thread its elements."""
    long_chunk = plan.chunk // plan.block >= _LONG_CHUNK_BLOCKS
    elems = _LONG_CHUNK_ELEMS_PER_THREAD if long_chunk else _ELEMS_PER_THREAD
    return max(1, min(_MAX_WARPS, plan.block // (32 * elems)))


if HAS_TRITON:
    import triton
    import triton.language as tl

    _NEG_INF = tl.constexpr(float("-inf"))
    _NONE = tl.constexpr(_NO_INDEX)

    @triton.jit
    def _update(s, v, peak, arg, first_nan):
        # One block of the running state. NaN fails `s > peak`, so it never enters the
        # max; it only lowers first_nan. Strict > keeps a lane's first index of a tie.
        better = s > peak
        peak = tl.where(better, s, peak)
        arg = tl.where(better, v, arg)
        first_nan = tl.minimum(first_nan, tl.where(s != s, v, _NONE))
        return peak, arg, first_nan

    @triton.jit
    def _combine_row(max_ptr, idx_ptr, nan_ptr, out_ptr, row, num_chunks, C_PAD: tl.constexpr,
                     CACHE: tl.constexpr):
        # out[row]: the first NaN of the row if any, else the first index of its max (chunks hold
        # increasing index ranges, so the smallest index is the first chunk's). CACHE: the partials'
        # load cache modifier (".cg", past L1, when other programs of the same launch wrote them).
        j = tl.arange(0, C_PAD)
        on = j < num_chunks
        at = row * num_chunks + j
        part_max = tl.load(max_ptr + at, mask=on, other=_NEG_INF, cache_modifier=CACHE)
        part_idx = tl.load(idx_ptr + at, mask=on, other=_NONE, cache_modifier=CACHE)  # padding never wins a tie
        first_nan = tl.min(tl.load(nan_ptr + at, mask=on, other=_NONE, cache_modifier=CACHE), 0)
        first_max = tl.min(tl.where(part_max == tl.max(part_max, 0), part_idx, _NONE), 0)
        tok = tl.where(first_nan < _NONE, first_nan, first_max)
        tl.store(out_ptr + row, tok.to(out_ptr.dtype.element_ty))

    @triton.jit(do_not_specialize=["vocab_size", "chunk_blocks"])
    def _partial_kernel(x_ptr, x_stride, max_ptr, idx_ptr, nan_ptr, vocab_size, chunk_blocks, out_ptr, cnt_ptr,
                        BLOCK: tl.constexpr, C_PAD: tl.constexpr, ONE_CHUNK: tl.constexpr,
                        COMBINE_LAST: tl.constexpr, EVICT: tl.constexpr):
        # Program (row, part) over x[row, lo:hi]: its max, that max's first index, the first NaN index.
        row, part = tl.program_id(0), tl.program_id(1)
        base = x_ptr + row.to(tl.int64) * x_stride
        offs = tl.arange(0, BLOCK)
        # lo is a multiple of BLOCK by construction (chunk_blocks x BLOCK), so the compiler
        # knows every unmasked load below is aligned and vectorizes it.
        lo = part * chunk_blocks * BLOCK
        hi = tl.minimum(lo + chunk_blocks * BLOCK, vocab_size)
        full = lo + (hi - lo) // BLOCK * BLOCK
        peak = tl.full([BLOCK], _NEG_INF, tl.float32)
        arg = lo + offs  # a lane that only sees -inf keeps its first index: an all -inf chunk gives lo
        first_nan = tl.full([BLOCK], _NONE, tl.int32)
        for start in range(lo, full, BLOCK):
            v = start + offs
            peak, arg, first_nan = _update(tl.load(base + v, eviction_policy=EVICT).to(tl.float32), v, peak, arg,
                                           first_nan)
        v = full + offs  # the row's last, partial block; no lane is on in the other programs
        s = tl.load(base + v, mask=v < hi, other=_NEG_INF).to(tl.float32)
        peak, arg, first_nan = _update(s, v, peak, arg, first_nan)
        best = tl.max(peak, 0)
        best_idx = tl.min(tl.where(peak == best, arg, _NONE), 0)
        nan_idx = tl.min(first_nan, 0)
        num_chunks = tl.num_programs(1)
        if ONE_CHUNK:  # the row's token already: no partials, no combine
            tl.store(out_ptr + row, tl.where(nan_idx < _NONE, nan_idx, best_idx).to(out_ptr.dtype.element_ty))
        else:
            at = row * num_chunks + part
            tl.store(max_ptr + at, best)
            tl.store(idx_ptr + at, best_idx)
            tl.store(nan_ptr + at, nan_idx)
        if COMBINE_LAST:
            # The barrier puts every thread's partial stores before the release; the program that
            # arrives last at the row's counter sees every other chunk's (acquire) and combines.
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
            if arrived == num_chunks - 1:
                _combine_row(max_ptr, idx_ptr, nan_ptr, out_ptr, row, num_chunks, C_PAD, ".cg")
                tl.store(cnt_ptr + row, 0)  # no other program touches it again in this launch

    @triton.jit(do_not_specialize=["num_chunks"])
    def _combine_kernel(max_ptr, idx_ptr, nan_ptr, out_ptr, num_chunks, C_PAD: tl.constexpr):
        _combine_row(max_ptr, idx_ptr, nan_ptr, out_ptr, tl.program_id(0), num_chunks, C_PAD, "")


def _triton_fits(x: torch.Tensor) -> bool:
    """Whether the kernels take `x` as it is (else torch.argmax does, with the same result)."""
    return (x.dim() == 2 and x.dtype in _DTYPES and x.stride(-1) == 1 and 0 < x.shape[1] < _MAX_VOCAB)


def argmax_rows_triton(
    x: torch.Tensor,  # [R, V] float32 | bfloat16 | float16, unit stride in V; R may be 0
    *,
    out: torch.Tensor | None = None,  # [R] int32 | int64, contiguous; None: a new int64 tensor
    block: int | None = None,
    num_chunks: int | None = None,
) -> torch.Tensor:  # [R]: torch.argmax(x, dim=-1) (module docstring for NaN and ties)
    """The two kernels of the module docstring; `block` and `num_chunks` override the plan (tests)."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not importable; use argmax_rows, which falls back to torch")
    if not _triton_fits(x):
        raise ValueError(f"x has shape {tuple(x.shape)}, dtype {x.dtype}, strides {x.stride()}: expected [R, V] "
                         f"with 0 < V < {_MAX_VOCAB}, unit stride in V, dtype in {_DTYPES}")
    num_rows, vocab_size = x.shape
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    check_tensor("out", out, (num_rows,), _OUT_DTYPES)
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous (strides {out.stride()})")
    if num_rows == 0:
        return out
    plan = chunk_plan(num_rows, vocab_size, sm_count(x.device, cpu=_INTERPRETER_SMS), block=block,
                      num_chunks=num_chunks, one_wave=True)
    # Scratch [R, C], fully written by the partial kernel: empty, no memset in the graph.
    part_max = torch.empty(num_rows, plan.num_chunks, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(num_rows, plan.num_chunks, dtype=torch.int32, device=x.device)
    part_nan = torch.empty(num_rows, plan.num_chunks, dtype=torch.int32, device=x.device)
    num_warps = partial_num_warps(plan)
    one_chunk = plan.num_chunks == 1
    counters = None if one_chunk else _arrival_counters(x.device, num_rows)
    _partial_kernel[(num_rows, plan.num_chunks)](
        x, x.stride(0), part_max, part_idx, part_nan, vocab_size, plan.chunk // plan.block, out,
        part_idx if counters is None else counters,  # unused by the kernel without COMBINE_LAST
        BLOCK=plan.block, C_PAD=_c_pad(plan.num_chunks), ONE_CHUNK=one_chunk, COMBINE_LAST=counters is not None,
        EVICT=_EVICT, num_warps=num_warps)
    if counters is None and not one_chunk:
        combine_partials(part_max, part_idx, part_nan, out)
    return out


def _c_pad(num_chunks: int) -> int:
    return triton.next_power_of_2(max(num_chunks, 16))


def _arrival_counters(device: torch.device, num_rows: int) -> torch.Tensor | None:
    """The device's zeroed per-row arrival counters for a launch of `num_rows` rows, or None: the
    combine kernel finishes instead (more rows than the buffer holds, or a first use inside a
    graph capture, where the zeroing would only happen at replay)."""
    if num_rows > _COUNTER_CAPACITY:
        return None
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _COUNTERS[device] = torch.zeros(_COUNTER_CAPACITY, dtype=torch.int32, device=device)
    return counters


def combine_partials(part_max: torch.Tensor, part_idx: torch.Tensor, part_nan: torch.Tensor,
                     out: torch.Tensor) -> torch.Tensor:
    """out [R] from a row's C partials (each [R, C], C <= MAX_CHUNKS; max fp32, first index of
    it and first NaN index int32, chunks in increasing index order): the combine kernel."""
    num_rows, num_chunks = part_max.shape
    _combine_kernel[(num_rows,)](part_max, part_idx, part_nan, out, num_chunks, C_PAD=_c_pad(num_chunks),
                                 num_warps=1)
    return out


def argmax_rows(
    x: torch.Tensor,  # [R, V] logits
    *,
    out: torch.Tensor | None = None,  # [R] int32 | int64, written in place; None: a new int64 tensor
) -> torch.Tensor:  # [R]: exactly torch.argmax(x, dim=-1)
    """Greedy tokens: the Triton kernels for CUDA logits (when triton imports), else torch.argmax.

    Both give the same indices (module docstring); other inputs the kernels do not take
    (float64, a strided last dim) also go to torch.argmax. Graph-safe either way.
    """
    if out is not None:
        check_tensor("out", out, (x.shape[0],), _OUT_DTYPES)
    if use_triton(x) and _triton_fits(x):
        if out is None or out.is_contiguous():
            return argmax_rows_triton(x, out=out)
        got = argmax_rows_triton(x)
    else:
        got = x.argmax(dim=-1)
    if out is None:
        return got
    return out.copy_(got)
