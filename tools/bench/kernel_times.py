"""GPU time per kernel and per kernel family of a decode step (`bench kernels`).

Node counts (`inspect capture`) say how many kernels a step launches; this says where its
time goes. It builds the runner exactly as `bench latency` does (same admission, same
random KV cache), runs `--steps` decode steps per batch size under `torch.profiler`
(CUPTI records the kernels of graph replays too), and sums each kernel's device time per
step. Families are `inspect capture`'s (graphrunner_tools.inspect.node_families), so the two
reports line up: gemm/gemv, attention, triton fused, reduce, ...

    graphrunner bench kernels --model builtin:qwen2.5-0.5b --batch-sizes 1,256 --context 1024 \
        --modes FULL --markdown out.md

Kernel time is the sum of kernel durations; the gap to the step's wall time is launch,
drain and host time that no kernel accounts for. The runner is built without programmatic
dependent launch (`KernelConfig(pdl=False)`) unless `--pdl` asks for it: with PDL a kernel
starts while its predecessor drains, and the profiler's per-kernel times overlap.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from capture.modes import CUDAGraphMode
from capture.report import short_kernel_name
from graphrunner.config import KernelConfig
from graphrunner.protocol import SchedulerOutput
from graphrunner_tools.bench import latency
from graphrunner_tools.bench.common import resolve_device
from graphrunner_tools.inspect.node_families import kernel_family


@dataclass
class KernelTimes:
    """Per-step device time of one (mode, batch size): by kernel and by family, in µs."""

    mode: str
    batch_size: int
    steps: int
    wall_ms: float
    by_kernel: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (calls/step, µs/step)

    @property
    def kernel_us(self) -> float:
        return sum(us for _, us in self.by_kernel.values())

    def by_family(self) -> dict[str, tuple[float, float]]:
        out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for name, (calls, us) in self.by_kernel.items():
            acc = out[kernel_family(name)]
            acc[0] += calls
            acc[1] += us
        return {f: (c, us) for f, (c, us) in sorted(out.items(), key=lambda kv: -kv[1][1])}

    def markdown(self, top: int) -> str:
        total = self.kernel_us
        lines = [f"### {self.mode} bs={self.batch_size}: {self.wall_ms:.3f} ms/step wall, "
                 f"{total / 1e3:.3f} ms/step in kernels ({self.steps} steps)", "",
                 "| family | kernels/step | µs/step | share |", "|---|---:|---:|---:|"]
        lines += [f"| {f} | {c:.0f} | {us:.1f} | {100 * us / total:.1f}% |" for f, (c, us) in self.by_family().items()]
        lines += ["", f"| kernel (top {top}) | calls/step | µs/step | µs/call | share |", "|---|---:|---:|---:|---:|"]
        ranked = sorted(self.by_kernel.items(), key=lambda kv: -kv[1][1])[:top]
        lines += [f"| {name[:60]} | {c:.0f} | {us:.1f} | {us / max(c, 1e-9):.2f} | {100 * us / total:.1f}% |"
                  for name, (c, us) in ranked]
        return "\n".join(lines) + "\n"


def profile_batch(runner, spec: latency.LatencySpec, mode: CUDAGraphMode, bs: int) -> KernelTimes:
    """Admit `bs` requests, run the warmup and `spec.steps` timed steps under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    req_ids = latency._admit(runner, spec, bs)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall, _ = latency._timed_decode_steps(runner, spec, req_ids)
    runner.execute_model(SchedulerOutput(finished_req_ids=set(req_ids)))
    runner.sample_tokens()
    steps = spec.warmup + spec.steps  # the profiler saw the warmup steps too
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.device_time_total > 0:
            acc = sums[short_kernel_name(evt.name)]
            acc[0] += 1
            acc[1] += evt.device_time_total  # µs
    return KernelTimes(mode.name, bs, steps, 1e3 * sorted(wall)[len(wall) // 2],
                       {k: (c / steps, us / steps) for k, (c, us) in sums.items()})


def run(spec: latency.LatencySpec, top: int, log=print) -> list[KernelTimes]:
    device = resolve_device(spec.device)
    if device.type != "cuda":
        raise SystemExit("bench kernels needs a CUDA device (kernel times come from CUPTI)")
    results = []
    for mode_name in spec.modes:
        mode = CUDAGraphMode.parse(mode_name)
        runner = latency._build_runner(spec, mode, device, log)
        try:
            latency._prepare_runner(runner, spec, mode, latency.ModeInfo(mode.name), log)
            for bs in spec.batch_sizes:
                result = profile_batch(runner, spec, mode, bs)
                log(result.markdown(top))
                results.append(result)
        finally:
            runner.shutdown()
    return results


def run_args(args: argparse.Namespace) -> int:
    """Profile what `args` asks for, print the tables, write the markdown file if asked."""
    spec = latency.LatencySpec(model=args.model, batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")),
                               context=args.context, modes=tuple(args.modes.split(",")), steps=args.steps,
                               warmup=2, kernel=KernelConfig(pdl=args.pdl), quantization=args.quantization,
                               kv_cache_dtype=args.kv_cache_dtype)
    results = run(spec, args.top)
    if args.markdown:
        with open(args.markdown, "w") as f:
            extras = "".join(f", {name} {v}" for name, v in (("quantization", args.quantization),
                                                              ("KV", args.kv_cache_dtype)) if v not in (None, "auto"))
            f.write(f"# Kernel time per decode step: {args.model}, context {args.context}{extras}\n\n")
            f.write(f"device: {torch.cuda.get_device_name()}\n\n")
            f.writelines(r.markdown(args.top) + "\n" for r in results)
    return 0


def main(argv: list[str] | None = None) -> int:
    from graphrunner_tools.bench.cli import add_kernels_args

    p = argparse.ArgumentParser(prog="bench kernels", description=__doc__.split("\n\n")[0])
    add_kernels_args(p)
    return run_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
