"""Decode projections at M = 1..16 rows: cuBLAS F.linear vs the one-launch small_m_linear.

    source tools/device_env.sh
    python -m graphrunner_tools.bench.gemv_bench --out "$OUT"           # the table
    python -m graphrunner_tools.bench.gemv_bench --out "$OUT" --sweep   # + the best tiles per shape

Issue #17, item 5: at decode batch sizes cuBLAS runs split-K GEMMs plus a `splitKreduce`
kernel, and SwiGLU's `silu(gate) * up` is its own kernel before the down projection. For
the qkv / o / gate_up / down projections of three models, bf16 on CUDA, per M:

  cuBLAS  F.linear (down: `F.silu(gate) * up`, then F.linear: the kernels of today)
  triton  graphrunner.kernels.small_m_linear (down: the SwiGLU prologue fused)
  floor   weight bytes / copy bandwidth (a 1 GiB device-to-device copy, read + write bytes)

Timing: a CUDA graph holding `--calls` (50) back-to-back calls, so launch costs are those a
graph sees, replayed `--replays` (20) times with events around each replay; the median
replay / calls. The calls cycle over copies of the weight totalling >= 3x the L2, so each
call reads its weight from memory as in a real step (whose layers never fit in L2);
`--hot` uses one copy. Before timing, each triton variant is checked against cuBLAS.

Writes DIR/gemv_bench.{md,json}; `--sweep` also times a grid of (use_dot, block_n,
block_k, num_warps) per shape and writes DIR/gemv_sweep.{md,json}: the best tiles next
to what small_m_linear_plan picks, to tune the plan from one device run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

SWEEP_BLOCK_K = (128, 256, 512)
SWEEP_WARPS = (4, 8)


@dataclass(frozen=True)
class Model:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    qkv_bias: bool


MODELS = {
    "qwen2.5-0.5b": Model(896, 4864, 14, 2, 64, qkv_bias=True),
    "llama-3.2-1b": Model(2048, 8192, 32, 8, 64, qkv_bias=False),
    "llama-3.1-8b": Model(4096, 14336, 32, 8, 128, qkv_bias=False),
}


@dataclass(frozen=True)
class Proj:
    name: str
    n: int
    k: int
    bias: bool
    silu_mul: bool


def projections(m: Model) -> list[Proj]:
    """The four decode projections of one layer, as [N, K] weights (gate|up fused, down with SwiGLU)."""
    return [
        Proj("qkv", (m.heads + 2 * m.kv_heads) * m.head_dim, m.hidden, m.qkv_bias, False),
        Proj("o", m.hidden, m.heads * m.head_dim, False, False),
        Proj("gate_up", 2 * m.intermediate, m.hidden, False, False),
        Proj("down", m.hidden, m.intermediate, False, True),
    ]


def graph_time_us(call: Callable[[int], object], calls: int, replays: int) -> float:
    """Median microseconds per call of a CUDA graph holding `calls` back-to-back `call(i)`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles, cuBLAS handles) outside the capture
        call(0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    graph.replay()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(samples)


class Case:
    """Inputs of one (projection, M): x, the weight copies the calls cycle over, the bias."""

    def __init__(self, proj: Proj, m: int, hot: bool, seed: int = 0) -> None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.proj, self.m = proj, m
        self.weight_bytes = proj.n * proj.k * 2 + (proj.n * 2 if proj.bias else 0)
        l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 50 << 20)
        copies = 1 if hot else max(1, min(50, -(-3 * l2 // self.weight_bytes)))
        width = 2 * proj.k if proj.silu_mul else proj.k
        self.x = torch.randn(m, width, device="cuda", generator=gen, dtype=torch.bfloat16)  # [M, K or 2K]
        self.weights = [  # copies x [N, K]
            (torch.randn(proj.n, proj.k, device="cuda", generator=gen) * proj.k**-0.5).to(torch.bfloat16)
            for _ in range(copies)
        ]
        self.bias = torch.randn(proj.n, device="cuda", generator=gen, dtype=torch.bfloat16) if proj.bias else None

    def cublas(self, i: int) -> torch.Tensor:
        w = self.weights[i % len(self.weights)]
        x = self.x
        if self.proj.silu_mul:
            x = F.silu(x[:, : self.proj.k]) * x[:, self.proj.k :]  # [M, K]: today's elementwise kernel
        return F.linear(x, w, self.bias)

    def triton(self, i: int, **tiles) -> torch.Tensor:
        from graphrunner_tools.bench.small_m_linear import small_m_linear

        w = self.weights[i % len(self.weights)]
        return small_m_linear(self.x, w, self.bias, silu_mul=self.proj.silu_mul, **tiles)

    def check(self, **tiles) -> float:
        """Max |triton - cuBLAS| on call 0; raises when it is beyond bf16 noise."""
        got, want = self.triton(0, **tiles).float(), self.cublas(0).float()
        err = (got - want).abs().max().item()
        if not err <= 5e-2 * max(1.0, want.abs().max().item()):
            raise RuntimeError(f"{self.proj} M={self.m} tiles={tiles}: max error {err} vs cuBLAS")
        return err


def _plan_label(m: int, proj: Proj) -> str:
    from graphrunner_tools.bench.small_m_linear import small_m_linear_plan

    p = small_m_linear_plan(m, proj.n, proj.k, torch.device("cuda"))
    return _tiles_label(p.use_dot, p.block_n, p.block_k, p.num_warps)


def _tiles_label(use_dot: bool, block_n: int, block_k: int, num_warps: int) -> str:
    return f"{'dot' if use_dot else 'fma'} {block_n}x{block_k} w{num_warps}"


def bench_row(model: str, proj: Proj, m: int, bytes_per_s: float, args: argparse.Namespace) -> dict:
    """One table row: cuBLAS, triton (planned tiles) and the floor, in microseconds per call."""
    case = Case(proj, m, args.hot)
    err = case.check()
    cublas_us = graph_time_us(case.cublas, args.calls, args.replays)
    triton_us = graph_time_us(case.triton, args.calls, args.replays)
    floor_us = case.weight_bytes / bytes_per_s * 1e6
    return {
        "model": model, "proj": proj.name, "M": m, "N": proj.n, "K": proj.k, "bias": proj.bias,
        "silu_mul": proj.silu_mul, "weight_copies": len(case.weights), "plan": _plan_label(m, proj),
        "cublas_us": cublas_us, "triton_us": triton_us, "floor_us": floor_us, "max_abs_err": err,
        "triton_pct_of_floor": 100 * floor_us / triton_us, "cublas_pct_of_floor": 100 * floor_us / cublas_us,
        "winner": "triton" if triton_us < cublas_us else "cuBLAS",
    }  # fmt: skip


def sweep_configs(m: int) -> list[dict]:
    """The tiles --sweep tries at M rows (FMA only up to 8 rows: beyond, its FMAs cost more than the read)."""
    out = []
    for use_dot in (False, True) if m <= 8 else (True,):
        for block_n in (16, 32, 64) if use_dot else (8, 16, 32, 64):
            for block_k in SWEEP_BLOCK_K:
                for num_warps in SWEEP_WARPS:
                    out.append(dict(use_dot=use_dot, block_n=block_n, block_k=block_k, num_warps=num_warps))
    return out


def sweep_shape(model: str, proj: Proj, m: int, args: argparse.Namespace) -> dict:
    """Every sweep config at one (projection, M); configs that fail to compile or check are reported, not fatal."""
    case = Case(proj, m, args.hot)
    results = []
    for tiles in sweep_configs(m):
        try:
            case.check(**tiles)
            us = graph_time_us(functools.partial(case.triton, **tiles), args.calls, args.sweep_replays)
            results.append({**tiles, "us": us})
        except Exception as exc:  # a tile the compiler rejects (shared memory, registers) is data, not a crash
            results.append({**tiles, "us": None, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    plan_us = graph_time_us(case.triton, args.calls, args.sweep_replays)
    timed = [r for r in results if r["us"] is not None]
    best = min(timed, key=lambda r: r["us"]) if timed else None
    return {"model": model, "proj": proj.name, "M": m, "N": proj.n, "K": proj.k, "plan": _plan_label(m, proj),
            "plan_us": plan_us, "best": best, "configs": results}  # fmt: skip


def markdown_table(rows: list[dict], meta: dict) -> str:
    lines = [
        "| model | proj | M | cuBLAS µs | triton µs | floor µs | triton % of floor | winner | plan |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['proj']} ({r['N']}x{r['K']}) | {r['M']} | {r['cublas_us']:.2f} | "
            f"{r['triton_us']:.2f} | {r['floor_us']:.2f} | {r['triton_pct_of_floor']:.0f}% | {r['winner']} | "
            f"{r['plan']} |"
        )
    lines.append(
        f"\n{meta['device']}, torch {meta['torch']}, triton {meta['triton']}; bf16; floor = weight bytes at the "
        f"copy bandwidth {meta['copy_gb_per_s']:.0f} GB/s (1 GiB copy, read + write); graph of {meta['calls']} calls, "
        f"median of {meta['replays']} replays; weights {'L2-hot' if meta['hot'] else 'cycled over >= 3x L2'}."
    )
    return "\n".join(lines)


def sweep_table(rows: list[dict]) -> str:
    lines = [
        "| model | proj | M | plan | plan µs | best | best µs | plan / best |",
        "|---|---|---:|---|---:|---|---:|---:|",
    ]
    for r in rows:
        b = r["best"]
        label = "-" if b is None else _tiles_label(b["use_dot"], b["block_n"], b["block_k"], b["num_warps"])
        ratio = "-" if b is None else f"{r['plan_us'] / b['us']:.2f}"
        best_us = "-" if b is None else f"{b['us']:.2f}"
        lines.append(f"| {r['model']} | {r['proj']} ({r['N']}x{r['K']}) | {r['M']} | {r['plan']} | "
                     f"{r['plan_us']:.2f} | {label} | {best_us} | {ratio} |")  # fmt: skip
    return "\n".join(lines)


def _write(out: Path, stem: str, md: str, data: object) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(md + "\n")
    (out / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"), help="folder for gemv_bench.{md,json}")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of: {', '.join(MODELS)}")
    ap.add_argument("--projs", default="qkv,o,gate_up,down", help="comma-separated projections")
    ap.add_argument("--ms", default="1,8,16", help="comma-separated row counts (1..16)")
    ap.add_argument("--calls", type=int, default=50, help="back-to-back calls captured in one graph")
    ap.add_argument("--replays", type=int, default=20, help="timed replays (the median is reported)")
    ap.add_argument("--copy-mib", type=int, default=1024, help="copy-bandwidth buffer size")
    ap.add_argument("--hot", action="store_true", help="one weight copy (L2-resident when small)")
    ap.add_argument("--sweep", action="store_true", help="also time a tile grid per shape (gemv_sweep.{md,json})")
    ap.add_argument("--sweep-replays", type=int, default=10, help="timed replays per sweep config")
    args = ap.parse_args(argv)
    args.models = [s for s in args.models.split(",") if s]
    args.projs = [s for s in args.projs.split(",") if s]
    args.ms = [int(s) for s in args.ms.split(",") if s]
    bad = [m for m in args.models if m not in MODELS]
    if bad:
        ap.error(f"unknown model(s) {bad}; known: {', '.join(MODELS)}")
    if any(not 1 <= m <= 16 for m in args.ms):
        ap.error(f"--ms {args.ms}: every M must be in 1..16")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from graphrunner.kernels import HAS_TRITON

    if not torch.cuda.is_available() or not HAS_TRITON:
        print("gemv_bench needs a CUDA device and triton (it times bf16 cuBLAS against a Triton kernel)",
              file=sys.stderr)  # fmt: skip
        return 1
    import triton

    from graphrunner_tools.bench.roofline import measure_copy_bandwidth

    device = torch.device("cuda", torch.cuda.current_device())
    bw = measure_copy_bandwidth(device, args.copy_mib << 20)
    meta = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
            "copy_gb_per_s": bw.bytes_per_s / 1e9, "calls": args.calls, "replays": args.replays, "hot": args.hot}
    shapes = [(name, p, m) for name in args.models for p in projections(MODELS[name]) if p.name in args.projs
              for m in args.ms]  # fmt: skip
    rows = []
    with torch.inference_mode():
        for name, proj, m in shapes:
            rows.append(bench_row(name, proj, m, bw.bytes_per_s, args))
            print(f"{name} {proj.name} M={m}: cuBLAS {rows[-1]['cublas_us']:.2f} us, triton "
                  f"{rows[-1]['triton_us']:.2f} us, floor {rows[-1]['floor_us']:.2f} us", flush=True)  # fmt: skip
            torch.cuda.empty_cache()
        md = markdown_table(rows, meta)
        print(md)
        _write(Path(args.out), "gemv_bench", md, {"meta": meta, "rows": rows})
        if args.sweep:
            sweeps = []
            for name, proj, m in shapes:
                sweeps.append(sweep_shape(name, proj, m, args))
                torch.cuda.empty_cache()
            md = sweep_table(sweeps)
            print(md)
            _write(Path(args.out), "gemv_sweep", md, {"meta": meta, "shapes": sweeps})
    return 0


if __name__ == "__main__":
    sys.exit(main())
