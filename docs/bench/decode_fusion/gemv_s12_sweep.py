"""Session 12 experiment (#17 item 5): a row-blocked M=1 GEMV (many programs, full K each, no split-K)
against cuBLAS F.linear on the decode projections; weights cycled over > L2; CUDA-graph timing."""
import itertools, statistics, sys
import torch, torch.nn.functional as F
import triton, triton.language as tl

@triton.jit
def gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_ptr + ks)
            w = tl.load(w_rows + ks[None, :], mask=ok[:, None], other=0.0)
        else:
            x = tl.load(x_ptr + ks, mask=ks < K, other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=ok[:, None] & (ks[None, :] < K), other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=ok)

def gemv(x, w, y, bn, bk, warps):
    N, K = w.shape
    gemv_kernel[(triton.cdiv(N, bn),)](x, w, y, N, K, w.stride(0), BLOCK_N=bn, BLOCK_K=bk, EVEN_K=K % bk == 0, num_warps=warps)

def graph_us(fn, calls=40, replays=15):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3): fn(i)
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls): fn(i)
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1000 / calls)
    return statistics.median(ts)

SHAPES = {"8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate_up": (28672, 4096), "8b down": (4096, 14336),
          "1b qkv": (3072, 2048), "1b o": (2048, 2048), "1b gate_up": (16384, 2048), "1b down": (2048, 8192),
          "qwen qkv": (1152, 896), "qwen gate_up": (9728, 896), "qwen down": (896, 4864), "8b lm_head": (128256, 4096)}
CONFIGS = [(bn, bk, w) for bn, bk, w in itertools.product((1, 2, 4, 8), (256, 512, 1024, 2048), (2, 4, 8)) if bn * bk <= 8192 and bn * bk >= 512]
dev = "cuda"; dt = torch.bfloat16
l2 = torch.cuda.get_device_properties(0).L2_cache_size
print(torch.cuda.get_device_name(), "configs", len(CONFIGS))
for name, (N, K) in SHAPES.items():
    copies = max(1, -(-3 * l2 // (N * K * 2)))
    ws = [torch.randn(N, K, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
    x = torch.randn(1, K, device=dev, dtype=dt)
    y = torch.empty(1, N, device=dev, dtype=dt)
    ref = F.linear(x, ws[0]).float()
    cub = graph_us(lambda i: torch.mm(x, ws[i % copies].t(), out=y))
    best = None
    for bn, bk, warps in CONFIGS:
        if bk > triton.next_power_of_2(K) : continue
        try:
            gemv(x, ws[0], y, bn, bk, warps); torch.cuda.synchronize()
            err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
            us = graph_us(lambda i: gemv(x, ws[i % copies], y, bn, bk, warps))
        except Exception as e:  # noqa
            print(name, (bn, bk, warps), "failed", type(e).__name__); continue
        if best is None or us < best[0]: best = (us, (bn, bk, warps), err)
    floor = N * K * 2 / 3.0e12 * 1e6
    print(f"{name:14s} N={N:6d} K={K:5d} cuBLAS {cub:7.2f} us  best triton {best[0]:7.2f} us {best[1]} relerr {best[2]:.1e}  ratio {cub/best[0]:.3f}  floor@3TB/s {floor:6.2f}", flush=True)
