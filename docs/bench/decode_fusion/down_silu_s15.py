"""Batch-M down projection with SiLU·mul in its prologue (Triton, split-K) against the step's pair
SiLU·mul + cuBLAS, on qwen2.5-0.5b / llama-3.2-1b shapes. A measurement for issue #17 (batch 256):

    python3 docs/bench/decode_fusion/down_silu_s15.py [256 64 ...]

out[M, H] = (silu(gate) * up) @ W_down^T with gate_up = [M, 2I] (gate | up halves), W_down [H, I].
The fused kernel forms each A tile from gate and up as it loads them (rounded to bf16, as the unfused
SiLU·mul stores it), accumulates fp32 over its K slice, writes [S, M, H] fp32 partials, and a second
kernel sums the S slices in order (deterministic) into bf16. CUDA-graph medians; each call reads its
own weight copy (cycled past the L2), as the step does.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from graphrunner_tools.bench.gemv_bench import graph_time_us

SHAPES = {"qwen": (896, 4864), "llama-1b": (2048, 8192)}  # (H, I)


@triton.jit
def _down_silu_kernel(gu_ptr, gu_stride, w_ptr, part_ptr, M, H, inter, k_per_split,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    k0 = split * k_per_split
    for k in range(k0, k0 + k_per_split, BK):
        rk = k + tl.arange(0, BK)
        on = (rm[:, None] < M) & (rk[None, :] < inter)
        g = tl.load(gu_ptr + rm[:, None] * gu_stride + rk[None, :], mask=on, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + rm[:, None] * gu_stride + inter + rk[None, :], mask=on, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g)) * u).to(w_ptr.dtype.element_ty)  # [BM, BK], rounded as stored unfused
        w_on = (rn[None, :] < H) & (rk[:, None] < inter)
        w = tl.load(w_ptr + rn[None, :] * inter + rk[:, None], mask=w_on, other=0.0)  # [BK, BN]
        acc = tl.dot(a, w, acc)  # [BM, BK] x [BK, BN]
    tl.store(part_ptr + (split * M + rm[:, None]) * H + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < H))


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, n, S: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(S):
        acc += tl.load(part_ptr + s * n + o, mask=o < n, other=0.0)
    tl.store(out_ptr + o, acc.to(out_ptr.dtype.element_ty), mask=o < n)


def down_silu(gu, w, part, out, splits, bm, bn, bk, warps, stages):
    m, two_i = gu.shape
    h, i = w.shape
    k_per = -(-i // (splits * bk)) * bk
    _down_silu_kernel[(triton.cdiv(m, bm), triton.cdiv(h, bn), splits)](
        gu, gu.stride(0), w, part, m, h, i, k_per, BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    _sum_splits_kernel[(triton.cdiv(m * h, 1024),)](part, out, m * h, S=splits, BLOCK=1024, num_warps=4)
    return out


def unfused(gu, w):
    i = w.shape[1]
    return F.linear(F.silu(gu[:, :i]) * gu[:, i:], w)


def main() -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name())
    configs = [(s, bm, bn, bk, wp, st) for s in (2, 4, 8) for (bm, bn, bk, wp, st) in
               ((64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3))] + [(1, 64, 64, 64, 4, 3)]
    for m in [int(a) for a in sys.argv[1:]] or [256]:
        for name, (h, i) in SHAPES.items():
            copies = max(2, int(200e6 // (h * i * 2)))
            ws = [torch.randn(h, i, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            gu = torch.randn(m, 2 * i, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, h, device="cuda", dtype=torch.bfloat16)
            base = graph_time_us(lambda j, gu=gu, ws=ws, c=copies: unfused(gu, ws[j % c]), 20, 10)
            ref = unfused(gu, ws[0]).float()
            floor = (h * i * 2 + m * 2 * i * 2 + m * h * 2) / 3.0e12 * 1e6
            best = (float("inf"), None)
            for cfg in configs:
                part = torch.empty(cfg[0], m, h, device="cuda", dtype=torch.float32)
                try:
                    def call(j, cfg=cfg, part=part, gu=gu, ws=ws, out=out, c=copies):
                        return down_silu(gu, ws[j % c], part, out, *cfg)
                    t = graph_time_us(call, 20, 10)
                except Exception as e:  # noqa: BLE001 - a config the compiler refuses: report, go on
                    print(f"  {cfg} failed: {repr(e)[:120]}")
                    continue
                err = (down_silu(gu, ws[0], part, out, *cfg).float() - ref).abs().max().item()
                print(f"  M={m} {name} split={cfg[0]} tile={cfg[1:4]} warps={cfg[4]}: {t:.2f} us (err {err:.2e})")
                best = min(best, (t, cfg), key=lambda b: b[0])
            print(f"M={m} {name} H={h} I={i}: silu*mul + cuBLAS {base:.2f} us | fused best {best[0]:.2f} us "
                  f"{best[1]} | x{base / best[0]:.2f} | floor@3TB/s {floor:.2f} us", flush=True)


if __name__ == "__main__":
    main()
