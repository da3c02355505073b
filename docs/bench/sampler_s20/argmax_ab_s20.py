"""Greedy argmax A/B in one process: the launch of session 19 (8 warps, two 16-byte loads a thread, no
eviction hint) against the module's defaults (session 20: 16 warps, one load a thread, evict_first, for
long chunks), interleaved old / new three times, at 256, 64 and 1 rows x 151,936 fp32, each as 20 calls in
one CUDA graph over 3 cycled copies of the logits (graphrunner_tools.bench.gemv_bench.graph_time_us).
Tokens are checked against torch.argmax.
Run from the repository root with tools/device_env.sh sourced.
"""

from __future__ import annotations

import torch

from graphrunner.sample import argmax
from graphrunner_tools.bench.gemv_bench import graph_time_us
from graphrunner_tools.bench.roofline import measure_copy_bandwidth

_KNOBS = ("_ELEMS_PER_THREAD", "_LONG_CHUNK_ELEMS_PER_THREAD", "_MAX_WARPS", "_EVICT")
# new: the module's defaults (16 warps with evict_first for long chunks; calls 4, 5 and 7 of session 20 ran
# it as 16 warps for every chunk, before the long-chunk rule)
SETTINGS = {"old (8 warps)": (8, 8, 8, ""), "new (module defaults)": tuple(getattr(argmax, k) for k in _KNOBS)}


def main() -> None:
    bw = measure_copy_bandwidth(torch.device("cuda"), 1 << 30).bytes_per_s
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s; COMBINE_LAST={argmax.COMBINE_LAST}")
    for rows in (256, 64, 1):
        xs = [torch.randn(rows, 151936, device="cuda") for _ in range(3)]
        out = torch.empty(rows, dtype=torch.int64, device="cuda")
        times: dict[str, list[float]] = {name: [] for name in SETTINGS}
        for _ in range(3):
            for name, values in SETTINGS.items():
                for knob, value in zip(_KNOBS, values, strict=True):
                    setattr(argmax, knob, value)
                argmax.argmax_rows_triton(xs[0], out=out)
                assert torch.equal(out, torch.argmax(xs[0], -1)), name
                call = lambda i, xs=xs, out=out: argmax.argmax_rows_triton(xs[i % 3], out=out)  # noqa: E731
                times[name].append(graph_time_us(call, 20, 15))
        floor = rows * 151936 * 4 / bw * 1e6
        for name, us in times.items():
            print(f"R={rows:3d} floor {floor:5.1f} us  {name:28s} " + " ".join(f"{u:6.2f}" for u in us) + " us")


if __name__ == "__main__":
    main()
