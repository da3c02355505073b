"""`bench soak`: the reference engine under continuous request churn for M minutes.

One `LLM` (FULL_AND_PIECEWISE graphs, default capture sizes) is driven step by step as a
server would: `Scheduler.add_request` (after the checks `LLM.generate` runs per prompt),
`LLM.step()`, `Scheduler.abort_request`. The seeded workload keeps 2 x max_num_seqs
requests live, with random lengths (prompt + max_tokens <= max_model_len) and a random mix
of every sampling feature (greedy; temperature, top-k, top-p, min-p; penalties; logit_bias;
allowed_token_ids; min_tokens with stop_token_ids; logprobs; prompt_logprobs), half seeded.
The default KV cache holds a quarter of max_num_seqs max-length requests: it preempts.

An *abort* is a client going away: with probability `abort_fraction` a request draws an
engine step (1 to its total length after submission) at which, if still live (waiting,
running or preempted), `Scheduler.abort_request` drops it; its output so far comes back
with finish_reason "abort" and the runner frees its row on the next step. Every finished
output is checked (`check_output`): lengths, allowed_token_ids, stop/EOS only last and not
before min_tokens, one logprobs entry per token, complete prompt logprobs.

Every `report_every_s` a `SoakRow`; the first closes the warm-up and is the memory
baseline. Then a probe (a fixed prompt, greedy and seeded sampled) runs on the soaked
engine and, once that is shut down, on a fresh engine of the same config. Failures (exit
1): allocated device memory above the baseline by more than `max_growth_mib`, a
recapture, recompile or graph-count change, a probe mismatch, a broken output, an error.
"""

from __future__ import annotations

import heapq
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from graphrunner.protocol import SamplingParams
from graphrunner_tools.bench.common import default_compile_backend, env_info, release_memory, resolve_device

if TYPE_CHECKING:
    from graphrunner.engine.llm import LLM
    from graphrunner.engine.request import RequestOutput, SequenceOutput

logger = logging.getLogger("graphrunner.bench")

Log = Callable[[str], None]
MIB = float(1 << 20)
CUDA_MODEL = "builtin:qwen2.5-0.5b"
CPU_MODEL = "builtin:tiny-llama"
_MAX_OUTPUT_ERRORS = 20  # kept in the result; the count covers them all


