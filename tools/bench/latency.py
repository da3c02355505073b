"""`bench latency`: decode step time per (mode, batch size), beside the bandwidth roofline.

For each mode one runner is built (sized for the largest batch), captured, and reused
for every batch size; it is shut down before the next mode so that a large model fits
several times in sequence. For each batch size, `bs` requests are admitted with
`context` prompt tokens of which `context - 1` are already "computed", so the very first
step is a decode at sequence length `context` and no prefill runs. The KV cache is
filled with random values first (never time on zeros); its contents are otherwise
meaningless, which is fine for timing.

A timed step is `execute_model` + `sample_tokens` (which ends with the D2H copy of the
sampled tokens, i.e. a host sync), measured on the host clock after a synchronize, so
it includes the runner's CPU overhead — the cost CUDA graphs remove. On CUDA, CUDA
events recorded just before `execute_model` and just after the sync give a device-side
span too; it differs from the host figure by the host work done before the first launch
(and shows whether the host clock itself is trustworthy).

LoRA (`num_loras` adapters of rank `lora_rank` on all seven projections, random PEFT folders written
to a temporary folder): each batch size is measured twice on the same runner, first with no adapter
(the plain graphs), then with request i running adapter i mod num_loras (the LoRA graphs, captured at
the same sizes); the LoRA row carries its time over the base row's.
"""

from __future__ import annotations

import gc
import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from capture.modes import CUDAGraphMode
from graphrunner.config import KV_CACHE_DTYPES, KernelConfig, LoRAConfig
from graphrunner.protocol import LoRARequest, NewRequestData, SamplingParams, SchedulerOutput
from graphrunner_tools.bench.common import (
    Stats,
    build_runner_config,
    default_compile_backend,
    element_size,
    env_info,
    release_memory,
    resolve_device,
    synchronize,
)
from graphrunner_tools.bench.roofline import (
    Bandwidth,
    decode_roofline,
    expected_active_experts,
    kv_bytes_per_token,
    measure_copy_bandwidth,
    weight_bytes_read,
)

logger = logging.getLogger("graphrunner.bench")

# Headroom past the last timed step, in tokens: no step ever runs at max_model_len.
_LEN_MARGIN = 16
# KV block 0 is what capture's dummy steps write; benchmark requests start after it.
_FIRST_REQUEST_BLOCK = 1

Log = Callable[[str], None]


@dataclass(frozen=True)
class LatencySpec:
    """What `run_latency` measures.

    capture_sizes: None captures exactly the benchmarked batch sizes (each batch replays
    a graph of its own size, no padding, quick capture); "default" takes the runner's
    default ladder; a tuple gives explicit sizes.
    """

    model: str = "builtin:qwen2.5-0.5b"
    batch_sizes: tuple[int, ...] = (1, 8, 32, 128, 256)
    context: int = 1024
    modes: tuple[str, ...] = ("NONE", "PIECEWISE", "FULL")
    dtype: str = "auto"
    device: str | None = None
    steps: int = 50
    warmup: int = 5
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # CacheConfig.cache_dtype: "auto" (the model's dtype), "fp8", "fp8_e4m3"
    capture_sizes: tuple[int, ...] | str | None = None
    compile_backend: str | None = None  # None: inductor on CUDA, eager on CPU
    load_format: str = "auto"
    seed: int = 0
    copy_bytes: int | None = None  # None: 2 GiB on CUDA, 128 MiB on CPU
    random_kv: bool = True
    kernel: KernelConfig = field(default_factory=KernelConfig)  # the runner's kernel choices
    num_loras: int = 0  # > 0: also measure each batch with this many distinct dummy adapters
    lora_rank: int = 16
    quantization: str | None = None  # "fp8": e4m3 linear weights (LLM's quantization)

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_sizes", tuple(self.batch_sizes))
        object.__setattr__(self, "modes", tuple(self.modes))
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch_sizes={list(self.batch_sizes)} must be non-empty, each >= 1")
        if not self.modes:
            raise ValueError("modes must name at least one mode")
        for m in self.modes:
            CUDAGraphMode.parse(m)  # raises naming the value and the allowed set
        if self.context < 1:
            raise ValueError(f"context={self.context} must be >= 1")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be >= 1")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup} must be >= 0")
        if self.num_loras < 0 or self.lora_rank < 1:
            raise ValueError(f"num_loras={self.num_loras} must be >= 0 and lora_rank={self.lora_rank} >= 1")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; allowed: "
                             f"{list(KV_CACHE_DTYPES)}")
        if isinstance(self.capture_sizes, str) and self.capture_sizes != "default":
            raise ValueError(f"capture_sizes={self.capture_sizes!r}; allowed: None, 'default', or a tuple of ints")

    @property
    def max_batch(self) -> int:
        return max(self.batch_sizes)

    @property
    def tokens_per_request(self) -> int:
        """Sequence length a request reaches: context, one admission step, warmup, timed steps, margin."""
        return self.context + 1 + self.warmup + self.steps + _LEN_MARGIN

    def mean_timed_seq_len(self) -> float:
        """Mean tokens each request's attention reads over the timed steps.

        The admission step reads `context` tokens; each later step one more.
        """
        first = self.context + 1 + self.warmup
        return first + (self.steps - 1) / 2


