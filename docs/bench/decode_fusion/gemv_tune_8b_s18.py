"""Session 18 call 4: the one-row GEMV sweep (docs/bench/decode_fusion/gemv_s12_sweep.py's configs) on llama-3.1-8b's
shapes, then a copy of graphrunner/layers/decode_linear.py at $TUNED whose gemv_plan returns each shape's winner."""
import os
import re
import sys

import torch

sys.path.insert(0, "docs/bench/decode_fusion")
import gemv_s12_sweep as s  # noqa: E402

from graphrunner.layers.decode_linear import gemv_plan, gemv_triton  # noqa: E402
from graphrunner_tools.bench.gemv_bench import graph_time_us  # noqa: E402

SHAPES = {"8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate_up": (28672, 4096), "8b down": (4096, 14336),
          "8b lm_head": (128256, 4096)}
l2 = torch.cuda.get_device_properties(0).L2_cache_size
print(torch.cuda.get_device_name(), flush=True)
best = {}
for name, (n, k) in SHAPES.items():
    copies = max(1, -(-3 * l2 // (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    res = []
    for block in s.CONFIGS:
        us = graph_time_us(lambda i, b=block, x=x, ws=ws, c=copies: gemv_triton(x, ws[i % c], block=b), s.CALLS,
                           s.REPLAYS)
        res.append((us, block))
    res.sort()
    plan = gemv_plan(n, k)
    cur = next(us for us, b in res if b == plan)
    floor = n * k * 2 / 4.25e12 * 1e6
    print(f"{name:12s} N={n} K={k} plan {plan} {cur:.2f} us; best {res[0][1]} {res[0][0]:.2f}, {res[1][1]} "
          f"{res[1][0]:.2f}, {res[2][1]} {res[2][0]:.2f}; floor@4.25TB/s {floor:.2f}", flush=True)
    best[(n, k)] = res[0][1]
src = open("graphrunner/layers/decode_linear.py").read()
hook = f"    _tuned = {best!r}.get((N, K))\n    if _tuned is not None:\n        return _tuned\n"
src = re.sub(r'(def gemv_plan\(N: int, K: int\) -> tuple\[int, int, int\]:\n    """.*?"""\n)',
             lambda m: m.group(1) + hook, src, count=1, flags=re.S)
out = os.environ["TUNED"] + "/graphrunner/layers/decode_linear.py"
open(out, "w").write(src)
print("tuned plan written:", best, flush=True)
