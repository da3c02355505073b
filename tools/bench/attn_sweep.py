"""Decode attention launch-parameter sweep: the Triton paged attention kernel alone.

For decode batches (one query token per request, `--context` cached tokens each) of a
model's head shape, times `paged_attention_triton` with its default launch plan and with
every (block_n, num_warps, num_stages, num_kv_splits) of a small grid (`--decode-grid both`:
each with the search grid and with one program per request), each as a CUDA graph
of `--calls` back-to-back launches (what a FULL graph sees), and prints the KV-read floor
(K and V bytes at the measured copy bandwidth). Used to tune `attention_launch_plan`.

    python -m graphrunner_tools.bench.attn_sweep --heads 14,2,64 --batch-sizes 1,64,256

`--rope`: every timed call also rotates q and k and writes the new k / v, as a decode step does:
the default times the separate `rope_write_kv_triton` + the attention next to the attention
launch that does it itself (`triton_attn.RopeKV`), and the grid sweeps the latter (decode grid
only, splits up to 32).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys

import torch

from graphrunner.attention.base import AttentionMetadata
from graphrunner.attention.rope_kv import rope_write_kv_triton
from graphrunner.attention.triton_attn import RopeKV, attention_launch_plan, paged_attention_triton
from graphrunner_tools.bench.gemv_bench import graph_time_us
from graphrunner_tools.bench.roofline import measure_copy_bandwidth


def decode_batch(bs: int, context: int, heads: int, kv_heads: int, dim: int, block_size: int = 16):
    """q, a random paged cache, metadata: request b owns blocks [b * n, (b + 1) * n)."""
    seq = context + 1
    n = -(-seq // block_size)
    dev = "cuda"
    q = torch.randn(bs, heads, dim, device=dev, dtype=torch.bfloat16)
    cache = torch.randn(2, bs * n, block_size, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    md = AttentionMetadata(
        query_start_loc=torch.arange(bs + 1, device=dev, dtype=torch.int32),
        seq_lens=torch.full((bs,), seq, device=dev, dtype=torch.int32),
        block_table=torch.arange(bs * n, device=dev, dtype=torch.int32).view(bs, n),
        slot_mapping=torch.full((bs,), -1, device=dev, dtype=torch.int64),
        num_reqs=bs, num_tokens=bs, max_query_len=1, max_seq_len=seq,
    )
    return q, cache, md, torch.empty_like(q)


def rope_inputs(q: torch.Tensor, md: AttentionMetadata, context: int, kv_heads: int, block_size: int = 16):
    """The step's new k / v (unrotated), positions, a cos | sin table, and each token's real slot."""
    bs, _, dim = q.shape
    n = -(-(context + 1) // block_size)
    k, v = (torch.randn(bs, kv_heads, dim, device=q.device, dtype=q.dtype) for _ in range(2))
    positions = torch.full((bs,), context, device=q.device, dtype=torch.int64)
    cos_sin = torch.randn(context + 1, dim, device=q.device, dtype=torch.float32)
    md.slot_mapping.copy_(torch.arange(bs, device=q.device) * n * block_size + context)
    return k, v, positions, cos_sin


def rope_then_attention(q, k, v, positions, cos_sin, cache, md, out) -> torch.Tensor:
    """The separate rotary + KV-write kernel, then the attention launch (the step without RopeKV)."""
    q_rot = rope_write_kv_triton(q, k, v, positions, cos_sin, cache, md.slot_mapping)
    return paged_attention_triton(q_rot, cache, md, 0.125, out)


def time_graph(fn, calls: int, replays: int = 10) -> float:
    """Median µs per call of `fn` captured `calls` times in one CUDA graph."""
    return graph_time_us(lambda _: fn(), calls, replays)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", default="14,2,64", help="num_heads,num_kv_heads,head_dim")
    p.add_argument("--batch-sizes", default="1,64,256")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--decode-grid", choices=("plan", "both"), default="plan",
                   help="both: every configuration with the search grid and with one program per request")
    p.add_argument("--rope", action="store_true", help="time the rotary + KV write too (module docstring)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("attn_sweep needs a CUDA device")
    heads, kv_heads, dim = (int(x) for x in args.heads.split(","))
    bw = measure_copy_bandwidth(torch.device("cuda"), 1 << 30).bytes_per_s
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s; heads {heads}/{kv_heads}x{dim}, "
          f"context {args.context}")
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        q, cache, md, out = decode_batch(bs, args.context, heads, kv_heads, dim)
        floor = 2 * bs * (args.context + 1) * kv_heads * dim * 2 / bw * 1e6
        plan = attention_launch_plan(bs, bs, heads, kv_heads, dim, q.device)
        call = functools.partial(paged_attention_triton, q, cache, md, 0.125, out)
        splits_grid: tuple[int, ...] = (1, 2, 4)
        grids = (False, True) if args.decode_grid == "both" else (plan["decode_grid"],)
        if args.rope:
            k, v, pos, cs = rope_inputs(q, md, args.context, kv_heads)
            two = time_graph(functools.partial(rope_then_attention, q, k, v, pos, cs, cache, md, out), args.calls)
            print(f"bs={bs}: rope_write_kv + attention (default plan): {two:.1f} us ({100 * floor / two:.0f}%)")
            call = functools.partial(call, rope_kv=RopeKV(k, v, pos, cs, md.slot_mapping))
            splits_grid, grids = (1, 2, 4, 8, 16, 32), (True,)
        default = time_graph(call, args.calls)
        results = []
        if args.decode_grid == "both":
            for by_request in grids:
                us = time_graph(functools.partial(call, decode_grid=by_request), args.calls)
                print(f"bs={bs}: default plan, decode_grid={by_request}: {us:.1f} us ({100 * floor / us:.0f}%)")
        for block_n, warps, stages, splits, by_request in itertools.product((64, 128), (2, 4, 8), (2, 3, 4),
                                                                            splits_grid, grids):
            kw = dict(block_n=block_n, num_warps=warps, num_stages=stages, num_kv_splits=splits,
                      decode_grid=by_request)
            try:
                us = time_graph(functools.partial(call, **kw), args.calls)
            except Exception as e:  # a config that does not compile (shared memory) is skipped
                print(f"  skip {kw}: {type(e).__name__}")
                continue
            results.append((us, kw))
        results.sort(key=lambda r: r[0])
        print(f"bs={bs}: floor {floor:.1f} us; default plan {plan['block_n']}/{plan['num_warps']}/"
              f"{plan['num_stages']}/splits {plan['num_kv_splits']}: {default:.1f} us ({100 * floor / default:.0f}%)")
        for us, kw in results[:5]:
            print(f"   {us:8.1f} us ({100 * floor / us:.0f}%)  {kw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
