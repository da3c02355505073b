"""`bench spec`: speculative decoding against plain decoding, FULL graphs.

Per model, one runner at a time (built for the largest batch, its graphs captured at
exactly the benchmarked decode batches, shut down before the next):

- plain (k = 0): the steady decode step;
- synthetic (each k of `num_spec`, each rate of `acceptance`): the n-gram drafter with
  `rejection_sample_method="synthetic"`, which accepts each draft slot with the given
  probability whatever the models say (dummy weights accept almost nothing): the
  verifying step's cost and what a given acceptance buys;
- draft (each k and rate, where the model has a draft model): the draft-model drafter
  (`method="draft_model"`, dummy weights of its own) with the same synthetic acceptance:
  what the draft model's catch-up pass and k one-token passes cost inside the step.
  `draft_model` picks it: "auto" the builtin sharing the target's vocabulary
  (`DEFAULT_DRAFT_MODELS`), "none" none, else that model for every target whose
  vocabulary it shares (the others are skipped with a note);
- strict n-gram (k = `ngram_k`): real verification on a repetitive workload (each
  prompt one random pattern repeated), for the drafter's real acceptance. The weights
  are dummy (random), so this acceptance says what the runner does with what the
  model emits, not what a trained model would accept.

Every runner serves every batch size: the batch's prompts are prefilled (chunked, eager),
then `warmup` untimed and `steps` timed synchronous decode steps run, then `gpu_steps`
steps timed with CUDA events, then the drafter alone (`spec_driver` has the timers and
says how a draft model gets its lookahead KV blocks; `spec_report` says what each figure
is and checks the targets).

The default mode is FULL_DECODE_ONLY: a verifying batch of b requests is a uniform
decode (q = 1 + k tokens each) and replays the uniform-decode FULL graph (t = b * q,
r = b); single-routine FULL has no uniform-decode graphs and would serve it from a mixed
FULL graph padded to min(b * q, max_num_seqs) request entries (k + 1 logits rows each).
Prefill steps run eagerly either way and are not timed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from capture.modes import CUDAGraphMode
from graphrunner.config import SpeculativeConfig
from graphrunner_tools.bench.common import (
    Stats,
    build_runner_config,
    default_compile_backend,
    env_info,
    release_memory,
    resolve_device,
)
from graphrunner_tools.bench.spec_driver import (
    FIRST_REQUEST_BLOCK,
    DecodeDriver,
    DeviceTimer,
    drafter_seconds,
    gpu_step_seconds,
    spin_seconds,
    timed_loop,
)
from graphrunner_tools.bench.spec_report import NOTES, TARGET_MODEL, Target, row_line, spec_markdown, targets

logger = logging.getLogger("graphrunner.bench")

Log = Callable[[str], None]
# `draft_model="auto"`: a target's draft model, a builtin sharing its vocabulary.
DEFAULT_DRAFT_MODELS: Mapping[str, str] = MappingProxyType({
    "builtin:llama-3.1-8b": "builtin:llama-3.2-1b",
    "builtin:tiny-llama": "builtin:tiny-llama",  # drafts for itself (the CPU test's model)
})
# Tokens per prefill step (the eager chunks before the decode steps).
_PREFILL_TOKENS = 2048
# Headroom past the last decode step and its k lookahead tokens, in tokens.
_LEN_MARGIN = 16


@dataclass(frozen=True)
class SpecBenchSpec:
    """What `run_spec_bench` measures."""

    models: tuple[str, ...] = (TARGET_MODEL, "builtin:qwen2.5-0.5b")
    batch_sizes: tuple[int, ...] = (1, 8, 64)
    num_spec: tuple[int, ...] = (2, 4)
    acceptance: tuple[float, ...] = (0.8,)
    ngram_k: int = 4  # k of the strict n-gram run; 0 skips it
    draft_model: str = "auto"  # "auto": DEFAULT_DRAFT_MODELS; "none": no draft runs; else a model for every target
    heads: str = "auto"  # EAGLE heads: "auto": builtin:eagle3-NAME of a builtin target; "none"; else comma-separated
    steps: int = 64
    warmup: int = 8
    gpu_steps: int = 20
    drafter_repeats: int = 100
    prompt_len: int = 512
    pattern_len: int = 16  # the repeated pattern of the strict run's prompts
    mode: str = "FULL_DECODE_ONLY"
    device: str | None = None
    dtype: str = "auto"
    block_size: int = 16
    compile_backend: str | None = None  # None: inductor on CUDA, eager on CPU
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("models", "batch_sizes", "num_spec", "acceptance"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
            if not getattr(self, name):
                raise ValueError(f"{name} must not be empty")
        if any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch_sizes={list(self.batch_sizes)} must each be >= 1")
        for k in (*self.num_spec, *((self.ngram_k,) if self.ngram_k else ())):
            SpeculativeConfig(num_speculative_tokens=k, method="ngram")  # raises naming k and its range
        if self.ngram_k < 0 or 0 in self.num_spec:
            raise ValueError(f"num_spec={list(self.num_spec)} and ngram_k={self.ngram_k}: k >= 1 (ngram_k 0 skips)")
        for a in self.acceptance:
            if not 0.0 <= a <= 1.0:
                raise ValueError(f"acceptance rate {a} must be in [0, 1]")
        for name in ("steps", "prompt_len", "pattern_len", "drafter_repeats", "gpu_steps", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup} must be >= 0")
        if CUDAGraphMode.parse_capturing(self.mode).decode_mode is not CUDAGraphMode.FULL:
            raise ValueError(f"mode={self.mode!r}: decode steps must run as FULL graphs (FULL, FULL_DECODE_ONLY, "
                             "FULL_AND_PIECEWISE)")
        if self.draft_model not in ("auto", "none"):
            model_vocab_size(self.draft_model)  # raises naming an unknown draft model


def model_vocab_size(model: str) -> int:
    """`model`'s vocabulary size from its config (a builtin's or a folder's config.json)."""
    from graphrunner.models.loader import load_model_config

    try:
        return load_model_config(model).vocab_size
    except (OSError, KeyError) as e:  # a folder without a readable config.json
        raise ValueError(f"model {model!r}: {type(e).__name__}: {e}") from None


