"""Greedy LM head tile sweep at decode batch sizes (written in session 19 for the next H200 call, not yet run).

At 256 rows of qwen2.5-0.5b on an H200 the greedy head (LM head GEMM with the argmax in its epilogue,
`sample/greedy_head.py`) took 143 µs a step (kernels_mlp_s18_h200.md): 256 x 896 x 151,936 is 70 GFLOP,
about 490 TFLOPS, while its weights read in 64 µs. Only three tile shapes were ever tried (session 16,
in the model on an H100). This times `greedy_head_triton` over a grid of (BM, BN, BK, warps, stages) as
a CUDA graph of back-to-back calls, the combine kernel included, and checks each against torch.argmax
of the bf16 logits' fp32 product.

    python docs/bench/decode_fusion/greedy_head_sweep_s20.py --rows 256,64 --hidden 896 --vocab 151936
"""

from __future__ import annotations

import argparse
import itertools

import torch

from graphrunner.sample.greedy_head import greedy_head_plan, greedy_head_triton
from graphrunner_tools.bench.gemv_bench import graph_time_us

GRID = [t for t in itertools.product((64, 128), (128, 256), (64, 128), (4, 8), (3, 4, 5))
        if not (t[0] == 128 and t[1] == 256 and t[2] == 128)]  # 128 x 256 x 128 tiles overflow shared memory


def sweep(rows: int, hidden: int, vocab: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    want = (x.float() @ w.float().T).argmax(-1)
    out = torch.empty(rows, dtype=torch.int64, device="cuda")
    plan = greedy_head_plan(rows, hidden, x.device)
    results = []
    for tiles in dict.fromkeys([plan, *GRID]):
        try:
            greedy_head_triton(x, w, out, tiles=tiles)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a tile shape the compiler or shared memory rejects
            print(f"  {tiles}: skipped ({type(e).__name__})", flush=True)
            continue
        agree = (out == want).float().mean().item()  # fp32 sums in another order: near-ties may differ
        us = graph_time_us(lambda _, t=tiles: greedy_head_triton(x, w, out, tiles=t), 10, 10)
        results.append((us, tiles, agree))
    plan_us = next(us for us, t, _ in results if t == plan)
    flops = 2 * rows * hidden * vocab
    print(f"rows {rows}: plan {plan} {plan_us:.1f} us ({flops / plan_us / 1e6:.0f} TFLOPS)", flush=True)
    for us, tiles, agree in sorted(results)[:8]:
        print(f"  {us:7.1f} us ({flops / us / 1e6:.0f} TFLOPS) {tiles} agree {agree:.3f}", flush=True)


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