@dataclass
class ModeInfo:
    """One mode's runner: what it resolved to and what building it cost."""

    mode: str
    resolved_mode: str | None = None
    load_seconds: float | None = None
    capture_seconds: float | None = None
    num_graphs: int | None = None
    pool_bytes: int | None = None
    error: str | None = None
    kv_cache_dtype: str | None = None  # the KV cache's storage dtype, e.g. "bfloat16", "float8_e4m3fn"


@dataclass
class LatencyRow:
    """One (mode, batch size) measurement. Times in milliseconds."""

    mode: str
    batch_size: int
    context: int
    descriptor: str  # the graph key the batch dispatched to (shows a padding or a fallback)
    median_ms: float
    p90_ms: float
    mean_ms: float
    min_ms: float
    device_median_ms: float | None  # CUDA events around the same region; None on CPU
    tokens_per_s: float
    mean_seq_len: float
    weight_bytes: int
    kv_bytes: int
    roofline_ms: float
    roofline_fraction: float  # roofline / measured median
    # Mixture of experts: distinct experts per sparse layer the roofline counts (EXPERT_FORMULA).
    active_experts: float | None = None
    num_loras: int = 0  # distinct adapters in the batch (0: the base model)
    lora_over_base: float | None = None  # this row's median over the same batch's base row's


@dataclass
class LatencyResult:
    spec: LatencySpec
    env: dict
    bandwidth: Bandwidth
    modes: list[ModeInfo] = field(default_factory=list)
    rows: list[LatencyRow] = field(default_factory=list)

    @property
    def errors(self) -> list[str]:
        return [f"{m.mode}: {m.error}" for m in self.modes if m.error]

    def to_dict(self) -> dict:
        return {
            "kind": "latency",
            "spec": asdict(self.spec),
            "env": self.env,
            "bandwidth": self.bandwidth.to_dict(),
            "modes": [asdict(m) for m in self.modes],
            "rows": [asdict(r) for r in self.rows],
        }


def run_latency(spec: LatencySpec, log: Log = print) -> LatencyResult:
    """Measure every (mode, batch size) of `spec`. A mode that fails is recorded, not raised."""
    device = resolve_device(spec.device)
    bandwidth = measure_copy_bandwidth(device, spec.copy_bytes)
    release_memory(device)  # hand the probe's buffers back before the first runner
    log(f"copy bandwidth: {bandwidth.bytes_per_s / 1e9:.1f} GB/s ({bandwidth.method})")
    result = LatencyResult(spec, env_info(device, spec.dtype), bandwidth)
    adapters = tempfile.TemporaryDirectory(prefix="graphrunner-lora-") if spec.num_loras else None
    loras = _dummy_adapters(spec, adapters.name, log) if adapters is not None else []
    try:
        for mode_name in spec.modes:
            _run_mode(spec, mode_name, device, bandwidth, loras, result, log)
    finally:
        if adapters is not None:
            adapters.cleanup()
    return result


