"""Written in session 18 for the next device call (not yet run): issue #17's qwen2.5-0.5b batch 1 on an H200.

llama-3.1-8b's one-row GEMVs ran 10-19% faster on an H200 with 4-8 rows per program (gemv_tune_8b_s18_h200.txt)
and `gemv_plan(..., wide_memory=True)` now takes those for its shapes. This sweeps the same configurations on
the qwen2.5-0.5b and llama-3.2-1b one-row kernels as the model runs them (plain GEMV: o and the LM head; norm
GEMV: q|k|v and gate|up; SwiGLU GEMV: qwen's down; plain GEMV after SiLU·mul: llama-3.2-1b's down), then
writes a copy of layers/decode_linear.py and layers/norm_linear.py at $TUNED whose plans return each shape's
winner (on any device: the copy is a throwaway tree for an in-model A/B on an H200, gemv_tune_small_s19.sh).
"""
import itertools
import os
import re

import torch

from graphrunner.layers.decode_linear import gemv_plan, gemv_triton
from graphrunner.layers.norm_linear import norm_gemv_plan, norm_gemv_triton
from graphrunner_tools.bench.gemv_bench import graph_time_us

CALLS, REPLAYS = 40, 15
PLAIN = {"qwen o": (896, 896), "qwen lm_head": (151936, 896), "1b o": (2048, 2048), "1b lm_head": (128256, 2048),
         "1b down": (2048, 8192)}
NORM = {"qwen qkv": (1152, 896), "qwen gate_up": (9728, 896), "1b qkv": (3072, 2048), "1b gate_up": (16384, 2048)}
SWIGLU = {"qwen down": (896, 4864)}
CONFIGS = [c for c in itertools.product((1, 2, 4, 8, 16), (512, 1024, 2048), (4, 8)) if 1024 <= c[0] * c[1] <= 16384]


def sweep(name: str, n: int, k: int, kind: str, l2: int) -> tuple[int, int, int]:
    copies = max(1, -(-3 * l2 // (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, 2 * k if kind == "swiglu" else k, device="cuda", dtype=torch.bfloat16)
    r, nw = torch.randn(1, k, device="cuda", dtype=torch.bfloat16), torch.rand(k, device="cuda", dtype=torch.bfloat16)

    def call(block):
        if kind == "norm":
            return lambda i: norm_gemv_triton(x, r, nw, 1e-6, ws[i % copies], block=block)
        return lambda i: gemv_triton(x, ws[i % copies], block=block, swiglu=kind == "swiglu")

    plan = norm_gemv_plan(n, k) if kind == "norm" else gemv_plan(n, k, True)
    res = sorted((graph_time_us(call(b), CALLS, REPLAYS), b) for b in set(CONFIGS) | {plan} if b[1] <= 2 * k)
    cur = next(us for us, b in res if b == plan)
    print(f"{name:13s} {kind:6s} N={n} K={k} plan {plan} {cur:.2f} us; best "
          + ", ".join(f"{b} {us:.2f}" for us, b in res[:3]), flush=True)
    return res[0][1]


def patch(path: str, func: str, table: dict) -> None:
    """Make `func` in the copy at $TUNED return table[(N, K)] first (the copy is a throwaway A/B tree)."""
    src = open(path).read()
    hook = f"    _tuned = {table!r}.get((N, K))\n    if _tuned is not None:\n        return _tuned\n"
    new = re.sub(rf'(def {func}\(N: int, K: int[^)]*\) -> tuple\[int, int, int\]:\n    """.*?"""\n)',
                 lambda m: m.group(1) + hook, src, count=1, flags=re.S)
    assert new != src, f"{func} not found in {path}"
    open(os.path.join(os.environ["TUNED"], path), "w").write(new)


def main() -> None:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(torch.cuda.get_device_name(), flush=True)
    plain = {s: sweep(name, *s, "plain", l2) for name, s in PLAIN.items()}
    plain |= {s: sweep(name, *s, "swiglu", l2) for name, s in SWIGLU.items()}
    norm = {s: sweep(name, *s, "norm", l2) for name, s in NORM.items()}
    patch("graphrunner/layers/decode_linear.py", "gemv_plan", plain)
    patch("graphrunner/layers/norm_linear.py", "norm_gemv_plan", norm)
    print("tuned plans written:", plain, norm, flush=True)


if __name__ == "__main__":
    main()
