"""Written in session 18 for the next device call (not yet run): the one-row GEMV configs on qwen2.5-0.5b and llama-3.2-1b shapes, H200 class."""
import itertools
import torch
from graphrunner.layers.decode_linear import gemv_plan, gemv_triton
from graphrunner_tools.bench.gemv_bench import graph_time_us
SHAPES = {"1b down": (2048, 8192), "qwen down": (896, 4864), "1b lm_head": (128256, 2048),
          "1b gate_up": (16384, 2048), "1b qkv": (3072, 2048), "qwen gate_up": (9728, 896)}
CONFIGS = list(itertools.product((1, 2, 4, 8), (1024, 2048), (4, 8)))
l2 = torch.cuda.get_device_properties(0).L2_cache_size
print(torch.cuda.get_device_name(), flush=True)
for name, (n, k) in SHAPES.items():
    copies = max(1, -(-3 * l2 // (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    plan = gemv_plan(n, k)
    res = sorted((graph_time_us(lambda i, b=b: gemv_triton(x, ws[i % copies], block=b), 40, 15), b)
                 for b in set(CONFIGS) | {plan})
    cur = next(us for us, b in res if b == plan)
    print(f"{name:12s} N={n} K={k} plan {plan} {cur:.2f} us; best " + ", ".join(f"{b} {us:.2f}" for us, b in res[:4])
          + f"; (4, 2048, 8) {next(us for us, b in res if b == (4, 2048, 8)):.2f}", flush=True)