def _dummy_adapters(spec: LatencySpec, folder: str, log: Log) -> list[LoRARequest]:
    """`num_loras` random PEFT adapters of rank `lora_rank` on every projection of the model."""
    from graphrunner.layers.lora.peft import write_dummy_adapter
    from graphrunner.models.loader import load_model_config

    config = load_model_config(spec.model)
    log(f"writing {spec.num_loras} dummy LoRA adapters of rank {spec.lora_rank} (all seven projections)")
    return [LoRARequest(f"dummy{i}", i + 1, write_dummy_adapter(f"{folder}/a{i}", config, spec.lora_rank, seed=i))
            for i in range(spec.num_loras)]


def _run_mode(spec: LatencySpec, mode_name: str, device: torch.device, bandwidth: Bandwidth,
              loras: list[LoRARequest], result: LatencyResult, log: Log) -> None:
    """One mode's runner and every batch size (base, then with adapters when `loras`)."""
    mode = CUDAGraphMode.parse(mode_name)
    info = ModeInfo(mode.name)
    result.modes.append(info)
    runner = None
    try:
        runner = _build_runner(spec, mode, device, log)
        _prepare_runner(runner, spec, mode, info, log)
        for bs in spec.batch_sizes:
            base = None
            for batch_loras in ([[], loras] if loras else [[]]):
                row = _measure_batch(runner, spec, mode, bs, bandwidth, batch_loras)
                if base is not None:
                    row.lora_over_base = row.median_ms / base.median_ms
                base = base or row
                result.rows.append(row)
                log(
                    f"  {mode.name:<9} bs={bs:<4} {row.median_ms:8.3f} ms/step (p90 {row.p90_ms:.3f})  "
                    f"{row.tokens_per_s:10.1f} tok/s  {100 * row.roofline_fraction:5.1f}% of roofline  "
                    + ("" if row.active_experts is None else f"({row.active_experts:.1f} experts/layer)  ")
                    + ("" if row.lora_over_base is None else
                       f"{row.num_loras} adapters: {row.lora_over_base:.3f}x base  ")
                    + f"[{row.descriptor}]"
                )
    except Exception as e:  # one broken mode must not hide the others' numbers
        info.error = f"{type(e).__name__}: {e}"
        logger.exception("bench latency: mode %s failed", mode.name)
        log(f"  {mode.name}: FAILED: {info.error}")
    finally:
        if runner is not None:
            runner.shutdown()
        del runner
        release_memory(device)


