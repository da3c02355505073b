"""`bench throughput`: offline `LLM.generate` over a synthetic workload, output tokens/s.

Workload: `num_prompts` random-token prompts; input and output lengths either fixed or
drawn uniformly from [L/2, 3L/2] (mean L) per request, seeded. Every request has
`ignore_eos`, so it produces exactly its output length. One short untimed generate runs
first so that lazy initialisation stays out of the timing.

Bandwidth-bound ideal: the engine runs up to `c = min(num_prompts, max_num_seqs)`
requests at once. If every decode step ran at that full batch and took only the time
to read all weights plus the batch's KV (at the mean context, input + output/2), output
tokens/s would be

    ideal = c * bandwidth / (weight bytes + c * mean context * KV bytes per token)

Prefill is ignored (it is compute, not bytes), so the ideal is an upper bound; the
reported fraction is measured / ideal.

GPU busy: CUDA events recorded around every engine step of the timed run (each
`execute_model`: state commit, input upload and the graph replay or eager step) give the
device time the steps took; busy / (first start .. last end) is the share of the run the
GPU spent on steps, the rest is the host keeping it waiting. On a CPU it is not measured.

Start-up: the runner's load / compile / capture seconds (`ModelRunner.startup_times`).

Images (`images` > 0, a vision-language model such as builtin:llava-1.5-7b or builtin:qwen2.5-vl-7b):
each prompt starts with that many image placeholders (one prompt token after each but the last, so that
each is a placeholder of its own), each image `image_size` px square random pixels drawn from a pool of
`distinct_images` (default: one per image, all distinct). `image_size` defaults to the model's: LLaVA's
tower size; Qwen2.5-VL, which resizes every image to its own grid, 336 px (LLaVA-1.5's, so the two
compare on the same pixels: 144 tokens an image). The report adds the placeholder tokens an image takes,
how many images the vision tower encoded and the encoder cache's hit rate (1 - encoded / images) over
the timed run. Its input tokens count each image's placeholder rows.

Time to first token: from each request's arrival (all at once, at the timed `generate`'s start) to its
first token, median and p99 (`RequestOutput.metrics`).

LoRA (`num_loras` > 0): prompt i runs dummy adapter i mod num_loras (random rank-`lora_rank` PEFT
adapters on all seven projections, written to a temporary folder), with at most `max_loras` distinct
adapters in flight (the scheduler queues the rest); compare with a run without `--num-loras`.

Peer (`peer=True`): after our run, Hugging Face transformers `generate` runs the same
prompts with the same output length on a model holding our weights (tools/bench/peer.py),
as one batch of all prompts; so the workload must be one batch for us too (`dist`
"fixed", `num_prompts <= max_num_seqs`). Our KV cache and graphs are released first so
that the peer's copy of the weights fits where ours ran.
"""

from __future__ import annotations

import functools
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from capture.modes import CUDAGraphMode
from graphrunner.protocol import LoRARequest, SamplingParams
from graphrunner_tools.bench.common import (
    default_compile_backend,
    element_size,
    env_info,
    release_memory,
    resolve_device,
    synchronize,
)
from graphrunner_tools.bench.peer import PEER_VARIANTS, PeerComparison, compare_with_peer
from graphrunner_tools.bench.roofline import Bandwidth, kv_bytes_per_token, measure_copy_bandwidth, weight_bytes_read

if TYPE_CHECKING:
    import torch

    from graphrunner.engine.llm import LLM
    from graphrunner.engine.request import RequestOutput
    from graphrunner.runner import ModelRunner

DISTRIBUTIONS = ("fixed", "uniform")
_WARMUP_TOKENS = 4
# Qwen2.5-VL's synthetic images: LLaVA-1.5's 336 px, so that both models' runs encode the same pixels.
QWEN_VL_IMAGE_SIZE = 336


