"""Greedy LM head sweep at decode batch sizes: tiles, and (session 20) the loads of `greedy_head.LOADS`.

At 256 rows of qwen2.5-0.5b on an H200 the greedy head (LM head GEMM with the argmax in its epilogue,
`sample/greedy_head.py`) took 143 µs a step (kernels_mlp_s18_h200.md): 256 x 896 x 151,936 is 70 GFLOP,
about 490 TFLOPS, while its weights read in 64 µs. This times `greedy_head_triton` as a CUDA graph of
back-to-back calls (the combine kernel included) for each of --loads over a tile grid (the full grid, or
with --near the plan and a few tiles next to it), next to cuBLAS's bf16 GEMM into fp32 logits +
torch.argmax, and checks each pick against torch.argmax of the fp32 product (near-ties may differ).

    python docs/bench/decode_fusion/greedy_head_sweep_s20.py --rows 256,64                 # session 20 (H100)
    python docs/bench/decode_fusion/greedy_head_sweep_s20.py --rows 256,64 --near --loads pointer,tma,tma_persistent
"""

from __future__ import annotations

import argparse
import itertools

import torch

from graphrunner.layers.embedding import lm_logits
from graphrunner.sample.greedy_head import greedy_head_plan, greedy_head_triton
from graphrunner_tools.bench.gemv_bench import graph_time_us

GRID = [t for t in itertools.product((64, 128), (128, 256), (64, 128), (4, 8), (3, 4, 5))
        if not (t[0] == 128 and t[1] == 256 and t[2] == 128)]  # 128 x 256 x 128 tiles overflow shared memory
# --near: (BM, BN, BK, warps, stages) next to the plan, per row count
# (256 rows at 256 x 256: one M tile, W read once; at 8 warps its fp32 accumulator spills, at 16 ptxas refuses it)
NEAR = {256: [(128, 256, 64, 8, 4), (128, 256, 64, 4, 3), (128, 256, 64, 4, 4), (64, 256, 64, 4, 4),
              (64, 256, 128, 4, 3), (256, 256, 64, 8, 3)],
        64: [(64, 256, 64, 8, 4), (64, 256, 64, 4, 4), (64, 256, 64, 4, 5), (64, 256, 128, 4, 3)]}


def sweep(rows: int, hidden: int, vocab: int, loads_list: list[str], near: bool) -> None:
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
    for loads, tiles in itertools.product(loads_list, dict.fromkeys([plan, *(NEAR.get(rows, []) if near else GRID)])):
        try:
            greedy_head_triton(x, w, out, tiles=tiles, loads=loads)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a tile shape the compiler or shared memory rejects
            print(f"  {loads} {tiles}: skipped ({type(e).__name__})", flush=True)
            continue
        agree = (out == want).float().mean().item()  # fp32 sums in another order: near-ties may differ
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
    ap.add_argument("--loads", default="pointer", help="comma list of greedy_head.LOADS")
    ap.add_argument("--near", action="store_true", help="the plan and a few tiles next to it, not the full grid")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            sweep(rows, args.hidden, args.vocab, args.loads.split(","), args.near)


if __name__ == "__main__":
    main()
