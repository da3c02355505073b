"""bs>1 projection alternatives on qwen2.5-0.5b / llama-3.2-1b shapes: cuBLAS vs inductor max-autotune."""
import torch, torch.nn.functional as F, triton, sys
from triton.testing import do_bench_cudagraph
torch.manual_seed(0)
dev = "cuda"; dt = torch.bfloat16
shapes = {"q_qkv": (1152, 896, True), "q_o": (896, 896, False), "q_gu": (9728, 896, False), "q_down": (896, 4864, False),
          "l_qkv": (3072, 2048, False), "l_o": (2048, 2048, False), "l_gu": (16384, 2048, False), "l_down": (2048, 8192, False)}
def t(fn): return do_bench_cudagraph(fn, rep=200) * 1000
for M in [int(a) for a in sys.argv[1:]] or [256]:
    for name, (N, K, bias) in shapes.items():
        x = torch.randn(M, K, device=dev, dtype=dt); w = torch.randn(N, K, device=dev, dtype=dt) * 0.02
        b = torch.randn(N, device=dev, dtype=dt) if bias else None
        wt = w.t().contiguous()
        r = {"cublas": t(lambda: F.linear(x, w, b)), "cublas_wT": t(lambda: torch.addmm(b, x, wt) if b is not None else torch.mm(x, wt))}
        try:
            torch._dynamo.reset()
            f = torch.compile(lambda x, w, b: F.linear(x, w, b), mode="max-autotune-no-cudagraphs", dynamic=False)
            f(x, w, b); r["inductor_ma"] = t(lambda: f(x, w, b))
        except Exception as e:
            r["inductor_ma"] = float("nan"); print(name, "compile failed", repr(e)[:200])
        mb = (N * K * 2 + M * K * 2 + M * N * 2) / 1e6; gf = 2 * M * N * K / 1e9
        print(f"M={M} {name:8s} N={N} K={K} " + " ".join(f"{k}={v:.2f}us" for k, v in r.items()) + f"  bytes {mb:.1f}MB flops {gf:.2f}GF", flush=True)
    for V, H in [(151936, 896), (128256, 2048)]:
        x = torch.randn(M, H, device=dev, dtype=dt); w = torch.randn(V, H, device=dev, dtype=dt) * 0.02
        a = t(lambda: F.linear(x, w).float()); c = t(lambda: torch.mm(x, w.t(), out_dtype=torch.float32))
        err = (F.linear(x, w).float() - torch.mm(x, w.t(), out_dtype=torch.float32)).abs().max().item()
        print(f"M={M} lm_head V={V} H={H} linear+float={a:.2f}us mm_out_fp32={c:.2f}us maxdiff={err:.3g}", flush=True)
