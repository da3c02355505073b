"""Memory-bandwidth roofline of a decode step.

A decode step of a dense LLM at small batch is bound by bytes, not arithmetic: every
weight is read once, and every request reads its whole KV history. So the fastest a
step can run is

    roofline seconds = (weight bytes read + KV bytes read) / copy bandwidth

where the copy bandwidth is measured in the same run with one large copy, counting
bytes read plus bytes written (measure the ceiling, do not trust the
datasheet). The ratio roofline / measured is the fraction of the roofline achieved.

What is *not* counted, on purpose: activations, logits ([B, V] float32 written and read
by the sampler) and the KV bytes written for the new token — a perfectly fused step
would not move them, so leaving them out keeps the roofline a true lower bound.

On a CPU the "copy bandwidth" is a torch memcpy between two host buffers larger than
the caches; the resulting ratio is reported but means little (a tiny model's CPU step
is Python overhead, not bytes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from graphrunner.config import ModelConfig
from graphrunner_tools.bench.common import Stats, synchronize

# 2 GiB: far beyond any L2 (50-60 MiB on H100/H200), so the copy sees HBM, not cache.
DEFAULT_CUDA_COPY_BYTES = 2 << 30
# 128 MiB per buffer: beyond a server CPU's L3, small enough to keep CPU tests quick.
DEFAULT_CPU_COPY_BYTES = 128 << 20


@dataclass(frozen=True)
class Bandwidth:
    """A measured copy bandwidth: `bytes_moved` (read + write) per copy over its median time."""

    bytes_per_s: float
    bytes_moved: int
    seconds: Stats
    method: str

    def to_dict(self) -> dict:
        return {
            "bytes_per_s": self.bytes_per_s,
            "gb_per_s": self.bytes_per_s / 1e9,
            "bytes_moved": self.bytes_moved,
            "seconds": self.seconds.to_dict(),
            "method": self.method,
        }


def default_copy_bytes(device: torch.device) -> int:
    return DEFAULT_CUDA_COPY_BYTES if device.type == "cuda" else DEFAULT_CPU_COPY_BYTES


@torch.inference_mode()
def measure_copy_bandwidth(
    device: torch.device, nbytes: int | None = None, *, iters: int = 20, warmup: int = 3
) -> Bandwidth:
    """Median bandwidth of `dst.copy_(src)` with `nbytes`-byte buffers (2 x nbytes moved).

    The source holds random bytes, never zeros (zeros can take faster paths). On CUDA
    each copy is timed with events; on CPU with perf_counter.
    """
    if nbytes is None:
        nbytes = default_copy_bytes(device)
    if nbytes < 1 or iters < 1:
        raise ValueError(f"copy bandwidth needs nbytes >= 1 and iters >= 1, got nbytes={nbytes}, iters={iters}")
    gen = torch.Generator(device=device).manual_seed(0)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)
    dst = torch.empty_like(src)
    for _ in range(warmup):
        dst.copy_(src)
    synchronize(device)
    samples: list[float] = []
    if device.type == "cuda":
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in pairs:
            start.record()
            dst.copy_(src)
            end.record()
        torch.cuda.synchronize(device)
        samples = [start.elapsed_time(end) / 1e3 for start, end in pairs]
        method = "cuda device-to-device copy"
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            dst.copy_(src)
            samples.append(time.perf_counter() - t0)
        method = "cpu memcpy"
    if not torch.equal(dst[:4096], src[:4096]):  # a copy that did not happen would give a fantasy ceiling
        raise RuntimeError("copy-bandwidth probe: destination does not match source")
    stats = Stats.of(samples)
    moved = 2 * nbytes
    del src, dst
    return Bandwidth(moved / stats.median, moved, stats, f"{method}, {nbytes / (1 << 20):.0f} MiB")


EXPERT_FORMULA = "E * (1 - (1 - k/E)^B) of a sparse layer's E experts read at batch B with top-k routing"


def expected_active_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Distinct experts a layer reads when `num_tokens` tokens each pick `top_k` of `num_experts`
    uniformly: an expert is missed by one token with probability 1 - k/E, by all B with
    (1 - k/E)^B. Qwen3-30B-A3B (E 128, k 8) at B 8: 51.6 of 128; at B 64: 125.9."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def weight_bytes_read(model: torch.nn.Module, config: ModelConfig, num_tokens: int) -> int:
    """Bytes of weights one step over `num_tokens` tokens must read.

    Every parameter is read whole (the LM head reads all of its [V, H] matrix), counted
    once even when shared (`named_parameters` de-duplicates a tied embedding). Two exceptions:
    an untied input embedding, of which a step gathers only its `num_tokens` rows, and the
    routed experts of a mixture-of-experts layer, of which a step reads only those its tokens
    chose: counted as `expected_active_experts` (EXPERT_FORMULA) of them.
    """
    moe = config.moe
    expert_share = 1.0 if moe is None else (
        expected_active_experts(moe.num_experts, moe.num_experts_per_tok, num_tokens) / moe.num_experts)
    total = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if not config.tie_word_embeddings and name.endswith("embed_tokens.weight") and p.dim() == 2:
            nbytes = min(num_tokens, p.shape[0]) * p.shape[1] * p.element_size()
        elif name.endswith((".mlp.w13", ".mlp.w2")):
            nbytes = round(nbytes * expert_share)
        total += nbytes
    return total


def kv_bytes_per_token(config: ModelConfig, elem_size: int) -> int:
    """K and V of one token across all layers."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * elem_size


@dataclass(frozen=True)
class DecodeRoofline:
    """Bytes a decode step must move and the time that takes at the measured bandwidth."""

    weight_bytes: int
    kv_bytes: int
    seconds: float

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def fraction_of(self, measured_seconds: float) -> float:
        """Roofline / measured: 1.0 means the step ran at the bandwidth ceiling."""
        return self.seconds / measured_seconds if measured_seconds > 0 else float("nan")

    def to_dict(self) -> dict:
        return {
            "weight_bytes": self.weight_bytes,
            "kv_bytes": self.kv_bytes,
            "total_bytes": self.total_bytes,
            "seconds": self.seconds,
        }


def decode_roofline(weight_bytes: int, kv_per_token: int, kv_tokens: float, bandwidth: Bandwidth) -> DecodeRoofline:
    """Roofline of one decode step reading `kv_tokens` cached tokens in total (summed over requests)."""
    kv = int(round(kv_tokens * kv_per_token))
    return DecodeRoofline(weight_bytes, kv, (weight_bytes + kv) / bandwidth.bytes_per_s)
