"""Two-batch overlap probe for issue #17's batch 256 on an H200 (written in session 19, not yet run).

At 256 rows of qwen2.5-0.5b on an H200 the step is 44% of its bandwidth roofline (target 55%): the
decode attention streams the KV cache (memory-bound, 44 µs a layer, 71% of its floor) while the
cuBLAS GEMMs (~33 µs a layer) and the norms are bound by latency and compute. Even with attention at
its floor the serial chain stays near 53%. Overlap is the remaining lever: cut the batch in two
halves and run each half's layer chain on its own stream, so one half's attention (reads) can run
beside the other half's GEMMs (math), as SGLang's two-batch overlap and NanoFlow do.

This measures whether an H200 gives that overlap, before any runner change: a qwen2.5-0.5b-shaped
stack of `--layers` decoder layers (distinct random weights; real kernels: the fused add + RMSNorm,
cuBLAS `F.linear`, the paged attention with rope and KV write folded in, SiLU·mul) at `--rows` decode
rows of `--context` cached tokens, timed as one CUDA graph per variant:
- full: the whole batch, one stream (what the runner does now);
- split_serial: the two halves one after the other on one stream (the cost of splitting alone);
- split_overlap: half A on one stream, half B on another, forked and joined inside the graph.
A split_overlap clearly below full (and well below split_serial) is the go signal for building it
into the runner (per-half attention metadata, two streams in the FULL graph).

    python docs/bench/decode_fusion/tbo_probe_s20.py --rows 256 --context 1024
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from graphrunner.attention.triton_attn import RopeKV, paged_attention_triton
from graphrunner.layers.norm import add_rms_norm_triton
from graphrunner.layers.swiglu import silu_mul_triton
from graphrunner_tools.bench.attn_sweep import decode_batch, rope_inputs
from graphrunner_tools.bench.gemv_bench import graph_time_us

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 896, 14, 2, 64, 4864  # qwen2.5-0.5b
EPS = 1e-6


class LayerWeights:
    def __init__(self, g: torch.Generator) -> None:
        def w(*shape):
            return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02

        qkv_out = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.qkv, self.qkv_b, self.o = w(qkv_out, HIDDEN), w(qkv_out), w(HIDDEN, HIDDEN)
        self.gate_up, self.down = w(2 * INTER, HIDDEN), w(HIDDEN, INTER)
        self.norm1, self.norm2 = 1 + w(HIDDEN), 1 + w(HIDDEN)


class Half:
    """One group of rows: its hidden / residual rows and, per layer, its own paged cache and metadata."""

    def __init__(self, rows: int, layers: int, context: int) -> None:
        self.x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)  # [R, H]
        self.res = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)  # [R, H]
        self.attn = []
        for _ in range(layers):
            q, cache, md, out = decode_batch(rows, context, HEADS, KV_HEADS, HEAD_DIM)
            _, _, positions, cos_sin = rope_inputs(q, md, context, KV_HEADS)
            self.attn.append((cache, md, out, positions, cos_sin))

    def layer(self, i: int, lw: LayerWeights, x: torch.Tensor, res: torch.Tensor):
        rows = x.shape[0]
        cache, md, out, positions, cos_sin = self.attn[i]
        normed, res = add_rms_norm_triton(x, res, lw.norm1, EPS)
        qkv = F.linear(normed, lw.qkv, lw.qkv_b)  # [R, (Hq + 2 Hkv) D]
        q = qkv[:, : HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM: (HEADS + KV_HEADS) * HEAD_DIM].view(rows, KV_HEADS, HEAD_DIM)
        v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(rows, KV_HEADS, HEAD_DIM)
        attn = paged_attention_triton(q, cache, md, HEAD_DIM ** -0.5, out,
                                      rope_kv=RopeKV(k, v, positions, cos_sin, md.slot_mapping))
        normed, res = add_rms_norm_triton(F.linear(attn.view(rows, -1), lw.o), res, lw.norm2, EPS)
        return F.linear(silu_mul_triton(F.linear(normed, lw.gate_up)), lw.down), res

    def step(self, weights: list[LayerWeights], first: int = 0, last: int | None = None) -> None:
        x, res = self.x, self.res
        for i, lw in enumerate(weights[first:last], start=first):
            x, res = self.layer(i, lw, x, res)


def graph_ms(fn, replays: int) -> float:
    """Median ms of one replay of a CUDA graph of `fn` (gemv_bench's timer, one call per graph)."""
    return graph_time_us(lambda _: fn(), 1, replays) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = [LayerWeights(g) for _ in range(args.layers)]
    full = Half(args.rows, args.layers, args.context)
    a, b = (Half(args.rows // 2, args.layers, args.context) for _ in range(2))
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def split_serial():
        for i in range(args.layers):
            a.step(weights, i, i + 1)
            b.step(weights, i, i + 1)

    def split_overlap():
        main_stream = torch.cuda.current_stream()
        for half, stream in zip((a, b), streams, strict=True):
            stream.wait_stream(main_stream)
            with torch.cuda.stream(stream):
                half.step(weights)
        for stream in streams:
            main_stream.wait_stream(stream)

    print(f"{torch.cuda.get_device_name()}: {args.layers} qwen2.5-0.5b-shaped layers, {args.rows} rows, "
          f"context {args.context} (no LM head, no sampler)", flush=True)
    with torch.inference_mode():
        for rep in range(2):  # interleaved twice: a run's spread shows between the repeats
            for name, fn in (("full", lambda: full.step(weights)), ("split_serial", split_serial),
                             ("split_overlap", split_overlap)):
                print(f"  rep {rep} {name:14s} {graph_ms(fn, args.replays):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