@dataclass(frozen=True)
class DraftChoice:
    """A target's draft-model runs: the draft model, or None and why not."""

    model: str | None
    note: str


def choose_draft_model(target: str, option: str) -> DraftChoice:
    """`option` ("auto", "none" or a model) applied to `target`: a draft model only when the
    vocabularies match (the drafts are target token ids)."""
    if option == "none":
        return DraftChoice(None, "none (--draft-model none)")
    draft = DEFAULT_DRAFT_MODELS.get(target) if option == "auto" else option
    if draft is None:
        return DraftChoice(None, f"none: no default draft model for {target} (--draft-model names one)")
    target_vocab, draft_vocab = model_vocab_size(target), model_vocab_size(draft)
    if draft_vocab != target_vocab:
        return DraftChoice(None, f"none: {draft} skipped, its vocab_size {draft_vocab} is not the target's "
                                 f"{target_vocab} (a draft model must share the target's vocabulary)")
    return DraftChoice(draft, f"{draft} ({'the default' if option == 'auto' else '--draft-model'})")


HEAD_METHODS = ("eagle", "eagle3")


def head_method(head: str) -> str:
    """The speculative method of a head: its builtin name, or its folder's architecture."""
    from graphrunner.engine.options import infer_speculative_method

    method = infer_speculative_method(head)
    if method not in HEAD_METHODS:
        raise ValueError(f"head {head!r} is not an EAGLE head (builtin:eagle-NAME, builtin:eagle3-NAME or a "
                         "head folder)")
    return method


def choose_heads(target: str, option: str) -> tuple[list[str], str]:
    """`option` applied to `target`: the EAGLE heads of its head runs, and a note."""
    from graphrunner.models.eagle import load_head_config
    from graphrunner.models.loader import load_model_config

    if option == "none":
        return [], "none (--heads none)"
    wanted = ([f"builtin:eagle3-{target.removeprefix('builtin:')}"] if target.startswith("builtin:") else []) \
        if option == "auto" else [h.strip() for h in option.split(",") if h.strip()]
    heads, skipped = [], []
    for head in wanted:
        try:
            load_head_config(head, head_method(head)).check_target(load_model_config(target))
            heads.append(head)
        except (OSError, ValueError) as e:
            skipped.append(f"{head} skipped: {e}")
    return heads, "; ".join(heads + skipped) or "none"