def _build_runner(spec: LatencySpec, mode: CUDAGraphMode, device: torch.device, log: Log):
    """A runner sized for the largest batch: every request holds all its blocks from admission."""
    from graphrunner.runner import ModelRunner

    blocks_per_req = -(-spec.tokens_per_request // spec.block_size)
    num_blocks = _FIRST_REQUEST_BLOCK + spec.max_batch * blocks_per_req
    if spec.capture_sizes is None:
        capture_sizes = spec.batch_sizes
    elif spec.capture_sizes == "default":
        capture_sizes = None
    else:
        capture_sizes = tuple(spec.capture_sizes)  # type: ignore[arg-type]
    config = build_runner_config(
        spec.model,
        mode=mode,
        dtype=spec.dtype,
        max_num_seqs=spec.max_batch,
        # Decode steps schedule one token per request; the buffers need no more.
        max_num_batched_tokens=max(spec.max_batch, max(capture_sizes or (1,))),
        max_model_len=blocks_per_req * spec.block_size,
        block_size=spec.block_size,
        kv_cache_dtype=spec.kv_cache_dtype,
        num_blocks=num_blocks,
        capture_sizes=capture_sizes,
        compile_backend=spec.compile_backend or default_compile_backend(device),
        load_format=spec.load_format,
        seed=spec.seed,
        kernel=spec.kernel,
        quantization=spec.quantization,
        # LoRA graphs at the same sizes as the plain ones: each batch compares like with like.
        lora=LoRAConfig(max_loras=spec.num_loras, max_lora_rank=spec.lora_rank,
                        lora_capture_sizes=tuple(capture_sizes) if capture_sizes else None)
        if spec.num_loras else None,
    )
    log(f"{mode.name}: building {spec.model} on {device} ({num_blocks} KV blocks x {spec.block_size} tokens, "
        f"KV {spec.kv_cache_dtype})")
    return ModelRunner(config, device)


def _prepare_runner(runner, spec: LatencySpec, mode: CUDAGraphMode, info: ModeInfo, log: Log) -> None:
    """Load, allocate the cache, capture, fill the cache with random values."""
    start = time.perf_counter()
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_kv_blocks())  # the fixed count from the config
    info.load_seconds = time.perf_counter() - start
    assert runner.graphs is not None
    info.resolved_mode = runner.graphs.mode.name
    info.kv_cache_dtype = str(runner.kv_cache_dtype).removeprefix("torch.")
    if mode is not CUDAGraphMode.NONE:
        report = runner.capture_model(progress=False)
        info.capture_seconds = report.total_seconds
        info.num_graphs = report.num_graphs
        info.pool_bytes = report.pool_bytes
        log(f"{mode.name}: captured {report.num_graphs} graphs in {report.total_seconds:.2f} s")
    if spec.random_kv:
        gen = torch.Generator(device=runner.device).manual_seed(spec.seed)
        with torch.inference_mode():
            for cache in runner.buffers.kv_caches:
                if cache.dtype.itemsize == 1:  # fp8 has no normal_: draw in fp32, one layer at a time
                    cache.copy_(torch.randn(cache.shape, generator=gen, device=cache.device))
                else:
                    cache.normal_(generator=gen)


def _measure_batch(runner, spec: LatencySpec, mode: CUDAGraphMode, bs: int, bandwidth: Bandwidth,
                   loras: list[LoRARequest]) -> LatencyRow:
    req_ids = _admit(runner, spec, bs, loras)
    wall, dev = _timed_decode_steps(runner, spec, req_ids)
    runner.execute_model(SchedulerOutput(finished_req_ids=set(req_ids)))
    runner.sample_tokens()

    assert runner.graphs is not None
    q = runner.uniform_decode_query_len
    desc = runner.graphs.dispatch(bs, bs * q, q, has_lora=bool(loras))
    stats = Stats.of(wall)
    assert runner.model is not None
    elem = element_size(runner.kv_cache_dtype)  # the KV cache's storage dtype: 1 byte for fp8
    mean_seq = spec.mean_timed_seq_len()
    roof = decode_roofline(
        weight_bytes_read(runner.model, runner.model_config, bs),
        kv_bytes_per_token(runner.model_config, elem),
        bs * mean_seq,
        bandwidth,
    )
    return LatencyRow(
        mode=mode.name,
        batch_size=bs,
        context=spec.context,
        descriptor=str(desc),
        median_ms=stats.median * 1e3,
        p90_ms=stats.p90 * 1e3,
        mean_ms=stats.mean * 1e3,
        min_ms=stats.min * 1e3,
        device_median_ms=Stats.of(dev).median * 1e3 if dev else None,
        tokens_per_s=bs / stats.median,
        mean_seq_len=mean_seq,
        weight_bytes=roof.weight_bytes,
        kv_bytes=roof.kv_bytes,
        roofline_ms=roof.seconds * 1e3,
        roofline_fraction=roof.fraction_of(stats.median),
        active_experts=None if (moe := runner.model_config.moe) is None else expected_active_experts(
            moe.num_experts, moe.num_experts_per_tok, bs),
        num_loras=min(len(loras), bs),
    )