@dataclass(frozen=True)
class SoakSpec:
    """What `run_soak` runs."""

    model: str | None = None  # None: CUDA_MODEL on CUDA, CPU_MODEL on a CPU
    minutes: float = 10.0
    report_every_s: float = 60.0
    max_growth_mib: float = 64.0
    abort_fraction: float = 0.1
    mode: str = "FULL_AND_PIECEWISE"
    capture_sizes: tuple[int, ...] | None = None  # None: the runner's default ladder
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int = 1024
    num_kv_blocks: int | None = None  # None: a quarter of max_num_seqs max-length requests
    async_scheduling: bool = False
    dtype: str = "auto"
    device: str | None = None
    block_size: int = 16
    compile_backend: str | None = None  # None: inductor on CUDA, eager on CPU
    load_format: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.capture_sizes is not None:
            object.__setattr__(self, "capture_sizes", tuple(self.capture_sizes))
        for name in ("minutes", "report_every_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if not 0.0 <= self.abort_fraction <= 1.0:
            raise ValueError(f"abort_fraction={self.abort_fraction} must be in [0, 1]")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2 (a prompt and an output token)")
        if self.num_kv_blocks is not None and self.num_kv_blocks < self.blocks_per_request:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} is less than one max_model_len request's "
                             f"{self.blocks_per_request} blocks")

    @property
    def blocks_per_request(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def kv_blocks(self) -> int:
        """The KV cache: given, or room for a quarter of max_num_seqs max-length requests."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        return max(self.blocks_per_request, -(-self.max_num_seqs * self.blocks_per_request // 4))


@dataclass
class SoakRow:
    elapsed_s: float
    steps: int
    allocated_mib: float  # torch.cuda.memory_allocated (0 on a CPU)
    reserved_mib: float  # torch.cuda.memory_reserved (0 on a CPU)
    rss_mib: float  # process resident set size
    graphs: int  # FULL graphs + PIECEWISE captured sizes, as capture() made them (not the lazy variants)
    recaptures: int  # StepGraphs.generation changes since the start
    recompiles: int  # dynamo graphs compiled since the start
    preemptions: int
    finished: int  # stop or length, so far
    aborted: int  # so far
    live: int  # waiting + running now
    output_tokens: int  # generated so far (finished, aborted and live requests)
    tok_per_s: float  # output tokens/s over the interval since the previous row


@dataclass
class SoakResult:
    spec: SoakSpec
    env: dict
    model: str
    num_kv_blocks: int
    resolved_mode: str | None = None
    rows: list[SoakRow] = field(default_factory=list)
    memory_growth_mib: float | None = None
    output_errors: list[str] = field(default_factory=list)
    num_output_errors: int = 0
    probe_soaked: list[list[int]] | None = None
    probe_fresh: list[list[int]] | None = None
    error: str | None = None
    failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def probe_matched(self) -> bool:
        return self.probe_soaked is not None and self.probe_soaked == self.probe_fresh

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(kind="soak", rows=[asdict(r) for r in self.rows], probe_matched=self.probe_matched,
                    passed=not self.failures)
        return data


# ---- workload --------------------------------------------------------------------------
@dataclass
class _Limits:
    """What the runner accepts per request (its slot counts) and the model's EOS ids."""

    vocab: int
    max_model_len: int
    eos_ids: tuple[int, ...]
    max_logit_bias: int
    max_stop_ids: int
    max_logprobs: int


class Workload:
    """The seeded request stream: lengths, sampling settings and abort steps."""

    def __init__(self, seed: int, limits: _Limits, abort_fraction: float) -> None:
        self.rng = np.random.default_rng(seed)
        self.limits = limits
        self.abort_fraction = abort_fraction
        self.params: dict[str, SamplingParams] = {}  # live requests' settings, for the output checks
        self.aborts: list[tuple[int, str]] = []  # heap of (engine step, req_id)
        self.num_submitted = 0

    def next_request(self, step: int) -> tuple[str, list[int], SamplingParams]:
        """A new request, remembered until `finish`; it may get an abort step."""
        rng, lim = self.rng, self.limits
        total = int(rng.integers(2, lim.max_model_len + 1))
        prompt_len = int(rng.integers(1, total))
        prompt = rng.integers(0, lim.vocab, size=prompt_len).tolist()
        req_id = f"soak-{self.num_submitted}"
        self.num_submitted += 1
        params = random_params(rng, total - prompt_len, lim)
        self.params[req_id] = params
        if rng.random() < self.abort_fraction:
            heapq.heappush(self.aborts, (step + int(rng.integers(1, total + 1)), req_id))
        return req_id, prompt, params

    def due_aborts(self, step: int) -> list[str]:
        due = []
        while self.aborts and self.aborts[0][0] <= step:
            due.append(heapq.heappop(self.aborts)[1])
        return due


def random_params(rng: np.random.Generator, max_tokens: int, lim: _Limits) -> SamplingParams:
    """Random settings: each feature on with its own probability, half of them seeded."""
    kw: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": bool(rng.random() < 0.5)}
    if rng.random() < 0.25:
        kw["temperature"] = 0.0
    else:
        kw["temperature"] = float(rng.uniform(0.3, 1.5))
        if rng.random() < 0.5:
            kw["top_k"] = int(rng.integers(1, 65))
        if rng.random() < 0.5:
            kw["top_p"] = float(rng.uniform(0.5, 1.0))
        if rng.random() < 0.3:
            kw["min_p"] = float(rng.uniform(0.0, 0.2))
    if rng.random() < 0.3:
        kw.update(repetition_penalty=float(rng.uniform(0.8, 1.5)), frequency_penalty=float(rng.uniform(-1, 1)),
                  presence_penalty=float(rng.uniform(-1, 1)))
    if rng.random() < 0.2:
        ids = rng.choice(lim.vocab, size=int(rng.integers(1, min(8, lim.max_logit_bias) + 1)), replace=False)
        kw["logit_bias"] = {int(t): float(rng.uniform(-5, 5)) for t in ids}
    if rng.random() < 0.25:
        eos = () if kw["ignore_eos"] else lim.eos_ids
        room = max(0, min(4, lim.max_stop_ids - len(eos)))
        kw["stop_token_ids"] = tuple(int(t) for t in rng.choice(lim.vocab, size=int(rng.integers(0, room + 1))))
        kw["min_tokens"] = int(rng.integers(0, max_tokens + 1))
    if rng.random() < 0.15:
        allowed = {int(t) for t in rng.choice(lim.vocab, size=int(rng.integers(1, 65)))}
        enders = set(kw.get("stop_token_ids", ())) | (set() if kw["ignore_eos"] else set(lim.eos_ids))
        if allowed <= enders:  # leave min_tokens a token to draw
            allowed.add(next(t for t in range(lim.vocab) if t not in enders))
        kw["allowed_token_ids"] = tuple(sorted(allowed))
    if rng.random() < 0.2:
        kw["logprobs"] = int(rng.integers(0, min(5, lim.max_logprobs) + 1))
    if rng.random() < 0.1:
        kw["prompt_logprobs"] = int(rng.integers(0, min(3, lim.max_logprobs) + 1))
    if rng.random() < 0.5:
        kw["seed"] = int(rng.integers(0, 2**31))
    return SamplingParams(**kw)


def check_output(out: RequestOutput | SequenceOutput, params: SamplingParams, lim: _Limits) -> str | None:
    """What is wrong with a finished output, or None."""
    toks, n = out.token_ids, len(out.token_ids)
    enders = set(params.stop_token_ids) | (set() if params.ignore_eos else set(lim.eos_ids))
    problems = []
    if out.finish_reason not in ("stop", "length", "abort"):
        problems.append(f"finish_reason {out.finish_reason!r}")
    if n > params.max_tokens or len(out.prompt_token_ids) + n > lim.max_model_len:
        problems.append(f"{n} tokens > max_tokens {params.max_tokens} or past max_model_len")
    if out.finish_reason == "length" and n != params.max_tokens and len(out.prompt_token_ids) + n != lim.max_model_len:
        problems.append(f"finish 'length' at {n} of max_tokens {params.max_tokens}")
    if params.allowed_token_ids is not None and not set(toks) <= set(params.allowed_token_ids):
        problems.append(f"tokens {sorted(set(toks) - set(params.allowed_token_ids))[:5]} not allowed")
    early = [i for i, t in enumerate(toks) if t in enders and (i < params.min_tokens or i != n - 1)]
    if early:
        problems.append(f"stop/EOS token at position {early[0]} (min_tokens {params.min_tokens}, {n} tokens)")
    if out.finish_reason == "stop" and (not toks or toks[-1] not in enders):
        problems.append("finish 'stop' without a stop/EOS token last")
    if params.logprobs is not None:
        lps = out.logprobs or []
        if len(lps) != n or any(t not in lp for t, lp in zip(toks, lps, strict=False)):
            problems.append(f"{len(lps)} logprobs entries for {n} tokens (or the sampled token missing)")
    if params.prompt_logprobs is not None and out.finish_reason != "abort":
        plps = out.prompt_logprobs or []
        if len(plps) != len(out.prompt_token_ids):
            problems.append(f"{len(plps)} prompt logprobs for a prompt of {len(out.prompt_token_ids)}")
    return f"request {out.req_id}: " + "; ".join(problems) if problems else None


# ---- the loop ----------------------------------------------------------------------------
@dataclass
class _Counters:
    steps: int = 0
    finished: int = 0
    aborted: int = 0
    finished_tokens: int = 0
    output_errors: list[str] = field(default_factory=list)
    num_output_errors: int = 0

    def record(self, out: RequestOutput | SequenceOutput, workload: Workload) -> None:
        params = workload.params.pop(out.req_id)
        if out.finish_reason == "abort":
            self.aborted += 1
        else:
            self.finished += 1
        self.finished_tokens += len(out.token_ids)
        problem = check_output(out, params, workload.limits)
        if problem is not None:
            self.num_output_errors += 1
            if len(self.output_errors) < _MAX_OUTPUT_ERRORS:
                self.output_errors.append(problem)


def _graph_state(llm: LLM) -> tuple[int, int, int]:
    """(graph generation, FULL graphs + PIECEWISE captured sizes, dynamo graphs compiled). A variant
    captured on its first use (lazy all-features graphs) is by design, once per descriptor, not a
    recapture: the count is of the graphs `capture()` made."""
    graphs, compiled = llm.runner.graphs, llm.runner.body.compiled
    if graphs is None:
        return 0, 0, 0
    pieces = 0 if compiled is None else len(compiled.captured_sizes)
    up_front = len(graphs.full_graphs) - graphs.captured_on_first_use + pieces
    return graphs.generation, up_front, 0 if compiled is None else compiled.num_graphs_compiled


def _rss_mib() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB
    except (OSError, ValueError, IndexError):
        return 0.0


def _submit(llm: LLM, workload: Workload, step: int) -> None:
    req_id, prompt, params = workload.next_request(step)
    llm._check_request(req_id, prompt, params)  # what generate checks before queueing a prompt
    llm.scheduler.add_request(req_id, prompt, params)


def _make_row(llm: LLM, c: _Counters, base: tuple[int, int, int], elapsed: float, prev: SoakRow | None) -> SoakRow:
    cuda = llm.device.type == "cuda"
    generation, graphs, compiled = _graph_state(llm)
    live = llm.scheduler.requests.values()
    tokens = c.finished_tokens + sum(r.num_output_tokens for r in live)
    prev_s, prev_tokens = (prev.elapsed_s, prev.output_tokens) if prev is not None else (0.0, 0)
    return SoakRow(
        elapsed_s=round(elapsed, 3), steps=c.steps,
        allocated_mib=torch.cuda.memory_allocated(llm.device) / MIB if cuda else 0.0,
        reserved_mib=torch.cuda.memory_reserved(llm.device) / MIB if cuda else 0.0,
        rss_mib=_rss_mib(), graphs=graphs, recaptures=generation - base[0], recompiles=compiled - base[2],
        preemptions=llm.scheduler.num_preemptions, finished=c.finished, aborted=c.aborted, live=len(live),
        output_tokens=tokens, tok_per_s=(tokens - prev_tokens) / max(elapsed - prev_s, 1e-9),
    )


def soak_loop(llm: LLM, spec: SoakSpec, workload: Workload, rows: list[SoakRow], log: Log) -> _Counters:
    """Churn until `spec.minutes` are up, appending a row to `rows` every `spec.report_every_s`
    (so that an engine error keeps the rows before it); ends with no request live."""
    base = _graph_state(llm)
    target_live = 2 * spec.max_num_seqs
    c = _Counters()
    log(format_row(None))
    start = time.perf_counter()
    next_row, deadline = start + spec.report_every_s, start + spec.minutes * 60
    while True:
        while llm.scheduler.num_unfinished_requests < target_live:
            _submit(llm, workload, c.steps)
        for out in llm.step():
            c.record(out, workload)
        c.steps += 1
        for req_id in workload.due_aborts(c.steps):
            aborted = llm.scheduler.abort_request(req_id)
            if aborted is not None:  # else it had finished already
                c.record(aborted, workload)
        now = time.perf_counter()
        if now >= next_row or now >= deadline:
            rows.append(_make_row(llm, c, base, now - start, rows[-1] if rows else None))
            log(format_row(rows[-1]))
            while next_row <= now:
                next_row += spec.report_every_s
        if now >= deadline:
            break
    for req_id in list(llm.scheduler.requests):  # not counted: the soak is over
        llm.scheduler.abort_request(req_id)
    llm.step()  # resolves a step still in flight (async scheduling); nothing to run otherwise
    workload.params.clear()
    return c


# ---- engine, probe, verdict ----------------------------------------------------------------
def _build_llm(spec: SoakSpec, device: torch.device, model: str) -> LLM:
    from graphrunner.engine.llm import LLM

    eager = spec.mode.upper() == "NONE"
    return LLM(
        model, dtype=spec.dtype, device=device, max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens, max_model_len=spec.max_model_len,
        block_size=spec.block_size, seed=spec.seed, num_kv_blocks=spec.kv_blocks, load_format=spec.load_format,
        enforce_eager=eager, async_scheduling=spec.async_scheduling,
        cudagraph_mode=None if eager else spec.mode,
        cudagraph_capture_sizes=None if eager else spec.capture_sizes,
        compile_backend=spec.compile_backend or default_compile_backend(device),
    )


def probe(llm: LLM) -> list[list[int]]:
    """A fixed prompt, once greedy and once seeded sampled (ignore_eos: full length)."""
    max_len, vocab = llm.runner.max_model_len, llm.vocab_size
    prompt_len = min(32, max_len // 2)
    n = min(32, max_len - prompt_len)
    prompt = [(7 * i + 3) % vocab for i in range(prompt_len)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=n, temperature=0.8, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)]
    return [list(o.token_ids) for o in llm.generate([prompt, prompt], params)]


def _limits(llm: LLM) -> _Limits:
    states = llm.runner.sampling_states
    return _Limits(vocab=llm.vocab_size, max_model_len=llm.runner.max_model_len,
                   eos_ids=tuple(llm.runner.eos_token_ids), max_logit_bias=states.max_logit_bias,
                   max_stop_ids=states.max_stop_ids, max_logprobs=states.max_logprobs)


def run_soak(spec: SoakSpec, log: Log = print) -> SoakResult:
    """Soak, probe the soaked engine, probe a fresh one, judge; failures are recorded, not raised."""
    device = resolve_device(spec.device)
    model = spec.model or (CUDA_MODEL if device.type == "cuda" else CPU_MODEL)
    result = SoakResult(spec, env_info(device, spec.dtype), model, spec.kv_blocks)
    try:
        _soak_and_probe(spec, device, result, log)
        if result.error is None:
            log("probe on a fresh engine of the same config")
            fresh = _build_llm(spec, device, model)
            try:
                result.probe_fresh = probe(fresh)
            finally:
                fresh.shutdown()
                del fresh
    except Exception as e:
        result.error = f"{type(e).__name__}: {e}"
        logger.exception("bench soak failed")
    finally:
        release_memory(device)
    judge(result)
    return result


def _soak_and_probe(spec: SoakSpec, device: torch.device, result: SoakResult, log: Log) -> None:
    log(f"building {result.model} on {device} ({spec.mode}, {result.num_kv_blocks} KV blocks of {spec.block_size})")
    llm = _build_llm(spec, device, result.model)
    try:
        graphs = llm.runner.graphs
        result.resolved_mode = graphs.mode.name if graphs is not None and graphs.captured else "NONE"
        workload = Workload(spec.seed, _limits(llm), spec.abort_fraction)
        log(f"soaking for {spec.minutes:g} min, a row every {spec.report_every_s:g} s")
        counters = soak_loop(llm, spec, workload, result.rows, log)
        result.output_errors, result.num_output_errors = counters.output_errors, counters.num_output_errors
        log("probe on the soaked engine")
        result.probe_soaked = probe(llm)
    finally:
        llm.shutdown()
        del llm
        release_memory(device)


def judge(result: SoakResult) -> None:
    """Fill `failures` (each a reason for a non-zero exit) and `warnings`."""
    rows, spec, fail = result.rows, result.spec, result.failures
    if result.error is not None:
        fail.append(f"engine error: {result.error}")
    if len(rows) >= 2:
        result.memory_growth_mib = max(r.allocated_mib for r in rows[1:]) - rows[0].allocated_mib
        if result.memory_growth_mib > spec.max_growth_mib:
            fail.append(f"allocated memory grew {result.memory_growth_mib:.1f} MiB over the first row "
                        f"(tolerance --max-growth-mib {spec.max_growth_mib:g})")
    elif rows:
        result.warnings.append("one row only: memory growth not checked (--minutes longer than --report-every-s)")
    if any(r.recaptures or r.recompiles for r in rows) or len({r.graphs for r in rows}) > 1:
        last = rows[-1]
        fail.append(f"graphs recaptured or recompiled during the soak: {last.recaptures} generation changes, "
                    f"{last.recompiles} dynamo recompiles, graph counts {sorted({r.graphs for r in rows})}")
    if result.num_output_errors:
        fail.append(f"{result.num_output_errors} finished outputs broke a check, first: {result.output_errors[0]}")
    if result.error is None and not result.probe_matched:
        fail.append(f"probe mismatch: soaked engine {result.probe_soaked}, fresh engine {result.probe_fresh}")
    if rows and rows[-1].preemptions == 0:
        result.warnings.append("no preemption happened: lower --num-kv-blocks")


# ---- output ------------------------------------------------------------------------------
_COLUMNS = tuple(f.name for f in fields(SoakRow))


def _cells(row: SoakRow) -> list[str]:
    return [f"{v:.1f}" if isinstance(v, float) else str(v) for v in (getattr(row, c) for c in _COLUMNS)]


def format_row(row: SoakRow | None) -> str:
    """One row as fixed-width text; None: the header."""
    return " ".join(f"{c:>13}" for c in (_COLUMNS if row is None else _cells(row)))


def soak_markdown(result: SoakResult) -> str:
    spec = result.spec
    lines = [f"# bench soak: {result.model} on {result.env.get('device_name')}", "",
             f"{spec.minutes:g} min, {result.resolved_mode}, max_num_seqs {spec.max_num_seqs}, max_model_len "
             f"{spec.max_model_len}, {result.num_kv_blocks} KV blocks, abort fraction {spec.abort_fraction:g}, "
             f"seed {spec.seed}", "",
             "| " + " | ".join(_COLUMNS) + " |", "|" + "---:|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in result.rows]
    lines += ["", verdict(result)]
    return "\n".join(lines) + "\n"


def verdict(result: SoakResult) -> str:
    growth = "n/a" if result.memory_growth_mib is None else f"{result.memory_growth_mib:.1f} MiB"
    head = (f"memory growth {growth} (tolerance {result.spec.max_growth_mib:g} MiB), probe "
            f"{'matched' if result.probe_matched else 'MISMATCHED'}: ")
    if not result.failures:
        return head + "PASS"
    return head + "FAIL\n" + "\n".join(f"- {f}" for f in result.failures)
