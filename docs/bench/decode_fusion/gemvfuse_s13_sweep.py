"""Session 13 sweep behind layers/decode_fused.py (#17): the M = 1 GEMV with its prologue folded in
(residual add + RMSNorm before q|k|v and gate|up; SwiGLU's silu * up before down) against the two
launches it replaces (add+norm kernel or act kernel, then the plain GEMV). bf16, weights cycled over
> 3x L2, CUDA-graph medians (µs per call). Run on the device from the repository root:

    source tools/device_env.sh; python3 docs/bench/decode_fusion/gemvfuse_s13_sweep.py > gemvfuse_s13_h100.txt
"""

import torch

from graphrunner.layers.decode_fused import norm_gemv_triton, silu_mul, silu_mul_gemv_triton
from graphrunner.layers.decode_linear import gemv_plan, gemv_triton
from graphrunner.layers.norm import add_rms_norm_triton
from graphrunner_tools.bench.gemv_bench import graph_time_us

CALLS, REPLAYS = 40, 15
NORM = {"qwen qkv": (1152, 896), "qwen gate_up": (9728, 896), "1b qkv": (3072, 2048), "1b gate_up": (16384, 2048)}
DOWN = {"qwen down": (896, 4864), "1b down": (2048, 8192)}
CONFIGS = [(1, 1024, 4), (1, 2048, 4), (1, 2048, 8), (2, 1024, 4), (2, 2048, 4), (4, 1024, 4), (4, 512, 4),
           (8, 512, 4), (8, 1024, 8)]


def _weights(n: int, k: int, l2: int) -> list[torch.Tensor]:
    copies = max(1, -(-3 * l2 // (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]


def sweep(name: str, n: int, k: int, l2: int, down: bool) -> None:
    ws = _weights(n, k, l2)
    c = len(ws)
    x = torch.randn(1, 2 * k if down else k, device="cuda", dtype=torch.bfloat16)
    r, nw = torch.randn_like(x), torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    if down:
        base = graph_time_us(lambda i: gemv_triton(silu_mul(x), ws[i % c]), CALLS, REPLAYS)
        gemv = graph_time_us(lambda i: gemv_triton(x[:, :k], ws[i % c]), CALLS, REPLAYS)
    else:
        base = graph_time_us(lambda i: gemv_triton(add_rms_norm_triton(x, r, nw, 1e-6)[0], ws[i % c]), CALLS, REPLAYS)
        gemv = graph_time_us(lambda i: gemv_triton(x, ws[i % c]), CALLS, REPLAYS)
    print(f"{name} N={n} K={k}: unfused (2 launches) {base:.2f} us, plain GEMV alone {gemv:.2f} us, "
          f"plan {gemv_plan(n, k)}")
    for block in CONFIGS:
        if block[1] > 2 * k:
            continue
        if down:
            us = graph_time_us(lambda i, b=block: silu_mul_gemv_triton(x, ws[i % c], block=b), CALLS, REPLAYS)
        else:
            us = graph_time_us(lambda i, b=block: norm_gemv_triton(x, r, nw, 1e-6, ws[i % c], block=b), CALLS,
                               REPLAYS)
        print(f"  fused {block}: {us:.2f} us ({base / us:.2f}x the unfused pair)")


def main() -> None:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(torch.cuda.get_device_name(0))
    for name, (n, k) in NORM.items():
        sweep(name, n, k, l2, down=False)
    for name, (n, k) in DOWN.items():
        sweep(name, n, k, l2, down=True)


if __name__ == "__main__":
    main()
