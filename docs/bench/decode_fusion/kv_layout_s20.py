"""Decode attention over two physical KV-cache layouts: token-major (NHD, what kv_shape allocates) vs head-major.

The cache is [2, num_blocks, block_size, kv_heads, head_dim] (NHD): one KV head's 16 keys of a block are 16
rows of head_dim x 2 bytes spaced kv_heads x head_dim x 2 bytes apart, and the other heads' programs read
the rows in between. Head-major (HND) storage, [2, num_blocks, kv_heads, block_size, head_dim], puts each
head's block in one contiguous run. The attention kernels take the cache's strides, so HND is passed as a
permuted view with NHD's logical shape: no kernel change. Issue #17: at batch 256 of qwen2.5-0.5b an H200
reaches 71% of the KV-read floor in attention, an H100 82%.

For each head shape and batch, times the step's attention launch (rotary + KV write inside, `RopeKV`) as
20 calls in one CUDA graph, default plan, on both layouts (outputs checked equal); at batch 256 of the
first shape also a small grid of plans on both. Run from the repository root with tools/device_env.sh
sourced: python3 docs/bench/decode_fusion/kv_layout_s20.py
"""

from __future__ import annotations

import functools
import itertools

import torch

from graphrunner.attention.triton_attn import RopeKV, attention_launch_plan, paged_attention_triton
from graphrunner_tools.bench.attn_sweep import decode_batch, rope_inputs, time_graph
from graphrunner_tools.bench.roofline import measure_copy_bandwidth

SHAPES = ((14, 2, 64), (32, 8, 64), (32, 8, 128))  # qwen2.5-0.5b, llama-3.2-1b, llama-3.1-8b
CONTEXT = 1024


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values stored [2, blocks, kv_heads, block_size, dim], viewed as [2, blocks, block_size,
    kv_heads, dim]."""
    return cache.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)


def main() -> None:
    bw = measure_copy_bandwidth(torch.device("cuda"), 1 << 30).bytes_per_s
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s; context {CONTEXT}", flush=True)
    for (heads, kv_heads, dim), bs in itertools.product(SHAPES, (1, 64, 256)):
        q, nhd, md, out = decode_batch(bs, CONTEXT, heads, kv_heads, dim)
        k, v, pos, cs = rope_inputs(q, md, CONTEXT, kv_heads)
        hnd = head_major(nhd)
        floor = 2 * bs * (CONTEXT + 1) * kv_heads * dim * 2 / bw * 1e6
        rope = RopeKV(k, v, pos, cs, md.slot_mapping)
        outs = []
        for cache in (nhd, hnd):
            paged_attention_triton(q, cache, md, 0.125, out, rope_kv=rope)
            outs.append(out.clone())
        same = torch.equal(outs[0], outs[1]) and torch.equal(nhd, hnd)
        line = [f"{heads}/{kv_heads}x{dim} bs={bs:3d} floor {floor:6.1f} us  same={same}"]
        for name, cache in (("NHD", nhd), ("HND", hnd)):
            us = time_graph(functools.partial(paged_attention_triton, q, cache, md, 0.125, out, rope_kv=rope), 20)
            line.append(f"{name} {us:6.1f} us ({100 * floor / us:3.0f}%)")
        print("  ".join(line), flush=True)
        if (heads, kv_heads, dim) == SHAPES[0] and bs == 256:
            plan = attention_launch_plan(bs, bs, heads, kv_heads, dim, q.device)
            for block_n, warps, stages, splits in itertools.product((64, 128), (2, 4), (2, 3, 4), (1, 2)):
                kw = dict(block_n=block_n, num_warps=warps, num_stages=stages, num_kv_splits=splits, decode_grid=True)
                times = [time_graph(functools.partial(paged_attention_triton, q, cache, md, 0.125, out,
                                                      rope_kv=rope, **kw), 20) for cache in (nhd, hnd)]
                print(f"    {kw}: NHD {times[0]:6.1f}  HND {times[1]:6.1f} us", flush=True)
            print(f"    (plan {plan})")


if __name__ == "__main__":
    main()
