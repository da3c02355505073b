"""The hand-driven loops behind `bench spec`: one runner, one batch of requests, timed steps.

`DecodeDriver` schedules a batch the way an engine with speculative decoding does: a
chunked prefill of every prompt, then uniform decode steps in which each request is
scheduled q = `runner.uniform_decode_query_len` tokens (1 + k: the last sampled token
and k draft placeholders the runner reads on the device); after each output a request's
computed count advances by the tokens it emitted (accepted drafts + 1).

Every request holds the blocks of a max_model_len request from admission on, so a draft
model always has KV slots for its k lookahead tokens past the new one (what an engine's
scheduler reserves with `num_lookahead_tokens`) as long as the request stays k tokens
below max_model_len (`spec_bench.max_model_len` leaves that room).

Three measurements run over a driver (`spec_report` names every figure):
- `timed_loop`: synchronous steps, `execute_model` + `sample_tokens` on the host clock;
- `gpu_step_seconds`: CUDA events around `execute_model` alone, the stream held busy by a
  spin kernel while the host launches the step, so the span is the device's work only;
- `drafter_seconds`: the drafter (`SpeculativeStep.propose`) alone on the last batch; a
  draft model's eager passes launch many kernels, so its spin is sized to them.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import numpy as np
import torch

from graphrunner.protocol import NewRequestData, SamplingParams, SchedulerOutput
from graphrunner_tools.bench.common import synchronize

# KV block 0 is what capture's dummy steps write; benchmark requests start after it.
FIRST_REQUEST_BLOCK = 1
# The spin kernel holds the stream at least this long, and 4x the host's execute_model time.
_MIN_SPIN_S = 2e-3
_SPIN_FACTOR = 4
_CALIBRATION_CYCLES = 10_000_000
# Untimed drafter calls whose host time sizes the drafter's spin.
_LAUNCH_SAMPLES = 3


class StepCounts(NamedTuple):
    """One step's output, summed over its requests."""

    tokens: int  # tokens emitted
    drafted: int  # draft slots verified
    accepted: int  # drafts accepted
    proposed: int  # drafts proposed for the next step


@dataclass
class LoopStats:
    """What `timed_loop` saw over its timed steps."""

    wall: list[float]  # per step: execute_model + sample_tokens, seconds
    execute: list[float]  # per step: execute_model alone (host), seconds
    tokens: int  # tokens emitted by all requests
    request_steps: int  # requests x timed steps
    drafted: int  # draft slots verified (proposed by the drafter, up to k per request and step)
    accepted: int  # drafts accepted
    proposed: int  # drafts the drafter proposed for the next step (its output's draft token ids)
    mean_context: float  # mean sequence length a timed step's requests attend over
    descriptor: str  # the graph key the timed steps ran with


