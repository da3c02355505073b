"""Greedy argmax at 256 / 64 rows x 151,936 fp32: load strategies of the partial kernel, in-graph.

Issue #16's greedy target is 40 us at 256 rows; sample/argmax.py's kernel takes 39.9-41 us per call
inside a graph on an H200 against a read floor of ~36.6 us (R x V x 4 bytes at the copy bandwidth).
Its loop issues two 16-byte loads per thread and waits for them before the next step. This sweep
times, as 20 calls in one CUDA graph over 3 cycled copies of the logits (what a FULL graph sees):

- lib:     graphrunner.sample.argmax.argmax_rows_triton (the default plan and combine);
- plain:   the library's partial kernel body at (block, warps, chunks), + the combine kernel;
- unroll2: two blocks loaded before either is reduced (twice the bytes in flight per thread);
- evict:   plain with eviction_policy="evict_first" (read-once data);
- range:   tl.range(..., num_stages=S): the compiler's software pipelining of the loads;
- tma:     a [R, V/128, 128] tensor descriptor, [1, 16, 128] boxes, pipelined with S stages
           (V must be a multiple of 128: 151,936 = 1187 x 128).

Every variant's tokens are checked against torch.argmax before it is timed. Run from the repository
root with tools/device_env.sh sourced: python3 docs/bench/sampler_s20/argmax_variants_s20.py
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from graphrunner.sample import argmax
from graphrunner_tools.bench.gemv_bench import graph_time_us
from graphrunner_tools.bench.roofline import measure_copy_bandwidth

_update = argmax._update
NEG_INF = tl.constexpr(float("-inf"))
NONE = tl.constexpr(2147483647)


@triton.jit
def _finish(peak, arg, first_nan, max_ptr, idx_ptr, nan_ptr, row, part):
    best = tl.max(peak, 0)
    at = row * tl.num_programs(1) + part
    tl.store(max_ptr + at, best)
    tl.store(idx_ptr + at, tl.min(tl.where(peak == best, arg, NONE), 0))
    tl.store(nan_ptr + at, tl.min(first_nan, 0))


@triton.jit
def _pointer_kernel(x_ptr, x_stride, max_ptr, idx_ptr, nan_ptr, vocab_size, chunk_blocks, BLOCK: tl.constexpr,
                    MODE: tl.constexpr, STAGES: tl.constexpr):
    # MODE 0 plain, 1 unroll2, 2 evict_first, 3 tl.range(num_stages=STAGES)
    row, part = tl.program_id(0), tl.program_id(1)
    base = x_ptr + row.to(tl.int64) * x_stride
    offs = tl.arange(0, BLOCK)
    lo = part * chunk_blocks * BLOCK
    hi = tl.minimum(lo + chunk_blocks * BLOCK, vocab_size)
    full = lo + (hi - lo) // BLOCK * BLOCK
    peak = tl.full([BLOCK], NEG_INF, tl.float32)
    arg = lo + offs
    first_nan = tl.full([BLOCK], NONE, tl.int32)
    if MODE == 1:
        full2 = lo + (hi - lo) // (2 * BLOCK) * (2 * BLOCK)
        for start in range(lo, full2, 2 * BLOCK):
            a = tl.load(base + start + offs)
            b = tl.load(base + start + BLOCK + offs)
            peak, arg, first_nan = _update(a.to(tl.float32), start + offs, peak, arg, first_nan)
            peak, arg, first_nan = _update(b.to(tl.float32), start + BLOCK + offs, peak, arg, first_nan)
        for start in range(full2, full, BLOCK):
            peak, arg, first_nan = _update(tl.load(base + start + offs).to(tl.float32), start + offs, peak, arg,
                                           first_nan)
    elif MODE == 2:
        for start in range(lo, full, BLOCK):
            s = tl.load(base + start + offs, eviction_policy="evict_first")
            peak, arg, first_nan = _update(s.to(tl.float32), start + offs, peak, arg, first_nan)
    elif MODE == 3:
        for start in tl.range(lo, full, BLOCK, num_stages=STAGES):
            peak, arg, first_nan = _update(tl.load(base + start + offs).to(tl.float32), start + offs, peak, arg,
                                           first_nan)
    else:
        for start in range(lo, full, BLOCK):
            peak, arg, first_nan = _update(tl.load(base + start + offs).to(tl.float32), start + offs, peak, arg,
                                           first_nan)
    v = full + offs
    s = tl.load(base + v, mask=v < hi, other=NEG_INF).to(tl.float32)
    peak, arg, first_nan = _update(s, v, peak, arg, first_nan)
    _finish(peak, arg, first_nan, max_ptr, idx_ptr, nan_ptr, row, part)


@triton.jit
def _tma_kernel(desc, max_ptr, idx_ptr, nan_ptr, chunk_tiles, num_tiles, vocab_size, TILE: tl.constexpr,
                WIDTH: tl.constexpr, STAGES: tl.constexpr):
    # x viewed as [R, V / WIDTH, WIDTH]; program (row, part) reads tiles [t0, t1) of TILE x WIDTH elements
    row, part = tl.program_id(0), tl.program_id(1)
    BLOCK: tl.constexpr = TILE * WIDTH
    offs = tl.arange(0, BLOCK)
    t0 = part * chunk_tiles
    t1 = tl.minimum(t0 + chunk_tiles, num_tiles)
    peak = tl.full([BLOCK], NEG_INF, tl.float32)
    arg = t0 * BLOCK + offs
    first_nan = tl.full([BLOCK], NONE, tl.int32)
    for t in tl.range(t0, t1, num_stages=STAGES):
        s = desc.load([row, t * TILE, 0]).reshape([BLOCK])  # rows past V / WIDTH come back as zeros
        v = t * BLOCK + offs
        s = tl.where(v < vocab_size, s, NEG_INF)
        peak, arg, first_nan = _update(s, v, peak, arg, first_nan)
    _finish(peak, arg, first_nan, max_ptr, idx_ptr, nan_ptr, row, part)


class Bench:
    def __init__(self, rows: int, vocab: int) -> None:
        self.rows, self.vocab = rows, vocab
        self.xs = [torch.randn(rows, vocab, device="cuda") for _ in range(3)]
        self.want = torch.argmax(self.xs[0], -1)
        self.out = torch.empty(rows, dtype=torch.int64, device="cuda")
        self.scratch = [torch.empty(rows * 1024, dtype=d, device="cuda")
                        for d in (torch.float32, torch.int32, torch.int32)]

    def _combine(self, chunks: int) -> None:
        pm, pi, pn = (t[: self.rows * chunks] for t in self.scratch)
        argmax._combine_kernel[(self.rows,)](pm, pi, pn, self.out, chunks,
                                             C_PAD=triton.next_power_of_2(max(chunks, 16)), num_warps=1)

    def pointer(self, i: int, block: int, warps: int, chunks: int, mode: int, stages: int) -> None:
        x = self.xs[i % 3]
        plan = argmax.chunk_plan(self.rows, self.vocab, 132, block=block, num_chunks=chunks)
        pm, pi, pn = (t[: self.rows * plan.num_chunks] for t in self.scratch)
        _pointer_kernel[(self.rows, plan.num_chunks)](x, x.stride(0), pm, pi, pn, self.vocab,
                                                      plan.chunk // plan.block, BLOCK=block, MODE=mode,
                                                      STAGES=stages, num_warps=warps)
        self._combine(plan.num_chunks)

    def tma(self, i: int, tile: int, warps: int, chunks: int, stages: int, descs: list) -> None:
        width = 128
        num_tiles = -(-self.vocab // (tile * width))
        chunk_tiles = -(-num_tiles // chunks)
        chunks = -(-num_tiles // chunk_tiles)
        pm, pi, pn = (t[: self.rows * chunks] for t in self.scratch)
        _tma_kernel[(self.rows, chunks)](descs[i % 3], pm, pi, pn, chunk_tiles, num_tiles, self.vocab, TILE=tile,
                                         WIDTH=width, STAGES=stages, num_warps=warps, num_stages=stages)
        self._combine(chunks)

    def time(self, fn) -> float | None:
        fn(0)
        if not torch.equal(self.out, self.want):
            return None
        return graph_time_us(fn, 20, 15)


def sweep(rows: int, vocab: int, bw: float, chunk_list: tuple[int, ...]) -> None:
    bench = Bench(rows, vocab)
    floor = rows * vocab * 4 / bw * 1e6
    lib = graph_time_us(lambda i: argmax.argmax_rows_triton(bench.xs[i % 3], out=bench.out), 20, 15)
    print(f"R={rows}: floor {floor:.1f} us; lib (default plan, COMBINE_LAST={argmax.COMBINE_LAST}) {lib:.1f} us "
          f"({floor / lib:.0%})", flush=True)
    results = []
    names = {0: "plain", 1: "unroll2", 2: "evict", 3: "range"}
    for (mode, stages), warps, chunks in itertools.product(
            ((0, 1), (1, 1), (2, 1), (3, 2), (3, 3), (3, 4)), (8, 16), chunk_list):
        us = bench.time(lambda i, m=mode, s=stages, w=warps, c=chunks: bench.pointer(i, 2048, w, c, m, s))
        results.append((us, f"{names[mode]} stages {stages} block 2048 warps {warps} chunks {chunks}"))
    if vocab % 128 == 0:
        for tile, stages, warps, chunks in itertools.product((8, 16), (3, 4, 6), (4, 8), chunk_list):
            descs = [TensorDescriptor.from_tensor(x.view(rows, vocab // 128, 128), [1, tile, 128])
                     for x in bench.xs]
            us = bench.time(lambda i, t=tile, s=stages, w=warps, c=chunks, d=descs: bench.tma(i, t, w, c, s, d))
            results.append((us, f"tma tile {tile}x128 stages {stages} warps {warps} chunks {chunks}"))
    bad = [name for us, name in results if us is None]
    if bad:
        print("  WRONG TOKENS: " + "; ".join(bad))
    for us, name in sorted((r for r in results if r[0] is not None), key=lambda r: r[0])[:14]:
        print(f"  {us:6.1f} us ({floor / us:.0%})  {name}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="256,64")
    p.add_argument("--vocab", type=int, default=151936)
    args = p.parse_args()
    bw = measure_copy_bandwidth(torch.device("cuda"), 1 << 30).bytes_per_s
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    for rows in (int(r) for r in args.rows.split(",")):
        sweep(rows, args.vocab, bw, (2, 4) if rows >= 128 else (6, 8))


if __name__ == "__main__":
    main()