@dataclass(frozen=True)
class ThroughputSpec:
    """What `run_throughput` runs. mode "NONE" runs eagerly (enforce_eager)."""

    model: str = "builtin:qwen2.5-0.5b"
    num_prompts: int = 256
    input_len: int = 512
    output_len: int = 128
    dist: str = "fixed"
    mode: str = "FULL_AND_PIECEWISE"
    dtype: str = "auto"
    device: str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # CacheConfig.cache_dtype (LLM(kv_cache_dtype=...))
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    compile_backend: str | None = None
    load_format: str = "auto"
    seed: int = 0
    async_scheduling: bool = True  # the engine's default (LLM(async_scheduling=...))
    copy_bytes: int | None = None
    peer: bool = False  # also time Hugging Face transformers generate on the same weights
    peer_variants: tuple[str, ...] = PEER_VARIANTS
    quantization: str | None = None  # "fp8": e4m3 linear weights (LLM's quantization)
    num_loras: int = 0  # > 0: prompt i runs dummy adapter i mod num_loras
    max_loras: int = 8  # distinct adapters in flight (LLM's max_loras), at most num_loras
    lora_rank: int = 16
    images: int = 0  # images per prompt (a vision-language model)
    distinct_images: int | None = None  # the pool prompts draw their images from; None: all distinct
    image_size: int | None = None  # the images' side in px; None: the model's (module docstring)

    def __post_init__(self) -> None:
        CUDAGraphMode.parse(self.mode)
        if self.images < 0 or (self.distinct_images is not None and self.distinct_images < 1):
            raise ValueError(f"images={self.images} must be >= 0 and distinct_images={self.distinct_images} >= 1")
        if self.image_size is not None and self.image_size < 1:
            raise ValueError(f"image_size={self.image_size} must be >= 1 (pixels)")
        if self.dist not in DISTRIBUTIONS:
            raise ValueError(f"dist={self.dist!r}; allowed: {DISTRIBUTIONS}")
        for name in ("num_prompts", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        shortest = self.input_len if self.dist == "fixed" else max(1, self.input_len // 2)
        if self.images > 1 and shortest < self.images - 1:
            # Adjacent placeholders would read as one run (one image's, expanded); a prompt token parts them.
            raise ValueError(f"images={self.images}: a prompt token follows each image but the last, so every "
                             f"prompt needs at least {self.images - 1} tokens; input_len={self.input_len} "
                             f"(dist {self.dist!r}) gives {shortest}")
        object.__setattr__(self, "peer_variants", tuple(self.peer_variants))
        if self.num_loras < 0 or self.max_loras < 1 or self.lora_rank < 1:
            raise ValueError(f"num_loras={self.num_loras} must be >= 0, max_loras={self.max_loras} and "
                             f"lora_rank={self.lora_rank} >= 1")
        if self.peer and self.num_loras:
            raise ValueError("peer comparison runs the base model: leave num_loras at 0")
        if self.peer and self.images:
            raise ValueError("peer comparison runs token prompts: leave images at 0")
        if self.peer:
            self._check_peer()

    def _check_peer(self) -> None:
        # The peer runs every prompt as one unpadded batch; the comparison is only fair if
        # our run is the same batch of the same lengths.
        if self.dist != "fixed":
            raise ValueError(
                f"peer comparison needs dist='fixed' (one prompt length, no padding), got dist={self.dist!r}"
            )
        if self.num_prompts > self.max_num_seqs:
            raise ValueError(
                f"peer comparison runs all prompts as one batch: num_prompts={self.num_prompts} must be "
                f"<= max_num_seqs={self.max_num_seqs}"
            )
        bad = [v for v in self.peer_variants if v not in PEER_VARIANTS]
        if bad or not self.peer_variants:
            raise ValueError(
                f"peer_variants={list(self.peer_variants)}; allowed: a non-empty subset of {list(PEER_VARIANTS)}"
            )


@dataclass
class ThroughputResult:
    spec: ThroughputSpec
    env: dict
    mode: str
    bandwidth: Bandwidth
    input_tokens: int
    output_tokens: int
    expected_output_tokens: int
    elapsed_seconds: float
    preemptions: int
    ideal_batch: int
    ideal_output_tokens_per_s: float
    gpu_busy_fraction: float | None = None  # None: not measured (no CUDA events on this device)
    startup_seconds: dict[str, float] = field(default_factory=dict)  # load / compile / capture
    scheduling: str = "async"
    peer: PeerComparison | None = None
    ttft_median_ms: float | None = None
    ttft_p99_ms: float | None = None
    images_encoded: int | None = None  # vision tower runs in the timed pass (images > 0)
    image_tokens: int | None = None  # placeholder tokens (decoder rows) one image takes (images > 0)
    image_size: int | None = None  # the synthetic images' side in px (images > 0)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_seconds

    @property
    def total_tokens_per_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.elapsed_seconds

    @property
    def requests_per_s(self) -> float:
        return self.spec.num_prompts / self.elapsed_seconds

    @property
    def ideal_fraction(self) -> float:
        return self.output_tokens_per_s / self.ideal_output_tokens_per_s

    @property
    def encoder_hit_rate(self) -> float | None:
        """Images served from the encoder cache over all images of the timed run (None without images)."""
        images = self.spec.num_prompts * self.spec.images
        return None if not images or self.images_encoded is None else 1.0 - self.images_encoded / images

    def to_dict(self) -> dict:
        return {
            "kind": "throughput",
            "spec": asdict(self.spec),
            "env": self.env,
            "mode": self.mode,
            "bandwidth": self.bandwidth.to_dict(),
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "expected_output_tokens": self.expected_output_tokens,
            "elapsed_seconds": self.elapsed_seconds,
            "preemptions": self.preemptions,
            "requests_per_s": self.requests_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
            "ideal_batch": self.ideal_batch,
            "ideal_output_tokens_per_s": self.ideal_output_tokens_per_s,
            "ideal_fraction": self.ideal_fraction,
            "gpu_busy_fraction": self.gpu_busy_fraction,
            "startup_seconds": self.startup_seconds,
            "scheduling": self.scheduling,
            "peer": None if self.peer is None else self.peer.to_dict(),
            "ttft_median_ms": self.ttft_median_ms,
            "ttft_p99_ms": self.ttft_p99_ms,
            "images_encoded": self.images_encoded,
            "image_tokens": self.image_tokens,
            "image_size": self.image_size,
            "encoder_hit_rate": self.encoder_hit_rate,
        }


def sample_lengths(n: int, mean: int, dist: str, rng: np.random.Generator) -> np.ndarray:
    """`n` lengths: all `mean` ("fixed"), or uniform integers in [mean/2, 3*mean/2] ("uniform")."""
    if dist == "fixed":
        return np.full(n, mean, dtype=np.int64)
    if dist == "uniform":
        lo, hi = max(1, mean // 2), max(1, (3 * mean) // 2)
        return rng.integers(lo, hi + 1, size=n)
    raise ValueError(f"dist={dist!r}; allowed: {DISTRIBUTIONS}")


def _build_llm(spec: ThroughputSpec, device: torch.device, mode: CUDAGraphMode, max_model_len: int) -> LLM:
    from graphrunner.engine.llm import LLM

    eager = mode is CUDAGraphMode.NONE
    return LLM(
        spec.model,
        enable_prefix_caching=False,  # the timed pass repeats the warm-up's prompts
        dtype=spec.dtype,
        device=device,
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=spec.block_size,
        kv_cache_dtype=spec.kv_cache_dtype,
        seed=spec.seed,
        num_kv_blocks=spec.num_kv_blocks,
        gpu_memory_utilization=spec.gpu_memory_utilization,
        load_format=spec.load_format,
        enforce_eager=eager,
        cudagraph_mode=None if eager else mode.name,
        compile_backend=spec.compile_backend or default_compile_backend(device),
        async_scheduling=spec.async_scheduling,
        quantization=spec.quantization,
        enable_lora=spec.num_loras > 0,
        max_loras=max(1, min(spec.max_loras, spec.num_loras)),
        max_lora_rank=spec.lora_rank,
        max_cpu_loras=max(1, spec.num_loras),
    )


class StepEvents:
    """CUDA events around every `execute_model` of a runner while installed, and the host's monotonic
    clock at its start and return (`host`; the only record with `device_events` off, as on a CPU);
    `close()` after the run. Recording an event is asynchronous, so the timed run is undisturbed."""

    def __init__(self, runner: ModelRunner, device_events: bool = True) -> None:
        import torch

        self._runner = runner
        self.pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.host: list[tuple[float, float]] = []
        self._orig = runner.execute_model
        new_event = functools.partial(torch.cuda.Event, enable_timing=True)

        def execute_model(*args, **kwargs):
            began = time.monotonic()
            start = new_event() if device_events else None
            if start is not None:
                start.record()
            try:
                return self._orig(*args, **kwargs)
            finally:
                if start is not None:
                    end = new_event()
                    end.record()
                    self.pairs.append((start, end))
                self.host.append((began, time.monotonic()))

        runner.execute_model = execute_model  # type: ignore[method-assign]

    def device_ms(self) -> list[float]:
        """Each step's device time between its events, ms (after the device finished the run)."""
        return [a.elapsed_time(b) for a, b in self.pairs]

    def close(self) -> float | None:
        """Uninstall; the steps' device time over the window from the first step's start to the
        last one's end (None without steps). Call after the device finished the run."""
        del self._runner.execute_model  # the class's method again
        if not self.pairs:
            return None
        busy = sum(self.device_ms())
        window = self.pairs[0][0].elapsed_time(self.pairs[-1][1])
        return min(1.0, busy / window) if window > 0 else None


def _ideal_output_tokens_per_s(
    runner: ModelRunner, concurrency: int, mean_context: float, bandwidth: Bandwidth
) -> float:
    """Output tokens/s of `concurrency` requests decoding at `mean_context` tokens each when
    every step only reads the weights and the KV cache at copy bandwidth."""
    assert runner.model is not None
    weights = weight_bytes_read(runner.model, runner.model_config, concurrency)
    kv_per_token = kv_bytes_per_token(runner.model_config, element_size(runner.kv_cache_dtype))
    step_bytes = weights + concurrency * mean_context * kv_per_token
    return concurrency * bandwidth.bytes_per_s / step_bytes


def _timed_generate(
    llm: LLM, prompts: list, params: list[SamplingParams], device: torch.device,
    loras: list[LoRARequest | None] | None = None, warm_prompts: list | None = None,
) -> tuple[list[RequestOutput], float, int, float | None, int]:
    """Generate once briefly (warmup), then timed: (outputs, seconds, preemptions of the timed run,
    GPU-busy fraction or None on a CPU, images the vision tower encoded in it). `warm_prompts` (default
    `prompts`): the warm-up's, of the same shapes (other images, so that the encoder cache does not carry
    the timed run's into it)."""
    warm = SamplingParams(max_tokens=_WARMUP_TOKENS, temperature=0.0, ignore_eos=True)
    # The whole prompt set, briefly: every prefill-chunk and decode shape of the timed run
    # then has its Triton kernels compiled (a JIT compile inside the timed run costs ~1 s).
    llm.generate(prompts if warm_prompts is None else warm_prompts, warm, lora_request=loras)
    preempt_before = llm.scheduler.num_preemptions
    embeds = llm.runner.embeds
    encoded_before = embeds.encoder_cache.num_encoded if embeds is not None else 0
    synchronize(device)
    events = StepEvents(llm.runner) if device.type == "cuda" else None
    start = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params, lora_request=loras)
        synchronize(device)
        elapsed = time.perf_counter() - start
    finally:
        busy = events.close() if events is not None else None
    encoded = embeds.encoder_cache.num_encoded - encoded_before if embeds is not None else 0
    return outputs, elapsed, llm.scheduler.num_preemptions - preempt_before, busy, encoded


def _ttft_seconds(outputs: list[RequestOutput]) -> list[float]:
    """Arrival to first token of every request whose metrics hold both times."""
    times = []
    for o in outputs:
        m = o.metrics
        if m is not None and m.first_token_time is not None and m.arrival_time is not None:
            times.append(m.first_token_time - m.arrival_time)
    return times


def _image_geometry(spec: ThroughputSpec) -> tuple[int, int]:
    """(the synthetic images' side in px, placeholder rows per image), (0, 0) without images; ValueError for
    a text-only model. Qwen2.5-VL's count is what its own processor (the engine's, from the model's folder)
    makes of an image of that size."""
    if not spec.images:
        return 0, 0
    from graphrunner.config import Qwen2_5_VisionConfig
    from graphrunner.models.loader import load_model_config

    vision = load_model_config(spec.model).vision
    if vision is None:
        raise ValueError(f"images={spec.images}: {spec.model!r} is a text-only model (no vision tower)")
    if isinstance(vision, Qwen2_5_VisionConfig):
        from graphrunner.multimodal.qwen2_vl_processor import Qwen2VLImageProcessor

        size = spec.image_size or QWEN_VL_IMAGE_SIZE
        processor = Qwen2VLImageProcessor.from_folder(spec.model, vision)
        grid = processor(np.zeros((size, size, 3), dtype=np.uint8))["image_grid_thw"]
        return size, processor.num_tokens(grid)
    # CLIP resizes and crops any image to the tower's size: a fixed count.
    return spec.image_size or vision.image_size, vision.num_image_tokens


def _with_images(prompts: list[list[int]], spec: ThroughputSpec, vision, size: int,
                 rng: np.random.Generator) -> list[dict]:
    """vLLM's multimodal prompts: `spec.images` image placeholders at the start of each prompt, one of its
    tokens after each but the last, each image [3, size, size] uint8 random pixels from a pool of
    `distinct_images` (prompt i, image j: pool entry (i * images + j) mod pool). A random token equal to
    the placeholder id becomes its neighbour: it would read as one more image."""
    import torch

    total = len(prompts) * spec.images
    pool_size = min(total, spec.distinct_images or total)
    pool = [torch.from_numpy(rng.integers(0, 256, size=(3, size, size), dtype=np.uint8)) for _ in range(pool_size)]
    image, other = vision.image_token_id, max(vision.image_token_id - 1, 1)
    out = []
    for i, ids in enumerate(prompts):
        ids = [other if t == image else t for t in ids]
        k = spec.images - 1
        head = [t for j in range(k) for t in (image, ids[j])] + [image]
        out.append({"prompt_token_ids": head + ids[k:],
                    "multi_modal_data": {"image": [pool[(i * spec.images + j) % pool_size]
                                                   for j in range(spec.images)]}})
    return out


def run_throughput(spec: ThroughputSpec, log: Callable[[str], None] | None = None) -> ThroughputResult:
    """Run the workload on our engine (and, with `spec.peer`, on the transformers peer)."""
    device = resolve_device(spec.device)
    bandwidth = measure_copy_bandwidth(device, spec.copy_bytes)
    # The probe's cached blocks would count as "used" when the engine sizes its KV cache.
    release_memory(device)
    rng = np.random.default_rng(spec.seed)
    input_lens = sample_lengths(spec.num_prompts, spec.input_len, spec.dist, rng)
    output_lens = sample_lengths(spec.num_prompts, spec.output_len, spec.dist, rng)
    mode = CUDAGraphMode.parse(spec.mode)
    image_size, image_rows = _image_geometry(spec)
    max_model_len = int((input_lens + output_lens).max()) + spec.images * image_rows
    llm = _build_llm(spec, device, mode, -(-max_model_len // spec.block_size) * spec.block_size)
    adapters = tempfile.TemporaryDirectory(prefix="graphrunner-lora-") if spec.num_loras else None
    try:
        vocab = llm.vocab_size
        prompts: list = [rng.integers(0, vocab, size=int(n)).tolist() for n in input_lens]
        warm_prompts = None
        if spec.images:
            vision = llm.runner.model_config.vision
            warm_prompts = _with_images(prompts, spec, vision, image_size, np.random.default_rng(spec.seed + 1))
            prompts = _with_images(prompts, spec, vision, image_size, rng)
        params = [SamplingParams(max_tokens=int(n), temperature=0.0, ignore_eos=True) for n in output_lens]
        loras: list[LoRARequest | None] | None = None
        if adapters is not None:
            from graphrunner.layers.lora.peft import write_dummy_adapter

            config = llm.runner.model_config
            written = [LoRARequest(f"dummy{i}", i + 1, write_dummy_adapter(f"{adapters.name}/a{i}", config,
                                                                           spec.lora_rank, seed=i))
                       for i in range(spec.num_loras)]
            loras = [written[i % spec.num_loras] for i in range(spec.num_prompts)]
        outputs, elapsed, preemptions, busy, encoded = _timed_generate(llm, prompts, params, device, loras,
                                                                       warm_prompts)
        output_tokens = sum(len(o.token_ids) for o in outputs)
        ttft = np.asarray(_ttft_seconds(outputs), dtype=np.float64)
        concurrency = min(spec.num_prompts, spec.max_num_seqs)
        runner = llm.runner
        mean_context = float(input_lens.mean() + spec.images * image_rows + output_lens.mean() / 2)
        ideal = _ideal_output_tokens_per_s(runner, concurrency, mean_context, bandwidth)
        resolved = runner.graphs.mode.name if runner.graphs is not None else mode.name
        # Kept past shutdown (which drops the KV cache and graphs) for the peer's weights.
        model, model_config, dtype = runner.model, runner.model_config, runner.dtype
        result = ThroughputResult(
            spec=spec, env=env_info(device, spec.dtype), mode=resolved, bandwidth=bandwidth,
            input_tokens=int(input_lens.sum()) + spec.num_prompts * spec.images * image_rows,
            output_tokens=output_tokens,
            expected_output_tokens=int(output_lens.sum()),
            elapsed_seconds=elapsed,
            preemptions=preemptions,
            ideal_batch=concurrency,
            ideal_output_tokens_per_s=ideal,
            gpu_busy_fraction=busy,
            startup_seconds=runner.startup_times.to_dict(),
            scheduling="async" if llm.async_scheduling else "sync",
            ttft_median_ms=float(1e3 * np.percentile(ttft, 50)) if ttft.size else None,
            ttft_p99_ms=float(1e3 * np.percentile(ttft, 99)) if ttft.size else None,
            images_encoded=encoded if spec.images else None,
            image_tokens=image_rows if spec.images else None,
            image_size=image_size if spec.images else None,
        )
    finally:
        llm.runner.shutdown()
        del llm
        release_memory(device)
        if adapters is not None:
            adapters.cleanup()
    if spec.peer:
        try:
            result.peer = compare_with_peer(
                model,
                model_config,
                dtype=dtype,
                device=device,
                prompts=prompts,
                output_len=spec.output_len,
                ours_output_tokens_per_s=result.output_tokens_per_s,
                ours_first_tokens=outputs[0].token_ids,
                variants=spec.peer_variants,
                compile_backend=spec.compile_backend or default_compile_backend(device),
                log=log,
            )
        finally:
            del model
            release_memory(device)
    return result