@dataclass(frozen=True)
class Run:
    """One runner configuration: plain, synthetic n-gram, synthetic draft model, or strict n-gram."""

    method: str  # "plain" | "synthetic" | "draft" | "eagle" | "eagle3" | "strict"
    k: int = 0
    acceptance: float | None = None  # synthetic, draft and head runs
    draft: str | None = None  # draft: the draft model; eagle, eagle3: the head

    @property
    def label(self) -> str:
        if self.method == "plain":
            return "plain"
        if self.method == "synthetic":
            return f"synthetic {self.acceptance:g}, k={self.k}"
        if self.method == "draft":
            assert self.draft is not None
            return f"draft {Path(self.draft.removeprefix('builtin:')).name} synth {self.acceptance:g}, k={self.k}"
        if self.method in HEAD_METHODS:
            assert self.draft is not None
            head = Path(self.draft.removeprefix("builtin:")).name
            return f"{self.method} {head} synth {self.acceptance:g}, k={self.k}"
        return f"n-gram strict, k={self.k}"

    def speculative(self) -> dict[str, Any] | None:
        if self.method == "plain":
            return None
        synthetic = {"rejection_sample_method": "synthetic", "synthetic_acceptance_rate": self.acceptance}
        if self.method == "draft":
            return {"method": "draft_model", "model": self.draft, "num_speculative_tokens": self.k, **synthetic}
        if self.method in HEAD_METHODS:
            return {"method": self.method, "model": self.draft, "num_speculative_tokens": self.k, **synthetic}
        config: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": self.k, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 4}
        return {**config, **synthetic} if self.method == "synthetic" else config

    def expected_tokens_per_step(self) -> float | None:
        """Synthetic acceptance: slot i is reached with probability a^i, so 1 + a + ... + a^k tokens."""
        if self.method == "plain":
            return 1.0
        if self.method in ("synthetic", "draft", *HEAD_METHODS):
            assert self.acceptance is not None
            return float(sum(self.acceptance ** i for i in range(self.k + 1)))
        return None


def runs_of(spec: SpecBenchSpec, draft: str | None = None, heads: Sequence[str] = ()) -> list[Run]:
    """A model's runners, in order; `draft`: its draft model (None: no draft runs); `heads`: its EAGLE heads."""
    runs = [Run("plain")]
    runs += [Run("synthetic", k, a) for k in spec.num_spec for a in spec.acceptance]
    if draft is not None:
        runs += [Run("draft", k, a, draft) for k in spec.num_spec for a in spec.acceptance]
    runs += [Run(head_method(h), k, a, h) for h in heads for k in spec.num_spec for a in spec.acceptance]
    if spec.ngram_k:
        runs.append(Run("strict", spec.ngram_k))
    return runs


@dataclass
class RunnerInfo:
    """One runner: what it resolved to and what building it cost."""

    model: str
    run: str
    resolved_mode: str | None = None
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    load_seconds: float | None = None  # load_model + KV cache
    compile_seconds: float | None = None  # the model compiled for the graphs (inside capture_model)
    capture_seconds: float | None = None
    num_graphs: int | None = None
    error: str | None = None


@dataclass
class SpecRow:
    """One (model, batch size, runner) measurement. Times in milliseconds."""

    model: str
    batch_size: int
    run: str
    method: str
    k: int
    acceptance: float | None
    draft_model: str | None  # draft rows: the draft model
    descriptor: str  # the graph the timed decode steps ran
    mean_context: float  # mean sequence length over the timed steps
    step: dict  # Stats of the step wall times, ms
    gpu_step: dict | None  # Stats of the GPU step times, ms (None on a CPU)
    gpu_clean_fraction: float | None  # GPU step and drafter spans whose spin outlasted the host's launches
    drafter: dict | None  # Stats of the drafter's times, ms (None: plain)
    tokens_per_step: float
    expected_tokens_per_step: float | None
    tokens_per_s: float
    drafts_per_step: float | None
    accepted_per_step: float | None
    acceptance_rate: float | None
    proposed_per_step: float | None  # drafts proposed per request per timed step (None: plain)
    step_ms: float = 0.0
    gpu_step_ms: float | None = None
    drafter_ms: float | None = None
    step_vs_plain: float | None = None
    gpu_step_vs_plain: float | None = None
    tokens_per_s_vs_plain: float | None = None