def _admit(runner, spec: LatencySpec, bs: int, loras: list[LoRARequest] | None = None) -> list[str]:
    """Admit `bs` requests with `context` tokens each, whose first step is already a decode; request i
    runs adapter i mod len(loras) (none without `loras`)."""
    req_ids = [f"bench-{bs}-{i}{'-lora' if loras else ''}" for i in range(bs)]
    blocks_per_req = runner.limits.max_num_blocks_per_req
    rng = np.random.default_rng(spec.seed + bs)
    params = SamplingParams(max_tokens=spec.tokens_per_request, temperature=0.0, ignore_eos=True)
    admit = SchedulerOutput(total_num_scheduled_tokens=bs)
    for i, rid in enumerate(req_ids):
        first = _FIRST_REQUEST_BLOCK + i * blocks_per_req
        prompt = rng.integers(0, runner.vocab_size, size=spec.context).tolist()
        blocks = list(range(first, first + blocks_per_req))
        lora = loras[i % len(loras)] if loras else None
        admit.scheduled_new_reqs.append(NewRequestData(rid, prompt, params, blocks, spec.context - 1,
                                                       lora_request=lora))
        admit.num_scheduled_tokens[rid] = 1
    # Admission is itself a decode at `context`: untimed, like the warmup steps after it.
    _step(runner, admit, bs)
    gc.collect()  # start the timed loop with no garbage from admission pending
    return req_ids


def _timed_decode_steps(runner, spec: LatencySpec, req_ids: list[str]) -> tuple[list[float], list[float]]:
    """Warmup, then timed decode steps: (wall seconds, device seconds (CUDA only)) per timed step."""
    device, bs = runner.device, len(req_ids)
    computed = spec.context
    wall: list[float] = []
    dev: list[float] = []
    use_events = device.type == "cuda"
    # No try/finally: after a failed step the mode is abandoned and its runner shut down,
    # and a clean-up step here could only mask the original error.
    for i in range(spec.warmup + spec.steps):
        so = _decode_output(req_ids, computed)
        synchronize(device)
        if use_events:
            start_evt, end_evt = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_evt.record()
        t0 = time.perf_counter()
        runner.execute_model(so)
        out = runner.sample_tokens()  # D2H copy of the sampled tokens: the step is done
        t1 = time.perf_counter()
        if use_events:
            end_evt.record()
            end_evt.synchronize()
        _check_output(out, bs)
        computed += 1
        if i >= spec.warmup:
            wall.append(t1 - t0)
            if use_events:
                dev.append(start_evt.elapsed_time(end_evt) / 1e3)
    return wall, dev


def _decode_output(req_ids: list[str], computed: int) -> SchedulerOutput:
    """Every request decodes one token; its blocks were all handed over at admission."""
    so = SchedulerOutput(total_num_scheduled_tokens=len(req_ids))
    cached = so.scheduled_cached_reqs
    cached.req_ids = list(req_ids)
    cached.new_block_ids = [None] * len(req_ids)
    cached.num_computed_tokens = [computed] * len(req_ids)
    so.num_scheduled_tokens = dict.fromkeys(req_ids, 1)
    return so


def _step(runner, so: SchedulerOutput, bs: int) -> None:
    runner.execute_model(so)
    _check_output(runner.sample_tokens(), bs)


def _check_output(out, bs: int) -> None:
    """Each request got exactly one token: the step really was a full decode."""
    if len(out.req_ids) != bs or any(len(t) != 1 for t in out.sampled_token_ids):
        raise RuntimeError(
            f"decode step returned {len(out.req_ids)} requests / tokens {out.sampled_token_ids[:4]}...; "
            f"expected {bs} x 1"
        )
