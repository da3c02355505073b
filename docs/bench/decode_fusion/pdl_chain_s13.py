"""Does programmatic dependent launch (PDL) survive CUDA-graph capture and cut per-node cost?

A qwen2.5-0.5b-shaped batch-1 layer chain (4 GEMVs + 4 one-program elementwise kernels) x 24
layers, plain vs PDL vs PDL with the first weight tile read before the wait; every variant is
checked bit-equal to the plain chain, eagerly and replayed from a graph (python3 pdl_chain_s13.py).
"""

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph


@triton.jit
def gemv(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GDC: tl.constexpr,
         PREFETCH: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    ks0 = tl.arange(0, BLOCK_K)
    if PREFETCH:  # the weights do not depend on the previous kernel: read the first tile before waiting
        w0 = tl.load(w_rows + ks0[None, :], mask=ok[:, None] & (ks0[None, :] < K), other=0.0)
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + ks0
        x = tl.load(x_ptr + ks, mask=ks < K, other=0.0)
        if PREFETCH and k0 == 0:
            w = w0
        else:
            w = tl.load(w_rows + ks[None, :], mask=ok[:, None] & (ks[None, :] < K), other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def small(x_ptr, y_ptr, N, BLOCK: tl.constexpr, GDC: tl.constexpr):
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    o = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + o, mask=o < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + o, (v * 0.03125).to(y_ptr.dtype.element_ty), mask=o < N)


HIDDEN, INTER, LAYERS = 896, 4864, 24
SHAPES = [(1152, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]


class Chain:
    def __init__(self, dev: str, dt: torch.dtype) -> None:
        self.ws = [[torch.randn(n, k, device=dev, dtype=dt) * 0.05 for n, k in SHAPES] for _ in range(LAYERS)]
        self.x0 = torch.randn(HIDDEN, device=dev, dtype=dt)
        self.bufs = {n: torch.empty(n, device=dev, dtype=dt) for n in (1152, HIDDEN, 2 * INTER, INTER)}
        self.xa = torch.empty(HIDDEN, device=dev, dtype=dt)
        self.xb = torch.empty(INTER, device=dev, dtype=dt)

    def step(self, gdc: bool, prefetch: bool, smalls: bool = True) -> torch.Tensor:
        kw = {"launch_pdl": True} if gdc else {}
        x = self.x0
        for layer in range(LAYERS):
            for j, (n, k) in enumerate(SHAPES):
                bn, bk = (1, 2048) if k >= 4096 else (2, 1024)
                y = self.bufs[n]
                gemv[(triton.cdiv(n, bn),)](x, self.ws[layer][j], y, n, k, BLOCK_N=bn, BLOCK_K=bk, GDC=gdc,
                                            PREFETCH=prefetch, num_warps=8 if k > 4096 else 4, **kw)
                nxt = SHAPES[(j + 1) % 4][1]
                dst = self.xa if nxt == HIDDEN else self.xb
                if smalls:
                    small[(1,)](y, dst, min(n, nxt), BLOCK=triton.next_power_of_2(nxt), GDC=gdc, num_warps=4, **kw)
                x = dst
        return x.clone()


def main() -> None:
    torch.manual_seed(0)
    chain = Chain("cuda", torch.bfloat16)
    ref = chain.step(False, False)
    variants = {"plain": (False, False, True), "pdl": (True, False, True), "pdl+prefetch": (True, True, True),
                "plain gemv-only": (False, False, False), "pdl+prefetch gemv-only": (True, True, False)}
    for name, (gdc, prefetch, smalls) in variants.items():
        out = chain.step(gdc, prefetch, smalls)
        same = bool(torch.equal(out, ref)) if smalls else "n/a"
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            graph_out = chain.step(gdc, prefetch, smalls)
        graph.replay()
        torch.cuda.synchronize()
        graph_same = bool(torch.equal(graph_out, ref)) if smalls else "n/a"
        t = do_bench_cudagraph(lambda g=gdc, p=prefetch, s=smalls: chain.step(g, p, s), rep=300) * 1000
        print(f"{name:24s} {t:8.1f} us per 24-layer chain ({t / LAYERS:.2f} per layer)  eager==ref {same}  "
              f"graph==ref {graph_same}", flush=True)


if __name__ == "__main__":
    main()
