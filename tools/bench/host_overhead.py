"""`bench host`: host CPU time per decode step, sync vs async scheduling.

One `LLM` (FULL graphs captured at exactly the benchmarked batch sizes) serves every
measurement. For each batch size and scheduling mode two loops run:

- runner loop (`repeats` times, sync and async interleaved, samples pooled; per-loop
  medians kept to show drift): hand-built decode plans (made before the timed region:
  that is the engine's cost) through `execute_model` + `sample_tokens(async_output=True)`
  and the output's `get()`. `host_us` is the wall time inside those calls, not counting
  the wait for the output copy (untimed: polling `is_ready()` by default, or blocking in
  `wait()`): pure host work; `host_cpu_us` is the thread's CPU time in the same regions.
  Sync scheduling resolves each step before launching the next (the device is idle
  while the host prepares); async launches step N + 1 first and then resolves step N,
  so the host works while the device is busy. `step_us` is the wall time per iteration.
- engine loop: the same with the reference `Scheduler` in the loop:
  schedule + execute + sample(async) + resolve (update_from_output), minus the wait.

`gpu_us` is the device time of one step from CUDA events in a separate synchronized
pass (None on a CPU). No figure synchronizes inside its timed region.

`noop_step=True` replaces the step body (eager body and graph replay) with a no-op:
the host path alone, which is how to measure it on a CPU, where the "device" work
runs inside `execute_model` on the same cores.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from graphrunner.protocol import NewRequestData, SamplingParams, SchedulerOutput
from graphrunner_tools.bench.common import Stats, env_info, release_memory, resolve_device

if TYPE_CHECKING:
    from graphrunner.engine.llm import LLM

logger = logging.getLogger("graphrunner.bench")

Log = Callable[[str], None]
SCHEDULINGS = ("sync", "async")
WAITS = ("poll", "block")
_LEN_MARGIN = 8
# Sync and async: which step's output is resolved right after a launch.
_LAG = {"sync": 0, "async": 1}


@dataclass(frozen=True)
class HostSpec:
    """What `run_host` measures."""

    model: str = "builtin:qwen2.5-0.5b"
    batch_sizes: tuple[int, ...] = (1, 64, 256)
    context: int = 128
    steps: int = 100
    warmup: int = 10
    repeats: int = 3  # runner loops per (batch size, scheduling), interleaved, samples pooled
    # Untimed runner loops before the first measurement: a freshly started (virtual) host
    # runs the same Python several times slower for its first minute or so. None: 20 s
    # on CUDA, 0 on a CPU.
    settle_s: float | None = None
    # How the loop waits for an output's copy: "poll" spins on `is_ready()` (an engine
    # loop that keeps working), "block" calls `wait()` (the driver's wait, in which a
    # virtualized host may lose its core and return to it cold).
    wait: str = "poll"
    mode: str = "FULL"
    schedulings: tuple[str, ...] = SCHEDULINGS
    dtype: str = "auto"
    device: str | None = None
    block_size: int = 16
    compile_backend: str | None = None  # None: inductor on CUDA, eager on CPU
    load_format: str = "auto"
    seed: int = 0
    noop_step: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_sizes", tuple(self.batch_sizes))
        object.__setattr__(self, "schedulings", tuple(self.schedulings))
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch_sizes={list(self.batch_sizes)} must be non-empty, each >= 1")
        bad = [s for s in self.schedulings if s not in SCHEDULINGS]
        if bad or not self.schedulings:
            raise ValueError(f"schedulings={list(self.schedulings)}; allowed: {list(SCHEDULINGS)}")
        for name in ("context", "steps", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.wait not in WAITS:
            raise ValueError(f"wait={self.wait!r}; allowed: {list(WAITS)}")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup} must be >= 0")

    @property
    def max_batch(self) -> int:
        return max(self.batch_sizes)

    @property
    def tokens_per_request(self) -> int:
        """Longest sequence a request reaches: both loops of both schedulings, plus margin."""
        return self.context + 2 * (self.warmup + self.steps) + _LEN_MARGIN


@dataclass
class HostRow:
    """One (scheduling, batch size). Times in microseconds (medians; p90 beside)."""

    scheduling: str
    batch_size: int
    descriptor: str
    host_us: float
    host_p90_us: float
    host_cpu_us: float  # this thread's CPU time in the same regions (median)
    step_us: float
    engine_host_us: float | None
    engine_step_us: float | None
    gpu_us: float | None
    host_repeat_medians_us: list[float] = field(default_factory=list)  # per runner loop: shows drift


@dataclass
class HostResult:
    spec: HostSpec
    env: dict
    resolved_mode: str | None = None
    rows: list[HostRow] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict:
        return {"kind": "host", "spec": asdict(self.spec), "env": self.env, "resolved_mode": self.resolved_mode,
                "rows": [asdict(r) for r in self.rows], "error": self.error}


def run_host(spec: HostSpec, log: Log = print) -> HostResult:
    """Measure every (scheduling, batch size) of `spec`; a failure is recorded, not raised."""
    device = resolve_device(spec.device)
    result = HostResult(spec, env_info(device, spec.dtype))
    llm = None
    try:
        log(f"building {spec.model} on {device} ({spec.mode}, capture sizes {list(spec.batch_sizes)})")
        llm = _build_llm(spec, device)
        graphs = llm.runner.graphs
        result.resolved_mode = graphs.mode.name if graphs is not None and graphs.captured else "NONE"
        result.env["output_copy_stream"] = llm.runner.output_ring.copy_stream
        if spec.noop_step:
            _replace_step_with_noop(llm)
        settle = spec.settle_s if spec.settle_s is not None else (20.0 if device.type == "cuda" else 0.0)
        if settle > 0:
            log(f"settling the host: untimed decode loops for {settle:.0f} s")
            deadline = time.perf_counter() + settle
            while time.perf_counter() < deadline:
                _runner_loop(llm.runner, spec, spec.max_batch, spec.schedulings[0])
        for bs in spec.batch_sizes:
            result.rows += _measure_batch_size(llm, spec, bs, log)
    except Exception as e:  # the numbers measured so far still count
        result.error = f"{type(e).__name__}: {e}"
        logger.exception("bench host failed")
        log(f"  FAILED: {result.error}")
    finally:
        if llm is not None:
            llm.runner.shutdown()
        del llm
        release_memory(device)
    return result


def _build_llm(spec: HostSpec, device: torch.device) -> LLM:
    from graphrunner.engine.llm import LLM

    blocks_per_req = -(-spec.tokens_per_request // spec.block_size)
    compile_backend = spec.compile_backend or ("inductor" if device.type == "cuda" else "eager")
    return LLM(
        spec.model, dtype=spec.dtype, device=device, max_num_seqs=spec.max_batch, enable_prefix_caching=False,
        # Prefill every engine-loop request in a step or two (eagerly: FULL graphs
        # cover decodes only), so all of them decode together before any finishes.
        max_num_batched_tokens=min(max(spec.max_batch, spec.context, spec.max_batch * spec.context), 16384),
        max_model_len=blocks_per_req * spec.block_size,
        block_size=spec.block_size, seed=spec.seed, num_kv_blocks=1 + spec.max_batch * blocks_per_req,
        load_format=spec.load_format, enforce_eager=spec.mode.upper() == "NONE",
        cudagraph_mode=None if spec.mode.upper() == "NONE" else spec.mode,
        cudagraph_capture_sizes=spec.batch_sizes, compile_backend=compile_backend,
    )


def _replace_step_with_noop(llm: LLM) -> None:
    """Host path only: sampled tokens stay whatever the buffer holds (ignore_eos everywhere).
    Instance attributes shadow the methods; steady decoding replays FULL graphs directly."""
    graphs = llm.runner.graphs
    noops: list[tuple[object, str, Callable[..., None]]] = [
        (llm.runner.body, "run", lambda batch, piecewise=False: None)
    ]
    if graphs is not None:
        noops.append((graphs, "replay_full", lambda desc, features: None))
        noops += [(graph, "replay", lambda: None) for graph in graphs.full_graphs.values()]
    for owner, method, noop in noops:
        setattr(owner, method, noop)


def _measure_batch_size(llm: LLM, spec: HostSpec, bs: int, log: Log) -> list[HostRow]:
    """One row per scheduling at batch size `bs`; the runner loops of the schedulings interleave."""
    gpu = _gpu_step_us(llm.runner, spec, bs)
    samples: dict[str, tuple[list[float], list[float], list[float]]] = {s: ([], [], []) for s in spec.schedulings}
    repeat_medians: dict[str, list[float]] = {s: [] for s in spec.schedulings}
    for _ in range(spec.repeats):
        for scheduling in spec.schedulings:  # interleaved: drift of the host hits both alike
            loop = _runner_loop(llm.runner, spec, bs, scheduling)
            repeat_medians[scheduling].append(round(float(np.median(loop[0])) * 1e6, 1))
            for pooled, new in zip(samples[scheduling], loop, strict=True):
                pooled.extend(new)
    rows = []
    for scheduling in spec.schedulings:
        row = _measure(llm, spec, bs, scheduling, gpu, samples[scheduling])
        row.host_repeat_medians_us = repeat_medians[scheduling]
        rows.append(row)
        log(f"  {scheduling:<5} bs={bs:<4} host {row.host_us:7.1f} us/step (p90 {row.host_p90_us:.1f}, "
            f"cpu {row.host_cpu_us:.1f})  "
            f"step {row.step_us:8.1f} us  engine host {row.engine_host_us or float('nan'):7.1f} us  "
            f"gpu {row.gpu_us if row.gpu_us is not None else float('nan'):8.1f} us  [{row.descriptor}]  "
            f"per loop {row.host_repeat_medians_us}")
    return rows


# ---- runner loop ------------------------------------------------------------------------
def _admit(runner, spec: HostSpec, bs: int, tag: str) -> list[str]:
    """`bs` requests whose first step is already a decode at `context` (no prefill)."""
    req_ids = [f"host-{tag}-{bs}-{i}" for i in range(bs)]
    rng = np.random.default_rng(spec.seed + bs)
    bpr = runner.limits.max_num_blocks_per_req
    params = SamplingParams(max_tokens=spec.tokens_per_request, temperature=0.0, ignore_eos=True)
    so = SchedulerOutput(total_num_scheduled_tokens=bs)
    for i, rid in enumerate(req_ids):
        prompt = rng.integers(0, runner.vocab_size, size=spec.context).tolist()
        so.scheduled_new_reqs.append(NewRequestData(rid, prompt, params, list(range(1 + i * bpr, 1 + (i + 1) * bpr)),
                                                    spec.context - 1))
        so.num_scheduled_tokens[rid] = 1
    runner.execute_model(so)
    runner.sample_tokens(async_output=True).get()
    return req_ids


def _decode_plan(req_ids: list[str], computed: int) -> SchedulerOutput:
    so = SchedulerOutput(total_num_scheduled_tokens=len(req_ids))
    so.scheduled_cached_reqs.req_ids = list(req_ids)
    so.scheduled_cached_reqs.new_block_ids = [None] * len(req_ids)
    so.scheduled_cached_reqs.num_computed_tokens = [computed] * len(req_ids)
    so.num_scheduled_tokens = dict.fromkeys(req_ids, 1)
    return so


def _runner_loop(runner, spec: HostSpec, bs: int, scheduling: str) -> tuple[list[float], list[float], list[float]]:
    """Returns (host wall seconds, host CPU seconds, wall seconds per step) over the timed steps.

    Host CPU seconds are this thread's CPU time (`time.thread_time`) over the same
    regions: unlike the wall time they do not count time the thread was descheduled
    (a shared or virtualized host's noise), which is what "host CPU time" names.
    """
    req_ids = _admit(runner, spec, bs, scheduling)
    n = spec.warmup + spec.steps
    plans = [_decode_plan(req_ids, spec.context + i) for i in range(n)]
    lag = _LAG[scheduling]
    in_flight: list = []
    host, host_cpu, wall = [], [], []
    clock, cpu_clock = time.perf_counter, time.thread_time
    gc.collect()
    gc.disable()  # a collection inside a timed region is noise, not host overhead
    try:
        for i, so in enumerate(plans):
            t0, c0 = clock(), cpu_clock()
            runner.execute_model(so)
            in_flight.append(runner.sample_tokens(async_output=True))
            spent, spent_cpu = clock() - t0, cpu_clock() - c0
            if len(in_flight) > lag:
                out = in_flight.pop(0)
                _wait(out, spec.wait)  # the device's time, not the host's
                t2, c2 = clock(), cpu_clock()
                out.get()
                spent, spent_cpu = spent + clock() - t2, spent_cpu + cpu_clock() - c2
            if i >= spec.warmup:
                host.append(spent)
                host_cpu.append(spent_cpu)
                wall.append(clock() - t0)
        for out in in_flight:
            out.get()
    finally:
        gc.enable()
    runner.execute_model(SchedulerOutput(finished_req_ids=set(req_ids)))
    runner.sample_tokens()
    return host, host_cpu, wall


def _wait(out, how: str) -> None:
    """Until `out`'s copy has landed (untimed: the device's time)."""
    if how == "poll":
        while not out.is_ready():
            pass
    out.wait()


def _gpu_step_us(runner, spec: HostSpec, bs: int) -> float | None:
    """Device time of one decode step (CUDA events, synchronized pass); None on a CPU."""
    if runner.device.type != "cuda":
        return None
    req_ids = _admit(runner, spec, bs, "gpu")
    times = []
    for i in range(min(spec.steps, 20)):
        torch.cuda.synchronize(runner.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner.execute_model(_decode_plan(req_ids, spec.context + i))
        end.record()
        runner.sample_tokens()
        times.append(start.elapsed_time(end) * 1e3)
    runner.execute_model(SchedulerOutput(finished_req_ids=set(req_ids)))
    runner.sample_tokens()
    return float(np.median(times))


# ---- engine loop --------------------------------------------------------------------------
def _engine_loop(llm, spec: HostSpec, bs: int, scheduling: str) -> tuple[list[float], list[float]]:
    """schedule + execute + sample(async) + resolve, minus the copy wait, over pure-decode steps."""
    sched, runner = llm.scheduler, llm.runner
    rng = np.random.default_rng(spec.seed + 7 * bs)
    params = SamplingParams(max_tokens=spec.warmup + spec.steps + 2, temperature=0.0, ignore_eos=True)
    ids = [f"eng-{scheduling}-{bs}-{i}" for i in range(bs)]
    for rid in ids:
        sched.add_request(rid, rng.integers(0, runner.vocab_size, size=spec.context).tolist(), params)
    sched.async_scheduling = scheduling == "async"
    lag = _LAG[scheduling]
    in_flight: list = []
    host, wall = [], []
    decode_steps = 0
    gc.collect()
    gc.disable()
    try:
        while sched.has_unfinished_requests() or in_flight:
            t0 = time.perf_counter()
            so = sched.schedule() if sched.has_unfinished_requests() else None
            if so is not None and so.total_num_scheduled_tokens:
                runner.execute_model(so)
                in_flight.append((so, runner.sample_tokens(async_output=True)))
            elif so is not None and (so.finished_req_ids or so.preempted_req_ids):
                runner.execute_model(so)
            spent = time.perf_counter() - t0
            if in_flight and (len(in_flight) > lag or so is None or not so.total_num_scheduled_tokens):
                prev_so, out = in_flight.pop(0)
                _wait(out, spec.wait)
                t2 = time.perf_counter()
                sched.update_from_output(prev_so, out.get())
                spent += time.perf_counter() - t2
            is_decode = so is not None and so.total_num_scheduled_tokens == bs and not so.scheduled_new_reqs
            if is_decode:
                decode_steps += 1
                if decode_steps > spec.warmup:
                    host.append(spent)
                    wall.append(time.perf_counter() - t0)
    finally:
        gc.enable()
        sched.async_scheduling = False
    # Hand the runner its last finished requests (the scheduler reports them on the next plan).
    so = sched.schedule()
    if so.finished_req_ids:
        runner.execute_model(so)
    return host, wall


def _measure(llm, spec: HostSpec, bs: int, scheduling: str, gpu_us: float | None,
             runner_samples: tuple[list[float], list[float], list[float]]) -> HostRow:
    runner = llm.runner
    host, host_cpu, wall = runner_samples
    eng_host, eng_wall = _engine_loop(llm, spec, bs, scheduling)
    desc = runner.graphs.dispatch(bs, bs * runner.uniform_decode_query_len, runner.uniform_decode_query_len)
    h = Stats.of(host)
    return HostRow(
        scheduling=scheduling,
        batch_size=bs,
        descriptor=str(desc),
        host_us=h.median * 1e6,
        host_p90_us=h.p90 * 1e6,
        host_cpu_us=Stats.of(host_cpu).median * 1e6,
        step_us=Stats.of(wall).median * 1e6,
        engine_host_us=Stats.of(eng_host).median * 1e6 if eng_host else None,
        engine_step_us=Stats.of(eng_wall).median * 1e6 if eng_wall else None,
        gpu_us=gpu_us,
    )


# ---- rendering ----------------------------------------------------------------------------
_COLUMNS = (
    "scheduling", "bs", "host us", "host p90", "host cpu us", "step us", "engine host us", "engine step us", "gpu us",
    "descriptor",
)


def _cells(r: HostRow) -> list[str]:
    def f(x):
        return "n/a" if x is None else f"{x:.1f}"

    times = (r.host_us, r.host_p90_us, r.host_cpu_us, r.step_us, r.engine_host_us, r.engine_step_us, r.gpu_us)
    return [r.scheduling, str(r.batch_size), *(f(t) for t in times), r.descriptor]


def host_text(result: HostResult) -> str:
    rows = [list(_COLUMNS)] + [_cells(r) for r in result.rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    noop = (", no-op step body" if result.spec.noop_step else "") + f", {result.spec.wait} wait"
    fast_path = result.env.get("cuda_driver_fast_path")
    driver = ", driver fast path" if fast_path is True else ", torch CUDA calls" if fast_path is False else ""
    if result.env.get("output_copy_stream") is False:
        driver += ", output copies on the compute stream"
    where = f"{result.spec.model} on {result.env.get('device_name')}"
    lines = [f"bench host: {where} ({result.resolved_mode}{noop}{driver})"]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    if result.error:
        lines.append(f"error: {result.error}")
    return "\n".join(lines)


def host_markdown(result: HostResult) -> str:
    lines = [f"## Host time per decode step: {result.spec.model} ({result.resolved_mode})", "",
             f"Device: {result.env.get('device_name')}, torch {result.env.get('torch')}, CUDA calls through "
             f"{'the driver fast path' if result.env.get('cuda_driver_fast_path') else 'torch'}. "
             "host = wall time inside execute_model + sample_tokens + output resolve, excluding the copy wait; "
             "host cpu = the thread's CPU time in the same regions (medians).", "",
             "| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in result.rows]
    if result.error:
        lines += ["", f"Error: {result.error}"]
    return "\n".join(lines) + "\n"
