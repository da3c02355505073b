"""Greedy LM head: pointer loads vs tensor descriptors (per tile, persistent) at decode batch sizes.

Written in session 20 for session 21 (no device time was left). At 256 rows of qwen2.5-0.5b the greedy head
(`sample/greedy_head.py`: the LM head GEMM with the argmax in its epilogue) takes 143 µs on an H200 and 150-154
on an H100, about 465-490 TFLOPS for 70 GFLOP. For each of --rows this times `greedy_head_triton` with every
`loads` of `greedy_head.LOADS` over the plan and a few tiles near it, each as a CUDA graph of 10 back-to-back calls (the
combine kernel included), next to cuBLAS's bf16 GEMM into fp32 logits + torch.argmax, and checks each pick
against torch.argmax of the fp32 product (near-ties may differ: the sums' order differs).

    python3 docs/bench/decode_fusion/greedy_head_loads_s21.py --rows 256,64
"""

from __future__ import annotations

import argparse
import itertools

import torch

from graphrunner.layers.embedding import lm_logits
from graphrunner.sample.greedy_head import LOADS, greedy_head_plan, greedy_head_triton
from graphrunner_tools.bench.gemv_bench import graph_time_us

# (BM, BN, BK, warps, stages) per row count: the plan's neighbours (128 x 256 x 128 overflows shared memory)
TILES = {256: [(128, 256, 64, 8, 4), (128, 256, 64, 4, 3), (128, 256, 64, 4, 4), (64, 256, 64, 4, 4),
               (64, 256, 128, 4, 3)],
         64: [(64, 256, 64, 8, 4), (64, 256, 64, 4, 4), (64, 256, 64, 4, 5), (64, 256, 128, 4, 3)]}


def sweep(rows: int, hidden: int, vocab: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    want = (x.float() @ w.float().T).argmax(-1)
    out = torch.empty(rows, dtype=torch.int64, device="cuda")
    flops = 2 * rows * hidden * vocab
    cublas = graph_time_us(lambda _: torch.argmax(lm_logits(x, w), dim=-1), 10, 10)
    plan = greedy_head_plan(rows, hidden, x.device)
    print(f"rows {rows}: cuBLAS logits + argmax {cublas:.1f} us; plan {plan}", flush=True)
    results = []
    for loads, tiles in itertools.product(LOADS, dict.fromkeys([plan, *TILES.get(rows, [])])):
        try:
            greedy_head_triton(x, w, out, tiles=tiles, loads=loads)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a tile shape the compiler or shared memory rejects
            print(f"  {loads} {tiles}: skipped ({type(e).__name__})", flush=True)
            continue
        agree = (out == want).float().mean().item()
        us = graph_time_us(lambda _, t=tiles, ld=loads: greedy_head_triton(x, w, out, tiles=t, loads=ld), 10, 10)
        results.append((us, loads, tiles, agree))
        if tiles == plan:
            print(f"  {loads:14s} plan {us:7.1f} us ({flops / us / 1e6:.0f} TFLOPS) agree {agree:.3f}", flush=True)
    for us, loads, tiles, agree in sorted(results)[:10]:
        print(f"  {us:7.1f} us ({flops / us / 1e6:.0f} TFLOPS) {loads:14s} {tiles} agree {agree:.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="256,64")
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--vocab", type=int, default=151936)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            sweep(rows, args.hidden, args.vocab)


if __name__ == "__main__":
    main()