@dataclass
class SpecBenchResult:
    spec: SpecBenchSpec
    env: dict
    runners: list[RunnerInfo] = field(default_factory=list)
    rows: list[SpecRow] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    drafts: dict[str, DraftChoice] = field(default_factory=dict)  # per model: its draft model, or why none

    @property
    def errors(self) -> list[str]:
        return [f"{r.model} {r.run}: {r.error}" for r in self.runners if r.error]

    def to_dict(self) -> dict:
        return {
            "kind": "spec",
            "spec": asdict(self.spec),
            "env": self.env,
            "notes": list(NOTES),
            "runners": [asdict(r) for r in self.runners],
            "rows": [asdict(r) for r in self.rows],
            "targets": [asdict(t) for t in self.targets],
            "draft_models": {model: asdict(choice) for model, choice in self.drafts.items()},
        }


def run_spec_bench(spec: SpecBenchSpec, log: Log = print,
                   checkpoint: Callable[[SpecBenchResult], None] | None = None) -> SpecBenchResult:
    """Measure every (model, runner, batch size) of `spec`. A runner that fails is recorded, not raised.
    `checkpoint` gets the result so far after each runner (a killed run keeps what it measured)."""
    device = resolve_device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the runners' stream and the timer's events: the same device
    result = SpecBenchResult(spec, env_info(device, spec.dtype))
    result.drafts = {model: choose_draft_model(model, spec.draft_model) for model in spec.models}
    timer = DeviceTimer(device) if device.type == "cuda" else None
    for model in spec.models:
        log(f"{model}: draft model {result.drafts[model].note}")
        heads, note = choose_heads(model, spec.heads)
        log(f"{model}: EAGLE heads {note}")
        for run in runs_of(spec, result.drafts[model].model, heads):
            _run_one(spec, model, run, device, timer, result, log)
            add_ratios(result.rows)
            result.targets = targets(result.rows)
            if checkpoint is not None:
                checkpoint(result)
    return result


def _run_one(spec: SpecBenchSpec, model: str, run: Run, device, timer: DeviceTimer | None, result: SpecBenchResult,
             log: Log) -> None:
    """Build one runner, measure every batch size on it, shut it down; a failure is recorded."""
    info = RunnerInfo(model, run.label)
    result.runners.append(info)
    runner = None
    try:
        runner = _build_runner(spec, model, run, device, info, log)
        for bs in spec.batch_sizes:
            row = _measure(runner, spec, model, run, bs, timer)
            result.rows.append(row)
            log(row_line(row))
    except Exception as e:  # one broken runner must not hide the others' numbers
        info.error = f"{type(e).__name__}: {e}"
        logger.exception("bench spec: %s %s failed", model, run.label)
        log(f"  {model} {run.label}: FAILED: {info.error}")
    finally:
        if runner is not None:
            runner.shutdown()
        del runner
        release_memory(device)


