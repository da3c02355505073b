"""Session 12 sweep behind layers/decode_linear.py (#17 item 5): a row-blocked M = 1 GEMV (many
programs, the full K each, no split-K) against cuBLAS on the decode projections. bf16, weights cycled
over > 3x L2, CUDA-graph medians (the recorded run used an inline copy of the same kernel, before it
moved into the library). Run on the device from the repository root:

    source tools/device_env.sh; python3 docs/bench/decode_fusion/gemv_s12_sweep.py > gemv_s12_h100.txt
"""

import itertools

import torch
import torch.nn.functional as F
import triton

from graphrunner.layers.decode_linear import gemv_triton
from graphrunner_tools.bench.gemv_bench import graph_time_us

CALLS, REPLAYS = 40, 15  # per timing: calls captured in one graph, replays (median)
SHAPES = {"8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate_up": (28672, 4096), "8b down": (4096, 14336),
          "1b qkv": (3072, 2048), "1b o": (2048, 2048), "1b gate_up": (16384, 2048), "1b down": (2048, 8192),
          "qwen qkv": (1152, 896), "qwen gate_up": (9728, 896), "qwen down": (896, 4864),
          "8b lm_head": (128256, 4096)}
CONFIGS = [(bn, bk, w) for bn, bk, w in itertools.product((1, 2, 4, 8), (256, 512, 1024, 2048), (2, 4, 8))
           if 512 <= bn * bk <= 8192]


def sweep_shape(name: str, n: int, k: int, l2: int) -> None:
    copies = max(1, -(-3 * l2 // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, weights[0]).float()
    cublas = graph_time_us(lambda i: torch.mm(x, weights[i % copies].t(), out=y), CALLS, REPLAYS)
    best = None
    for block in CONFIGS:
        if block[1] > triton.next_power_of_2(k):
            continue
        got = gemv_triton(x, weights[0], block=block).float()
        err = (got - ref).abs().max().item() / ref.abs().max().item()
        us = graph_time_us(lambda i, block=block: gemv_triton(x, weights[i % copies], block=block), CALLS, REPLAYS)
        if best is None or us < best[0]:
            best = (us, block, err)
    assert best is not None
    floor = n * k * 2 / 3.0e12 * 1e6
    print(f"{name:14s} N={n:6d} K={k:5d} cuBLAS {cublas:7.2f} us  best triton {best[0]:7.2f} us {best[1]} "
          f"relerr {best[2]:.1e}  ratio {cublas / best[0]:.3f}  floor@3TB/s {floor:6.2f}", flush=True)


def main() -> None:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(torch.cuda.get_device_name(), "configs", len(CONFIGS))
    for name, (n, k) in SHAPES.items():
        sweep_shape(name, n, k, l2)


if __name__ == "__main__":
    main()