class DecodeDriver:
    """`prompts` admitted as one batch of greedy requests, each with its own block range.

    `max_model_len` bounds every request; the runner's KV cache must hold
    `FIRST_REQUEST_BLOCK + len(prompts) * max_num_blocks_per_req` blocks. `strict`: the
    runner verifies only the drafts its drafter proposed (else synthetic: every slot).
    """

    def __init__(self, runner, prompts: list[list[int]], tag: str, strict: bool = False) -> None:
        self.runner = runner
        self.strict = strict
        self.req_ids = [f"spec-{tag}-{i}" for i in range(len(prompts))]
        self.prompt_lens = [len(p) for p in prompts]
        self.computed = [0] * len(prompts)
        self.drafts = dict.fromkeys(self.req_ids, 0)  # draft ids the next step verifies, per request
        self._prompts = prompts

    @property
    def batch_size(self) -> int:
        return len(self.req_ids)

    def prefill(self) -> None:
        """Admit the batch and run its prompts in chunks of at most max_num_batched_tokens."""
        runner = self.runner
        bpr = runner.limits.max_num_blocks_per_req
        params = SamplingParams(max_tokens=runner.max_model_len, temperature=0.0, ignore_eos=True)
        admitted = [False] * self.batch_size
        while any(c < n for c, n in zip(self.computed, self.prompt_lens, strict=True)):
            so = SchedulerOutput()
            budget = runner.limits.max_num_tokens
            for i, rid in enumerate(self.req_ids):
                n = min(self.prompt_lens[i] - self.computed[i], budget)
                if n == 0:
                    continue
                budget -= n
                if admitted[i]:
                    self._schedule_cached(so, i)
                else:
                    blocks = list(range(FIRST_REQUEST_BLOCK + i * bpr, FIRST_REQUEST_BLOCK + (i + 1) * bpr))
                    so.scheduled_new_reqs.append(NewRequestData(rid, self._prompts[i], params, blocks, 0))
                    admitted[i] = True
                so.num_scheduled_tokens[rid] = n
            so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
            self.advance(so, self.step(so))

    def decode_output(self) -> SchedulerOutput:
        """One uniform decode step: q tokens for every request."""
        so = SchedulerOutput()
        q = self.runner.uniform_decode_query_len
        for i, rid in enumerate(self.req_ids):
            if self.runner.max_model_len - self.computed[i] < q:
                raise RuntimeError(f"{rid} reached max_model_len={self.runner.max_model_len}: size it larger")
            self._schedule_cached(so, i)
            so.num_scheduled_tokens[rid] = q
        so.total_num_scheduled_tokens = q * self.batch_size
        return so

    def advance(self, so: SchedulerOutput, out) -> StepCounts:
        """Bookkeeping after a step's output, and what it emitted, verified, accepted and proposed."""
        q = self.runner.uniform_decode_query_len
        tokens = drafted = accepted = 0
        index = {rid: i for i, rid in enumerate(self.req_ids)}
        for rid, toks in zip(out.req_ids, out.sampled_token_ids, strict=True):
            i, n = index[rid], so.num_scheduled_tokens[rid]
            decoding = self.computed[i] >= self.prompt_lens[i]
            if decoding and not 1 <= len(toks) <= n:
                raise RuntimeError(f"decode step of {n} tokens gave {rid} {len(toks)} tokens: {toks}")
            if decoding and n > 1:  # a verifying step: the last token and the accepted drafts
                verified = min(self.drafts[rid], q - 1) if self.strict else q - 1
                drafted, accepted = drafted + verified, accepted + len(toks) - 1
                if len(toks) - 1 > verified:
                    raise RuntimeError(f"{rid} accepted {len(toks) - 1} drafts of {verified} verified")
            self.computed[i] += len(toks) if decoding else n
            tokens += len(toks)
        drafts = self.runner.take_draft_token_ids()
        self.drafts = dict.fromkeys(self.req_ids, 0)
        if drafts is not None:
            self.drafts.update((rid, len(d)) for rid, d in zip(drafts.req_ids, drafts.draft_token_ids, strict=True))
        return StepCounts(tokens, drafted, accepted, sum(self.drafts.values()))

    def finish(self) -> None:
        self.runner.execute_model(SchedulerOutput(finished_req_ids=set(self.req_ids)))
        self.runner.sample_tokens()

    def _schedule_cached(self, so: SchedulerOutput, i: int) -> None:
        cached = so.scheduled_cached_reqs
        cached.req_ids.append(self.req_ids[i])
        cached.new_block_ids.append(None)
        cached.num_computed_tokens.append(self.computed[i])

    def step(self, so: SchedulerOutput):
        """Run `so` synchronously; its ModelRunnerOutput."""
        self.runner.execute_model(so)
        return self.runner.sample_tokens()