def max_model_len(spec: SpecBenchSpec, k: int) -> int:
    """Room for the prompt, every decode step at q = 1 + k tokens and, past the last, k
    lookahead tokens (a draft model's passes), in whole blocks."""
    tokens = spec.prompt_len + (spec.warmup + spec.steps + spec.gpu_steps) * (1 + k) + k + _LEN_MARGIN
    return -(-tokens // spec.block_size) * spec.block_size


def _build_runner(spec: SpecBenchSpec, model: str, run: Run, device, info: RunnerInfo, log: Log):
    """A runner for the largest batch, every request's blocks held from admission, FULL
    graphs captured at exactly the decode batches (b * q tokens)."""
    from graphrunner.runner import ModelRunner

    q, max_batch = 1 + run.k, max(spec.batch_sizes)
    length = max_model_len(spec, run.k)
    num_blocks = FIRST_REQUEST_BLOCK + max_batch * (length // spec.block_size)
    config = build_runner_config(
        model, mode=CUDAGraphMode.parse(spec.mode), dtype=spec.dtype, max_num_seqs=max_batch,
        max_num_batched_tokens=max(max_batch * q, _PREFILL_TOKENS), max_model_len=length,
        block_size=spec.block_size, num_blocks=num_blocks, capture_sizes=[b * q for b in spec.batch_sizes],
        compile_backend=spec.compile_backend or default_compile_backend(device), seed=spec.seed,
    ).replace(speculative=SpeculativeConfig.from_dict(run.speculative()))
    info.max_model_len, info.num_kv_blocks = length, num_blocks
    log(f"{model} {run.label}: building on {device} ({num_blocks} KV blocks x {spec.block_size} tokens)")
    start = time.perf_counter()
    runner = ModelRunner(config, device)
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_kv_blocks())  # the fixed count from the config
    info.load_seconds = time.perf_counter() - start
    assert runner.graphs is not None
    info.resolved_mode = runner.graphs.mode.name
    report = runner.capture_model(progress=False)
    info.compile_seconds, info.capture_seconds = report.compile_seconds, report.total_seconds
    info.num_graphs = report.num_graphs
    log(f"{model} {run.label}: loaded in {info.load_seconds:.1f} s, compiled in {report.compile_seconds:.1f} s, "
        f"captured {report.num_graphs} graphs in {report.total_seconds:.2f} s")
    return runner


def prompts_of(spec: SpecBenchSpec, bs: int, vocab_size: int, repetitive: bool) -> list[list[int]]:
    """Random prompts; `repetitive`: each one random pattern of `pattern_len` repeated."""
    rng = np.random.default_rng(spec.seed + bs)
    if not repetitive:
        return [rng.integers(0, vocab_size, size=spec.prompt_len).tolist() for _ in range(bs)]
    reps = -(-spec.prompt_len // spec.pattern_len)
    return [np.tile(rng.integers(0, vocab_size, size=spec.pattern_len), reps)[: spec.prompt_len].tolist()
            for _ in range(bs)]


def _measure(runner, spec: SpecBenchSpec, model: str, run: Run, bs: int, timer: DeviceTimer | None) -> SpecRow:
    strict = run.method == "strict"
    driver = DecodeDriver(runner, prompts_of(spec, bs, runner.vocab_size, strict), f"{bs}", strict=strict)
    driver.prefill()
    loop = timed_loop(driver, spec.warmup, spec.steps)
    spin = spin_seconds(loop.execute)
    clean0, total0 = (timer.clean, timer.total) if timer is not None else (0, 0)
    gpu = gpu_step_seconds(driver, timer, spec.gpu_steps, spin) if timer is not None else []
    drafter = drafter_seconds(runner, timer, spec.drafter_repeats, spin) if run.k else []
    driver.finish()
    clean = None if timer is None or timer.total == total0 else (timer.clean - clean0) / (timer.total - total0)
    verifying = run.k > 0
    return SpecRow(
        model=model, batch_size=bs, run=run.label, method=run.method, k=run.k, acceptance=run.acceptance,
        draft_model=run.draft, descriptor=loop.descriptor, mean_context=loop.mean_context,
        step=_ms(loop.wall), gpu_step=_ms(gpu) if gpu else None,
        gpu_clean_fraction=clean,
        drafter=_ms(drafter) if drafter else None,
        tokens_per_step=loop.tokens / loop.request_steps, expected_tokens_per_step=run.expected_tokens_per_step(),
        tokens_per_s=loop.tokens / sum(loop.wall),
        drafts_per_step=loop.drafted / loop.request_steps if verifying else None,
        accepted_per_step=loop.accepted / loop.request_steps if verifying else None,
        acceptance_rate=loop.accepted / loop.drafted if verifying and loop.drafted else None,
        proposed_per_step=loop.proposed / loop.request_steps if verifying else None,
    )


def _ms(seconds: list[float]) -> dict:
    return {name: v * 1e3 if name != "n" else v for name, v in Stats.of(seconds).to_dict().items()}


def add_ratios(rows: list[SpecRow]) -> None:
    """Medians as plain fields, and each row's figures over its plain row's (same model and batch)."""
    plain = {(r.model, r.batch_size): r for r in rows if r.method == "plain"}
    for r in rows:
        r.step_ms = r.step["median"]
        r.gpu_step_ms = r.gpu_step["median"] if r.gpu_step else None
        r.drafter_ms = r.drafter["median"] if r.drafter else None
    for r in rows:
        p = plain.get((r.model, r.batch_size))
        if p is None:
            continue
        r.step_vs_plain = r.step_ms / p.step_ms
        if r.gpu_step_ms is not None and p.gpu_step_ms:
            r.gpu_step_vs_plain = r.gpu_step_ms / p.gpu_step_ms
        r.tokens_per_s_vs_plain = r.tokens_per_s / p.tokens_per_s


__all__ = ["DEFAULT_DRAFT_MODELS", "NOTES", "DraftChoice", "Run", "SpecBenchResult", "SpecBenchSpec", "SpecRow",
           "Target", "add_ratios", "choose_draft_model", "choose_heads", "max_model_len", "model_vocab_size",
           "prompts_of", "run_spec_bench", "runs_of", "spec_markdown", "targets"]
