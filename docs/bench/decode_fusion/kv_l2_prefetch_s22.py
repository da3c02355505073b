"""Does prefetching the next layer's first KV blocks into L2, beside this layer's GEMMs, shorten a decode layer?

Issue #17, qwen2.5-0.5b at batch 256, context 1024: a layer is the attention launch (134 MB of KV read, DRAM
bound) followed by ~25 µs of GEMMs and norms that leave DRAM nearly idle. The per-program timeline
(attn_timeline_s22.py) shows the launch's first ~9 µs before its first full block streams. This times a stack
of layers in one CUDA graph (attention with the rotary + KV write inside, o / gate|up / down / qkv cuBLAS GEMMs,
the add + RMSNorm and SiLU·mul Triton kernels, distinct weights and caches per layer) with and without a side
stream that, as soon as layer i's attention is done, issues `prefetch.global.L2::evict_last` over the first
P cache pages (16 keys each) of every request of layer i + 1 and joins before that layer's attention. Prints
µs per layer for each P, checks that the attention outputs are unchanged. From the repository root with
tools/device_env.sh sourced:

    python3 docs/bench/decode_fusion/kv_l2_prefetch_s22.py [--rows 256] [--layers 8]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from graphrunner.attention.base import AttentionMetadata
from graphrunner.attention.triton_attn import RopeKV, paged_attention_triton
from graphrunner.layers.norm import add_rms_norm_triton
from graphrunner.layers.swiglu import silu_mul_triton
from graphrunner_tools.bench.gemv_bench import graph_time_us

H, HKV, D, HID, INTER, BLOCK = 14, 2, 64, 896, 4864, 16


@triton.jit
def _kv_prefetch_kernel(cache_ptr, bt_ptr, stride_bt, stride_kv, stride_blk, stride_h, num_pages,
                        LINES: tl.constexpr, KV_HEADS: tl.constexpr, PAGE_LINES: tl.constexpr):
    # Program b: request b's first num_pages pages, every KV head, K and V, one 128-byte line per lane
    # (a head-major page of one head is PAGE_LINES lines).
    b = tl.program_id(0)
    i = tl.arange(0, LINES)
    line = i % PAGE_LINES
    rest = i // PAGE_LINES
    h = rest % KV_HEADS
    rest = rest // KV_HEADS
    kv = rest % 2
    page = rest // 2
    ok = page < num_pages
    blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + page, mask=ok, other=0).to(tl.int64)
    off = kv * stride_kv + blk * stride_blk + h * stride_h + line * 64  # 64 bf16 = 128 bytes
    off = tl.where(ok, off, 0)
    dummy = tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                      [cache_ptr + off], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(bt_ptr + i, dummy.to(bt_ptr.dtype.element_ty), mask=dummy != 0)  # never: keeps the asm


def kv_prefetch(cache: torch.Tensor, block_table: torch.Tensor, num_reqs: int, pages: int) -> None:
    """cache [2, blocks, block, heads, dim] viewed head-major."""
    s = cache.stride()
    page_lines = BLOCK * D * 2 // 128
    lines = triton.next_power_of_2(pages * 2 * HKV * page_lines)
    _kv_prefetch_kernel[(num_reqs,)](cache, block_table, block_table.stride(0), s[0], s[1], s[3], pages,
                                     LINES=lines, KV_HEADS=HKV, PAGE_LINES=page_lines, num_warps=4)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--pages", default="0,4,8,12,16,24")
    args = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows, ctx, nl = args.rows, args.context, args.layers
    seq = ctx + 1
    n = -(-seq // BLOCK)
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, dtype=dt, generator=g) * scale)

    caches = [rnd(2, rows * n, HKV, BLOCK, D).permute(0, 1, 3, 2, 4) for _ in range(nl + 1)]
    md = AttentionMetadata(
        query_start_loc=torch.arange(rows + 1, device=dev, dtype=torch.int32),
        seq_lens=torch.full((rows,), seq, device=dev, dtype=torch.int32),
        block_table=torch.arange(rows * n, device=dev, dtype=torch.int32).view(rows, n),
        slot_mapping=(torch.arange(rows, device=dev) * n * BLOCK + ctx),
        num_reqs=rows, num_tokens=rows, max_query_len=1, max_seq_len=seq)
    pos = torch.full((rows,), ctx, device=dev, dtype=torch.int64)
    cos_sin = torch.randn(seq, D, device=dev, dtype=torch.float32, generator=g)
    w = [{"qkv": rnd(HID + 2 * HKV * D, HID, scale=0.03), "o": rnd(HID, HID, scale=0.03),
          "gu": rnd(2 * INTER, HID, scale=0.03), "down": rnd(HID, INTER, scale=0.03),
          "n1": rnd(HID) * 0 + 1, "n2": rnd(HID) * 0 + 1} for _ in range(nl)]
    x0 = rnd(rows, HID)
    res0 = rnd(rows, HID)
    attn_outs = [torch.empty(rows, H, D, device=dev, dtype=dt) for _ in range(nl)]
    side = torch.cuda.Stream()

    def stack(pages: int) -> None:
        cur = torch.cuda.current_stream()  # the capture stream under torch.cuda.graph
        qkv = x0 @ w[0]["qkv"].T
        res = res0
        for i in range(nl):
            q = qkv[:, :H * D].view(rows, H, D)
            k = qkv[:, H * D:(H + HKV) * D].view(rows, HKV, D)
            v = qkv[:, (H + HKV) * D:].view(rows, HKV, D)
            paged_attention_triton(q, caches[i], md, 0.125, attn_outs[i], rope_kv=RopeKV(k, v, pos, cos_sin,
                                                                                           md.slot_mapping))
            if pages:
                side.wait_stream(cur)
                with torch.cuda.stream(side):
                    kv_prefetch(caches[i + 1], md.block_table, rows, pages)
            h = attn_outs[i].view(rows, H * D) @ w[i]["o"].T
            x, res = add_rms_norm_triton(h, res, w[i]["n1"], 1e-6)
            a = silu_mul_triton(x @ w[i]["gu"].T)
            x, res = add_rms_norm_triton(a @ w[i]["down"].T, res, w[i]["n2"], 1e-6)
            qkv = x @ w[(i + 1) % nl]["qkv"].T
            if pages:
                cur.wait_stream(side)

    def timed(pages: int) -> tuple[float, list[torch.Tensor]]:
        """µs per layer of the stack in one CUDA graph, and the attention outputs it left."""
        us = graph_time_us(lambda _: stack(pages), 1, 20) / nl
        return us, [o.clone() for o in attn_outs]

    print(f"{torch.cuda.get_device_name()}: {rows} rows, context {ctx}, {nl} layers of qwen2.5-0.5b shapes; "
          f"one page = {rows * 2 * HKV * BLOCK * D * 2 / 1e6:.2f} MB over all requests")
    ref = None
    for rep in range(2):
        for pages in (int(x) for x in args.pages.split(",")):
            us, outs = timed(pages)
            same = "" if ref is None else (" outputs equal" if all(torch.equal(a, b) for a, b in zip(ref, outs,
                                                                                                   strict=True))
                                           else " OUTPUTS DIFFER")
            ref = ref or outs
            print(f"  rep {rep} pages {pages:3d} ({pages * rows * 2 * HKV * BLOCK * D * 2 / 1e6:5.1f} MB): "
                  f"{us:.2f} µs per layer{same}", flush=True)


if __name__ == "__main__":
    main()