def timed_loop(driver: DecodeDriver, warmup: int, steps: int) -> LoopStats:
    """`warmup` untimed decode steps, then `steps` timed ones (synchronous: each step's
    output is taken before the next is scheduled). Building the SchedulerOutput and the
    bookkeeping are not timed: they are the engine's cost."""
    runner = driver.runner
    for _ in range(warmup):
        so = driver.decode_output()
        driver.advance(so, driver.step(so))
    wall, execute, context = [], [], []
    counts = StepCounts(0, 0, 0, 0)
    clock = time.perf_counter
    gc.collect()
    gc.disable()  # a collection inside a timed step is noise
    try:
        for _ in range(steps):
            so = driver.decode_output()
            context.append(float(np.mean(driver.computed)) + runner.uniform_decode_query_len)
            synchronize(runner.device)
            t0 = clock()
            runner.execute_model(so)
            t1 = clock()
            out = runner.sample_tokens()  # the D2H copy of the step's tokens: the step is done
            t2 = clock()
            wall.append(t2 - t0)
            execute.append(t1 - t0)
            counts = StepCounts(*(a + b for a, b in zip(counts, driver.advance(so, out), strict=True)))
    finally:
        gc.enable()
    return LoopStats(wall, execute, counts.tokens, driver.batch_size * steps, counts.drafted, counts.accepted,
                     counts.proposed, float(np.mean(context)), str(runner.last_descriptor))


class DeviceTimer:
    """CUDA-event spans of host calls with the stream held busy by a spin kernel while the
    host launches them, so a span is the device's work for the call and never host time.

    `clean` counts the spans whose spin outlasted the host's launches (the start event had
    not fired when the call returned); a span that is not clean includes host time."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cycles_per_s = self._calibrate()
        self.clean = 0
        self.total = 0

    def _calibrate(self) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)  # load the kernel before timing it
        start.record()
        torch.cuda._sleep(_CALIBRATION_CYCLES)
        end.record()
        end.synchronize()
        return _CALIBRATION_CYCLES / (start.elapsed_time(end) / 1e3)

    def span(self, fn: Callable[[], None], spin_s: float) -> float:
        """Seconds of device work `fn` enqueues on the current stream."""
        torch.cuda.synchronize(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(spin_s * self.cycles_per_s))
        start.record()
        fn()
        end.record()
        self.clean += not start.query()
        self.total += 1
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def spin_seconds(host_execute: list[float]) -> float:
    """How long the spin kernel must hold the stream: several times the host's launch time."""
    return max(_MIN_SPIN_S, _SPIN_FACTOR * float(np.median(host_execute)))


def gpu_step_seconds(driver: DecodeDriver, timer: DeviceTimer, steps: int, spin_s: float) -> list[float]:
    """Device time of `steps` decode steps: events around `execute_model` (state commit,
    upload, the FULL graph replay with the drafter inside), not the output copy."""
    runner, times = driver.runner, []
    for _ in range(steps):
        so = driver.decode_output()
        times.append(timer.span(partial(runner.execute_model, so), spin_s))
        driver.advance(so, runner.sample_tokens())
    return times


def drafter_seconds(runner, timer: DeviceTimer | None, repeats: int, spin_s: float) -> list[float]:
    """The drafter alone, `repeats` times on the last step's batch: `SpeculativeStep.propose`
    run eagerly (CUDA: device time by `timer`, the spin at least `spin_s` and several times
    the drafter's own launch time; CPU: host clock). It recomputes the same proposals (and a
    draft model the same KV) from the same history each time, so the runner's state is
    unchanged."""
    spec, batch = runner.body.spec, runner.body.current_batch
    if spec is None or batch is None:
        return []

    def propose() -> None:
        spec.propose(batch)

    times = []
    with torch.inference_mode():
        propose()  # warm-up (Triton compilation on first use)
        if timer is not None:
            spin_s = max(spin_s, spin_seconds(_launch_seconds(propose, timer.device, _LAUNCH_SAMPLES)))
        for _ in range(repeats):
            if timer is not None:
                times.append(timer.span(propose, spin_s))
            else:
                t0 = time.perf_counter()
                propose()
                times.append(time.perf_counter() - t0)
    return times


def _launch_seconds(fn: Callable[[], None], device: torch.device, samples: int) -> list[float]:
    """Host time of `fn` from an idle device to its return (its launches), `samples` times."""
    times = []
    for _ in range(samples):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    synchronize(device)
    return times


__all__ = ["FIRST_REQUEST_BLOCK", "DecodeDriver", "DeviceTimer", "LoopStats", "StepCounts", "drafter_seconds",
           "gpu_step_seconds", "spin_seconds", "timed_loop"]
