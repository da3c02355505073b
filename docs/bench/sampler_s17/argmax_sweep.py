"""Greedy argmax over [R, V] fp32 logits: launch-parameter sweep of sample/argmax.py's two kernels.

For R in --rows at V = 151,936, times the partial + combine pair captured 20 times in one CUDA
graph (logits cycled over 3 copies so that L2 holds none of them) for every (block, num_warps,
num_chunks) of a grid, next to the default plan and the read floor (R x V x 4 bytes at the
measured copy bandwidth). Run from the repository root with tools/device_env.sh sourced.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from graphrunner.sample import argmax
from graphrunner_tools.bench.gemv_bench import graph_time_us
from graphrunner_tools.bench.roofline import measure_copy_bandwidth


def launch(x, out, scratch, block, warps, chunks):
    rows, vocab = x.shape
    plan = argmax.chunk_plan(rows, vocab, 132, block=block, num_chunks=chunks)
    pm, pi, pn = (t[: rows * plan.num_chunks] for t in scratch)
    c_pad = triton.next_power_of_2(max(plan.num_chunks, 16))
    argmax._partial_kernel[(rows, plan.num_chunks)](x, x.stride(0), pm, pi, pn, vocab, plan.chunk // plan.block, out,
                                                   pi, BLOCK=plan.block, C_PAD=c_pad, ONE_CHUNK=False,
                                                   COMBINE_LAST=False, EVICT="", num_warps=warps)
    argmax._combine_kernel[(rows,)](pm, pi, pn, out, plan.num_chunks, C_PAD=c_pad, num_warps=1)
    return plan


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="256,64")
    p.add_argument("--vocab", type=int, default=151936)
    args = p.parse_args()
    bw = measure_copy_bandwidth(torch.device("cuda"), 1 << 30).bytes_per_s
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s")
    for rows in (int(r) for r in args.rows.split(",")):
        sweep(rows, args.vocab, bw)


def sweep(rows: int, vocab: int, bw: float) -> None:
    xs = [torch.randn(rows, vocab, device="cuda") for _ in range(3)]
    want = torch.argmax(xs[0], -1)
    out = torch.empty(rows, dtype=torch.int64, device="cuda")
    scratch = [torch.empty(rows * 1024, dtype=d, device="cuda") for d in (torch.float32, torch.int32, torch.int32)]
    floor = rows * vocab * 4 / bw * 1e6
    us = graph_time_us(lambda i: argmax.argmax_rows_triton(xs[i % 3], out=out), 20, 10)
    print(f"R={rows}: floor {floor:.1f} us; default plan {us:.1f} us ({floor / us:.0%})")
    results = []
    for block, warps, chunks in itertools.product((2048, 4096, 8192), (4, 8, 16), (2, 3, 4, 6, 8, 12)):
        if block // (32 * warps) < 4:
            continue
        plan = launch(xs[0], out, scratch, block, warps, chunks)
        assert torch.equal(out, want), (block, warps, chunks)
        us = graph_time_us(lambda i, b=block, w=warps, c=chunks: launch(xs[i % 3], out, scratch, b, w, c), 20, 10)
        results.append((us, block, warps, plan.num_chunks))
    for us, block, warps, chunks in sorted(results)[:8]:
        print(f"  {us:6.1f} us ({floor / us:.0%})  block {block} warps {warps} chunks {chunks}")

if __name__ == "__main__":
    main()
