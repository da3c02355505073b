"""Decode attention time against context length: what a launch costs besides streaming the KV cache.

Issue #17: at 256 rows, qwen2.5-0.5b's attention (2 KV heads: 512 programs, one partial wave) reaches 73% of
the KV-read floor on an H200 while llama shapes with 8 KV heads (2,048 programs) reach 86-89%. If the gap is
a fixed cost per launch (each program's start: the rotary + KV write of the new token, q, the block-table
lookups and the first tiles, all before any streaming; and its end), time grows with context at the floor's
slope and the intercept is that cost. If the streaming itself is slow, the slope is above the floor's.

For each head shape at --rows, times the step's launch (rotary + KV write inside, `RopeKV`; default plan)
and the plain launch at contexts 256 .. 4096 as 20 calls in one CUDA graph, then fits time = a + b x context
by least squares and prints a (µs), the streaming rate implied by b against the copy bandwidth, and the
residuals. Run from the repository root with tools/device_env.sh sourced:

    python3 docs/bench/decode_fusion/attn_context_s21.py --rows 256
"""

from __future__ import annotations

import argparse
import functools

import torch

from graphrunner.attention.triton_attn import RopeKV, paged_attention_triton
from graphrunner_tools.bench.attn_sweep import decode_batch, rope_inputs, time_graph
from graphrunner_tools.bench.roofline import measure_copy_bandwidth

SHAPES = ((14, 2, 64), (32, 8, 64))  # qwen2.5-0.5b, llama-3.2-1b
CONTEXTS = (256, 512, 1024, 2048, 4096)


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys against xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--stages", type=int, default=None, help="num_stages override (default: the plan's)")
    p.add_argument("--shapes", default="all", help="'qwen' for 14/2x64 only")
    args = p.parse_args()
    shapes = SHAPES[:1] if args.shapes == "qwen" else SHAPES
    bw = measure_copy_bandwidth(torch.device("cuda"), 1 << 30).bytes_per_s
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s; {args.rows} rows", flush=True)
    for heads, kv_heads, dim in shapes:
        bytes_per_key = 2 * args.rows * kv_heads * dim * 2  # K and V of every row, bf16
        for rope in (True, False):
            times = []
            for context in CONTEXTS:
                q, cache, md, out = decode_batch(args.rows, context, heads, kv_heads, dim)
                kw = {} if args.stages is None else {"num_stages": args.stages}
                if rope:
                    k, v, pos, cs = rope_inputs(q, md, context, kv_heads)
                    kw["rope_kv"] = RopeKV(k, v, pos, cs, md.slot_mapping)
                times.append(time_graph(functools.partial(paged_attention_triton, q, cache, md, 0.125, out, **kw), 20))
                del q, cache, md, out
            a, b = fit([float(c + 1) for c in CONTEXTS], times)
            rate = bytes_per_key / (b * 1e-6)  # bytes per second while streaming
            resid = " ".join(f"{t - (a + b * (c + 1)):+.2f}" for c, t in zip(CONTEXTS, times, strict=True))
            floor = [bytes_per_key * (c + 1) / bw * 1e6 for c in CONTEXTS]
            print(f"{heads}/{kv_heads}x{dim} {'rope' if rope else 'plain'}: "
                  + " ".join(f"{c}:{t:.1f}({100 * f / t:.0f}%)" for c, t, f in zip(CONTEXTS, times, floor, strict=True))
                  + f" us; fixed {a:.1f} us, streaming at {rate / 1e9:.0f} GB/s = {100 * rate / bw:.0f}% of copy;"
                  f" residuals {resid}", flush=True)


if __name__ == "__main__":
    main()
