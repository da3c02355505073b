"""Where the host time of a decode step goes: per-section timers and a cProfile dump.

    python -m graphrunner_tools.bench.profile_host [--model M] [--batch-sizes 1,256] [--steps 200]

Wraps the runner's host-side sections (validation, state updates, batch preparation,
graph replay launch, output launch and resolve) with perf_counter timers over the same
runner loop `bench host` times, then prints the medians per section and the top cProfile
entries. A diagnostic, not a benchmark figure: the timers add ~1 us per section.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from collections import defaultdict

import numpy as np


def _timed(fn, sink: dict[str, list[float]], label: str):
    """`fn`, appending each call's wall seconds to sink[label]."""

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink[label].append(time.perf_counter() - t0)

    return timed


def _wrap(obj, name: str, sink: dict[str, list[float]], label: str) -> None:
    setattr(obj, name, _timed(getattr(obj, name), sink, label))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:qwen2.5-0.5b")
    ap.add_argument("--batch-sizes", default="1,256")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)

    import graphrunner.runner as runner_mod
    from graphrunner.engine.llm import LLM
    from graphrunner_tools.bench import host_overhead as ho
    from graphrunner_tools.bench.common import resolve_device

    sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    spec = ho.HostSpec(model=args.model, batch_sizes=sizes, steps=args.steps, warmup=10, device=args.device)
    device = resolve_device(spec.device)
    bpr = -(-spec.tokens_per_request // spec.block_size)
    llm = LLM(spec.model, device=device, enable_prefix_caching=False,
              max_num_seqs=spec.max_batch, max_num_batched_tokens=max(spec.max_batch, 128),
              max_model_len=bpr * spec.block_size, block_size=spec.block_size, num_kv_blocks=1 + spec.max_batch * bpr,
              enforce_eager=False, cudagraph_mode="FULL", cudagraph_capture_sizes=sizes,
              compile_backend="inductor" if device.type == "cuda" else "eager")
    runner = llm.runner
    sink: dict[str, list[float]] = defaultdict(list)
    runner_mod.validate_scheduler_output = _timed(runner_mod.validate_scheduler_output, sink, "validate")
    for name, label in (("_update_states", "update_states"), ("_prepare_batch", "prepare_batch"),
                        ("_execute_steady_decode", "execute (steady decode, whole)"),
                        ("_reusable_plan", "reusable_plan"), ("_build_output", "build_output")):
        _wrap(runner, name, sink, label)
    for graph in runner.graphs.full_graphs.values():
        _wrap(graph, "replay", sink, "graph replay (launch)")
    _wrap(runner.output_ring, "guard_next_step", sink, "guard_next_step")
    _wrap(runner.output_ring, "launch_layout", sink, "output launch (D2H + events)")
    _wrap(runner.parallel, "before_forward", sink, "parallel hooks")
    for bs in sizes:
        for scheduling in ("sync", "async"):
            sink.clear()
            host, _, _ = ho._runner_loop(runner, spec, bs, scheduling)
            print(f"\n== bs={bs} {scheduling}: host median {np.median(host) * 1e6:.1f} us/step")
            for label, times in sorted(sink.items(), key=lambda kv: -np.median(kv[1])):
                print(f"  {label:<32} {np.median(times) * 1e6:8.1f} us  (n={len(times)})")
        prof = cProfile.Profile()
        prof.enable()
        ho._runner_loop(runner, spec, bs, "async")
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        print(f"\n== cProfile bs={bs} async (tottime, {spec.warmup + spec.steps} steps)")
        print("\n".join(buf.getvalue().splitlines()[:45]))
    runner.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
