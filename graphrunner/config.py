"""Frozen configuration dataclasses.

Every knob of a run lives here, grouped by owner. The configs are frozen so that a
runner's shapes (and later its captured graphs) can never drift from what it was
built with; derive a changed copy with `dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


# CacheConfig.cache_dtype values; every one but "auto" names float8_e4m3fn storage.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def kv_cache_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of the KV cache: the model's for "auto", float8_e4m3fn for "fp8" / "fp8_e4m3"
    (ValueError naming the value and the allowed ones otherwise)."""
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype in KV_CACHE_DTYPES:
        return torch.float8_e4m3fn
    raise ValueError(f"cache_dtype={cache_dtype!r} is not supported; allowed: {list(KV_CACHE_DTYPES)}")


def _check_ints(obj: object, names: tuple[str, ...], minimum: int) -> None:
    """ValueError naming the first of `names` on `obj` that is not an int (bools excluded) >= `minimum`."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


def _check_bools(obj: object, names: tuple[str, ...]) -> None:
    """ValueError naming the first of `names` on `obj` that is not a bool."""
    for name in names:
        if not isinstance(getattr(obj, name), bool):
            raise ValueError(f"{name}={getattr(obj, name)!r} must be a bool")


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device | str) -> torch.dtype:
    """`"auto"`/None -> bf16 on CUDA, fp32 elsewhere (CPU bf16 matmuls are slow and lossy)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; allowed: 'auto', {sorted(_DTYPES)}") from None


DEVICE_FORMS = ("cpu", "cuda", "cuda:N")


def resolve_device(device: torch.device | str | None) -> torch.device:
    """The device a run is asked for: None -> cuda when a GPU is available, else cpu.

    Accepts "cpu", "cuda" and "cuda:N" (or such a `torch.device`); anything else, CUDA
    when no GPU is available, or an index past the last GPU raises ValueError naming the
    value and the allowed forms, before anything is built.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    allowed = f"allowed: {', '.join(repr(f) for f in DEVICE_FORMS)}"
    try:
        dev = device if isinstance(device, torch.device) else torch.device(str(device))
    except RuntimeError:  # torch's message lists every backend it was built with
        raise ValueError(f"unknown device {str(device)!r}; {allowed}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {str(device)!r}; {allowed}")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {str(device)!r} needs a CUDA GPU, but none is available; use 'cpu'")
        if dev.index is not None and dev.index >= count:
            raise ValueError(
                f"device {str(device)!r} does not exist: {count} CUDA GPU(s) visible (cuda:0..cuda:{count - 1})"
            )
    return dev


@dataclass(frozen=True)
class VisionConfig:
    """A vision-language model's CLIP-style vision tower and its projector into the decoder (LLaVA).

    The tower embeds `image_size`² pixels as (image_size / patch_size)² patches plus a class token;
    `vision_feature_layer` picks the hidden states the projector reads (negative: from the end),
    `vision_feature_select_strategy` "default" drops the class token, "full" keeps it. Each image
    fills `image_token_id` placeholders, one per feature row (`num_image_tokens`)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    image_token_id: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    projector_hidden_act: str = "gelu"
    projector_bias: bool = True
    vision_feature_layer: int = -2
    vision_feature_select_strategy: str = "default"

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} is not a multiple of patch_size={self.patch_size}")
        if self.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy={self.vision_feature_select_strategy!r}; "
                             "allowed: ['default', 'full']")
        if not -self.num_hidden_layers - 1 <= self.vision_feature_layer <= self.num_hidden_layers:
            raise ValueError(f"vision_feature_layer={self.vision_feature_layer} outside the tower's "
                             f"{self.num_hidden_layers} layers")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens (and embedding rows) per image."""
        return self.num_patches + (self.vision_feature_select_strategy == "full")

    def num_params(self, text_hidden_size: int) -> int:
        """The tower's and the projector's parameters (CLIP: patch embedding without bias, class and position
        embeddings, pre / post layer norms, per layer two layer norms, q/k/v/out and fc1/fc2 with biases)."""
        d, i = self.hidden_size, self.intermediate_size
        embeddings = self.num_channels * self.patch_size ** 2 * d + d + (self.num_patches + 1) * d
        layer = 2 * 2 * d + 4 * (d * d + d) + (d * i + i) + (i * d + d)
        projector = d * text_hidden_size + text_hidden_size * text_hidden_size
        if self.projector_bias:
            projector += 2 * text_hidden_size
        return embeddings + 2 * 2 * d + self.num_hidden_layers * layer + projector


@dataclass(frozen=True)
class Qwen2_5_VisionConfig:
    """Qwen2.5-VL's vision tower and patch merger.

    Images arrive as patches of `temporal_patch_size` x `patch_size`² pixels per channel, in blocks of
    `spatial_merge_size`² neighbours; the merger turns each block into one decoder embedding of
    `out_hidden_size`, so an image of grid (t, h, w) patches fills t·h·w / merge² `image_token_id`
    placeholders: a count per image, at most `max_image_tokens` (the processor's `max_pixels`). Blocks
    attend within windows of `window_size` pixels, except `fullatt_block_indexes`, which see the whole
    image."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    image_token_id: int
    vision_start_token_id: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    in_channels: int = 3
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    max_image_tokens: int = 16384  # Qwen2.5-VL's max_pixels, 12845056, over (14 * 2)² pixels per token

    def __post_init__(self) -> None:
        _check_ints(self, ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "patch_size",
                           "temporal_patch_size", "spatial_merge_size", "window_size", "in_channels",
                           "max_image_tokens"), 1)
        _check_ints(self, ("image_token_id", "vision_start_token_id"), 0)
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"hidden_size={self.hidden_size} / num_heads={self.num_heads} must be a head size "
                             "divisible by 4 (the 2D rotary splits it into h and w halves of cos | sin pairs)")
        if self.window_size < self.patch_size * self.spatial_merge_size:
            raise ValueError(f"window_size={self.window_size} must be >= patch_size * spatial_merge_size = "
                             f"{self.patch_size * self.spatial_merge_size}")
        bad = [i for i in self.fullatt_block_indexes if isinstance(i, bool) or not isinstance(i, int)
               or not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"fullatt_block_indexes={list(self.fullatt_block_indexes)} names blocks outside "
                             f"[0, depth={self.depth})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_image_tokens(self) -> int:
        """The most placeholder tokens (and embedding rows) one image takes: the encoder budget's unit."""
        return self.max_image_tokens

    @property
    def patch_dim(self) -> int:
        """Values per patch: in_channels x temporal_patch_size x patch_size²."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    def num_params(self, text_hidden_size: int) -> int:
        """The tower's and the merger's parameters (patch embedding without bias; per block two RMSNorms,
        qkv and proj with biases, gate / up / down with biases; the merger's RMSNorm and two linears)."""
        d, i, m = self.hidden_size, self.intermediate_size, self.spatial_merge_size ** 2
        block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * (d * i + i) + (i * d + d)
        merger = d + (m * d) * (m * d) + m * d + (m * d) * self.out_hidden_size + self.out_hidden_size
        return self.patch_dim * d + self.depth * block + merger


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts part of a decoder (Mixtral, Qwen2-MoE, Qwen3-MoE).

    A sparse layer routes each token to `num_experts_per_tok` of `num_experts` SwiGLU experts of
    width `moe_intermediate_size` (softmax over the experts, then the top-k, renormalised to sum 1
    when `norm_topk_prob`), plus, when `shared_expert_intermediate_size` > 0, a dense shared
    expert scaled by a sigmoid gate (Qwen2-MoE). Layer i is sparse unless it is in
    `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step`; a dense layer has
    the model's `intermediate_size`.
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_ints(self, ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"), 1)
        _check_ints(self, ("shared_expert_intermediate_size",), 0)
        _check_bools(self, ("norm_topk_prob",))
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be <= num_experts={self.num_experts}"
            )
        layers = self.mlp_only_layers
        if not isinstance(layers, tuple) or not all(type(i) is int and i >= 0 for i in layers):
            raise ValueError(f"mlp_only_layers={layers!r} must be a tuple of layer indices (ints >= 0)")

    def is_sparse_layer(self, index: int) -> bool:
        """Whether decoder layer `index` holds experts (else a dense MLP)."""
        return index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0


QUANT_METHODS = ("fp8",)
FP8_WEIGHT_SCALES = ("channel", "tensor", "block")
FP8_ACTIVATION_SCHEMES = ("dynamic", "static")


@dataclass(frozen=True)
class QuantConfig:
    """fp8 (e4m3) weights of the decoder's linear layers (q|k|v, o, gate|up, down); the embedding,
    the LM head and the norms stay in the model dtype.

    `weight_scale`: "channel" (one fp32 scale per output row), "tensor" (one per checkpoint tensor,
    held per row, so fused q|k|v keeps each part's scale exactly) or "block" (one per
    `block_size` = (rows, columns) tile, the format Qwen3-FP8 and DeepSeek publish).
    `activation_scheme`: "dynamic" quantizes each token row at run time (per row, or per
    `block_size[1]` columns of a row with block scales); "static" uses the checkpoint's
    `input_scale`. `prequantized`: the checkpoint holds the fp8 weights and their scales; else the
    model-dtype weights are quantized once, after loading (`LLM(quantization="fp8")`). `ignore`:
    module names (exact, or "re:" + a regular expression, as compressed-tensors writes them) kept
    in the model dtype.
    """

    method: str = "fp8"
    weight_scale: str = "channel"
    block_size: tuple[int, int] | None = None
    activation_scheme: str = "dynamic"
    prequantized: bool = False
    ignore: tuple[str, ...] = ()
    # The checkpoint's name of a weight's scale tensor: "weight_scale", or "weight_scale_inv" (the fp8
    # block format's name; it holds the same multiplier, dequantized = fp8 value * scale).
    scale_name: str = "weight_scale"

    def __post_init__(self) -> None:
        if self.method not in QUANT_METHODS:
            raise ValueError(f"quantization method {self.method!r} is not supported; supported: {list(QUANT_METHODS)}")
        if self.weight_scale not in FP8_WEIGHT_SCALES:
            raise ValueError(f"weight_scale={self.weight_scale!r} must be one of {list(FP8_WEIGHT_SCALES)}")
        if self.activation_scheme not in FP8_ACTIVATION_SCHEMES:
            raise ValueError(
                f"activation_scheme={self.activation_scheme!r} must be one of {list(FP8_ACTIVATION_SCHEMES)}")
        block = self.block_size
        if (block is None) != (self.weight_scale != "block"):
            raise ValueError(f"block_size={block!r} must be set exactly when weight_scale='block'")
        if block is not None and not (isinstance(block, tuple) and len(block) == 2
                                      and all(type(b) is int and b > 0 for b in block)):
            raise ValueError(f"block_size={block!r} must be a pair of ints > 0 (rows, columns)")
        if block is not None and self.activation_scheme != "dynamic":
            raise ValueError("block-wise fp8 weights take dynamic activation scales only "
                             f"(activation_scheme={self.activation_scheme!r})")
        _check_bools(self, ("prequantized",))
        if not (isinstance(self.ignore, tuple) and all(isinstance(n, str) for n in self.ignore)):
            raise ValueError(f"ignore={self.ignore!r} must be a tuple of module names")
        if self.scale_name not in ("weight_scale", "weight_scale_inv"):
            raise ValueError(f"scale_name={self.scale_name!r} must be 'weight_scale' or 'weight_scale_inv'")

    def for_dummy_weights(self) -> QuantConfig:
        """The online form of this format: dummy weights are drawn in the model dtype and quantized at
        load (per tile with block scales, else per output channel, dynamic activations)."""
        scale = "block" if self.block_size is not None else "channel"
        return QuantConfig(weight_scale=scale, block_size=self.block_size, ignore=self.ignore)

    def quantizes(self, module: str) -> bool:
        """Whether the linear layer `module` (its checkpoint name, e.g. `model.layers.0.mlp.down_proj`)
        holds fp8 weights."""
        import re

        for pattern in self.ignore:
            if pattern.startswith("re:") and re.fullmatch(pattern[3:], module) or pattern == module:
                return False
        return True


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3), dense or with
    mixture-of-experts layers (`moe`: Mixtral, Qwen2-MoE, Qwen3-MoE)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF `rope_scaling` / `rope_parameters` minus theta, e.g. {"rope_type": "llama3", "factor": 8.0, ...}.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k
    eos_token_id: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"
    name: str = "model"
    moe: MoEConfig | None = None
    # Requests may carry prompt embeddings instead of token ids (vLLM's name): the first stage then
    # reads a persistent inputs_embeds buffer (graphrunner.multimodal.embeds).
    enable_prompt_embeds: bool = False
    # A vision-language model's vision tower and projector (None: text only): LLaVA's CLIP tower or
    # Qwen2.5-VL's.
    vision: VisionConfig | Qwen2_5_VisionConfig | None = None
    # fp8 weights (a pre-quantized checkpoint's `quantization_config`, or `LLM(quantization="fp8")`).
    quant: QuantConfig | None = None

    def __post_init__(self) -> None:
        _check_ints(self, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "num_key_value_heads", "head_dim", "max_position_embeddings"), 1)
        for name in ("rms_norm_eps", "rope_theta"):  # eps < 0 or theta <= 0 give NaN logits
            value = getattr(self, name)
            finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not (finite and value > 0):
                raise ValueError(f"{name}={value!r} must be a finite number > 0")
        _check_bools(self, ("tie_word_embeddings", "attention_bias", "qk_norm"))
        eos = self.eos_token_id
        if not isinstance(eos, tuple) or not all(type(t) is int and t >= 0 for t in eos):
            raise ValueError(f"eos_token_id={eos!r} must be a tuple of token ids (ints >= 0)")
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise ValueError(f"moe={self.moe!r} must be a MoEConfig or None")
        if self.quant is not None and not isinstance(self.quant, QuantConfig):
            raise ValueError(f"quant={self.quant!r} must be a QuantConfig or None")
        if self.quant is not None and self.quant.prequantized and self.moe is not None:
            raise ValueError(f"fp8 checkpoints of mixture-of-experts models ({self.architecture}) are not supported; "
                             "load the bf16 checkpoint, with quantization='fp8' to quantize it at load")
        if self.moe is not None and any(i >= self.num_hidden_layers for i in self.moe.mlp_only_layers):
            raise ValueError(
                f"mlp_only_layers={self.moe.mlp_only_layers} names a layer past "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def is_sparse_layer(self, index: int) -> bool:
        """Whether decoder layer `index` holds experts."""
        return self.moe is not None and self.moe.is_sparse_layer(index)

    def num_params(self, *, active: bool = False) -> int:
        """Parameter count (embeddings counted once when tied; a vision tower and projector included).
        `active`: what one decoded token reads, counting `num_experts_per_tok` experts (and the router)
        of each sparse layer and no vision tower."""
        h, L = self.hidden_size, self.num_hidden_layers
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        total = 0
        for index in range(L):
            total += attn + 2 * h + self.mlp_params(index, experts=None if not active else 0)
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        vision = self.vision.num_params(h) if self.vision is not None and not active else 0
        return total + emb + h + vision

    def mlp_params(self, index: int, experts: int | None = None) -> int:
        """Parameters of layer `index`'s MLP: all of them (`experts=None`), or with `experts`
        distinct routed experts (0: the `num_experts_per_tok` one token reads)."""
        h = self.hidden_size
        moe = self.moe
        if moe is None or not moe.is_sparse_layer(index):
            return 3 * h * self.intermediate_size
        count = moe.num_experts if experts is None else (experts or moe.num_experts_per_tok)
        shared = 3 * h * moe.shared_expert_intermediate_size + (h if moe.shared_expert_intermediate_size else 0)
        return count * 3 * h * moe.moe_intermediate_size + h * moe.num_experts + shared


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache.

    num_blocks=None lets `ModelRunner.determine_num_kv_blocks` size the cache from a
    profile run and `gpu_memory_utilization` (CUDA) or `cpu_kv_cache_bytes` (CPU).
    `cache_dtype` (vLLM's `kv_cache_dtype`): "auto" stores keys and values in the model's dtype;
    "fp8" (or "fp8_e4m3") stores them as float8_e4m3fn, each layer's keys divided by its k_scale
    and values by its v_scale (docs/quantization.md).
    """

    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 256 << 20
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"cache_dtype={self.cache_dtype!r} is not supported; allowed: {list(KV_CACHE_DTYPES)}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a positive power of two")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks={self.num_blocks} must be positive")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits. They size every persistent buffer of the runner."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 1024
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} < max_model_len={self.max_model_len} "
                "needs enable_chunked_prefill=True"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """How the world splits: DP x PP x PCP x TP processes, TP innermost (see graphrunner.distributed).

    Context parallelism (vLLM's names): `prefill_context_parallel_size` (PCP) splits each
    prefill's tokens across that many more ranks; `decode_context_parallel_size` (DCP) shards
    the KV cache along the sequence across ranks of a TP group (it adds no ranks), interleaved
    in units of `cp_kv_cache_interleave_size` tokens. DCP must divide the TP size; a model
    check (`check_decode_context_parallel`) adds that the T / D groups must divide the KV
    heads. collective_timeout_s bounds every collective of the process groups: a
    killed or stalled rank makes the others raise after at most this long instead of hanging.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    collective_timeout_s: float = 60.0
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = 1
    # DP replicas of a dense model share no collective: they run independently (False). True keeps
    # them in lockstep (one CPU all-reduce per step agreeing on the descriptor, dummy steps on idle
    # replicas), what a model with collectives across the DP group (expert parallelism) needs.
    data_parallel_lockstep: bool = False
    # Dual batch overlap (vLLM's names; graphrunner/step/microbatch.py): under lockstep DP, a step
    # every replica agrees to split runs its forward as two microbatches on two streams. A rank
    # wants it with >= 2 requests and at least this many tokens (decode-only / other batches).
    enable_dbo: bool = False
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512
    # Pipelined PP: a request runs again while its last token is still coming round the pipeline
    # (stage 0 applies it on the device; engine/pipeline_rule.py), so the host launches the next
    # batch without waiting for tokens. False: disjoint batches, each resolved at the host first.
    pp_token_placeholders: bool = True
    # Mixture-of-experts layers split their experts over the TP ranks (each rank holds E / TP whole
    # experts) instead of splitting every expert's width (vLLM's name). Dense layers are unaffected.
    # With data_parallel_size > 1 the experts spread over every DP x TP rank and every layer's tokens
    # meet across the replicas, so the replicas step in lockstep (data_parallel_lockstep is implied).
    enable_expert_parallel: bool = False
    # Expert load balancing (vLLM's names; graphrunner/distributed/eplb.py): each MoE layer holds
    # num_experts + num_redundant_experts physical expert slots; the load routed to each is counted
    # inside the step, and every eplb_step_interval steps the experts are re-placed (the hottest
    # replicated, ranks balanced) by the load of the last eplb_window_size steps.
    enable_eplb: bool = False
    num_redundant_experts: int = 0
    eplb_window_size: int = 1000
    eplb_step_interval: int = 3000

    def __post_init__(self) -> None:
        _check_bools(self, ("data_parallel_lockstep", "enable_dbo", "pp_token_placeholders", "enable_expert_parallel",
                            "enable_eplb"))
        _check_ints(self, ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                           "prefill_context_parallel_size", "decode_context_parallel_size",
                           "cp_kv_cache_interleave_size", "dbo_decode_token_threshold", "dbo_prefill_token_threshold",
                           "eplb_window_size", "eplb_step_interval"), 1)
        _check_ints(self, ("num_redundant_experts",), 0)
        r = self.num_redundant_experts
        if (self.enable_eplb or r) and not self.enable_expert_parallel:
            raise ValueError(f"enable_eplb={self.enable_eplb}, num_redundant_experts={r} need "
                             "enable_expert_parallel=True: EPLB places whole experts on ranks")
        if self.enable_expert_parallel and self.data_parallel_size > 1:
            object.__setattr__(self, "data_parallel_lockstep", True)  # the replicas' tokens meet in each MoE layer
        if self.collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s={self.collective_timeout_s} must be positive")
        tp, dcp = self.tensor_parallel_size, self.decode_context_parallel_size
        if tp % dcp:
            raise ValueError(
                f"decode_context_parallel_size={dcp} must divide tensor_parallel_size={tp}: DCP shards the KV "
                "cache across ranks of a TP group (it adds no ranks)"
            )
        if self.enable_dbo:
            self._check_dbo()

    def _check_dbo(self) -> None:
        """DBO is decided by the lockstep DP coordinator and splits a last stage's whole forward."""
        if not self.data_parallel_lockstep or self.data_parallel_size < 2:
            raise ValueError(
                f"enable_dbo=True needs data_parallel_lockstep=True and data_parallel_size > 1, got "
                f"data_parallel_lockstep={self.data_parallel_lockstep}, data_parallel_size={self.data_parallel_size}: "
                "the DP replicas agree on every microbatched step"
            )
        for name in ("pipeline_parallel_size", "prefill_context_parallel_size"):
            if getattr(self, name) > 1:
                raise ValueError(f"enable_dbo=True with {name}={getattr(self, name)}: microbatching runs with "
                                 f"{name}=1 only")

    @property
    def world_size(self) -> int:
        return (self.tensor_parallel_size * self.prefill_context_parallel_size * self.pipeline_parallel_size
                * self.data_parallel_size)

    def check_decode_context_parallel(self, num_key_value_heads: int, block_size: int | None = None) -> None:
        """DCP's model rule. A DCP group is D consecutive TP ranks that compute and hold the same
        KV heads (the K/V projection is sharded over the T / D groups, not over all T ranks), each
        rank keeping every D-th run of `cp_kv_cache_interleave_size` tokens; so T / D must divide
        num_key_value_heads. The interleave must divide the block size, so that one block of each
        rank serves `block_size * D` consecutive positions."""
        tp, dcp, interleave = self.tensor_parallel_size, self.decode_context_parallel_size, \
            self.cp_kv_cache_interleave_size
        if dcp == 1:
            return
        groups = tp // dcp
        if num_key_value_heads % groups:
            raise ValueError(
                f"decode_context_parallel_size={dcp} with tensor_parallel_size={tp} shards the KV heads over "
                f"{groups} DCP group(s), which must divide num_key_value_heads={num_key_value_heads}"
            )
        if block_size is not None and block_size % interleave:
            raise ValueError(f"cp_kv_cache_interleave_size={interleave} must divide block_size={block_size}")


@dataclass(frozen=True)
class CompilationConfig:
    """How steps run: graph mode, capture sizes, compile backend, debug checks.

    cudagraph_mode None takes the capture layer's default (FULL_AND_PIECEWISE, downgraded
    with a logged reason when the attention backend cannot serve it). enforce_eager runs
    every step eagerly and captures nothing. compile_backend is what compiles the
    PIECEWISE pieces ("inductor"; "eager"/"aot_eager" skip code generation, for tests).
    structured_output_graphs also captures, per FULL single-token decode size, a forward graph
    and two sampling graphs, so that a structured-output decode step's forward runs while the
    engine computes its grammar masks (graphrunner/step/split.py); off, such a step runs whole
    once its masks arrive. lazy_sampler_variants, compile_cache_dir: see the fields.
    """

    cudagraph_mode: str | None = None
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    enforce_eager: bool = False
    debug_cudagraphs: bool = False
    compile_backend: str = "inductor"
    structured_output_graphs: bool = False
    # The all-features sampler variant (penalties, bias, allowed ids, min_tokens, logprobs) of a
    # FULL descriptor is captured when a batch first needs it, not at start-up: it is a third of
    # the FULL graphs (52 of 156 for qwen2.5-0.5b's default table), most of which a workload
    # never uses. False captures every variant up front.
    lazy_sampler_variants: bool = True
    # What compilation produces (inductor's FX-graph / AOTAutograd caches, Triton kernels) is kept
    # here, one folder per configuration (graphrunner/compile_cache.py), so that a warm start
    # compiles nothing; None (or "") keeps torch's and Triton's own defaults. Used where there is
    # something to keep: on CUDA, or with inductor on a CPU.
    compile_cache_dir: str | None = "~/.cache/graphrunner/compile"

    def __post_init__(self) -> None:
        if self.cudagraph_capture_sizes is not None:
            object.__setattr__(self, "cudagraph_capture_sizes", tuple(self.cudagraph_capture_sizes))
        allowed = ("inductor", "aot_eager", "eager")
        if self.compile_backend not in allowed:
            raise ValueError(f"compile_backend={self.compile_backend!r}; allowed: {allowed}")


SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
DRAFTER_METHODS = ("draft_model", "eagle", "eagle3")  # methods that run a model and write its KV past a decode
MAX_SPECULATIVE_TOKENS = 16  # q = 1 + k multiplies every decode graph's token count
REJECTION_SAMPLE_METHODS = ("strict", "synthetic")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's shape (`speculative_config={...}` / `--speculative-config`).

    `num_speculative_tokens` = k drafts per verifying step (0: off; the uniform decode
    query length is q = 1 + k). `method` "ngram" looks the drafts up in the request's own
    history (suffixes of `prompt_lookup_min`..`prompt_lookup_max` tokens); "draft_model"
    runs `model` (a builtin name or a Hugging Face folder with the target's vocabulary);
    "eagle" and "eagle3" run the speculator head `model` (a head folder as published, or
    `builtin:eagle-NAME` / `builtin:eagle3-NAME`) over the target's own hidden states.
    `rejection_sample_method` "synthetic" accepts each draft with probability
    `synthetic_acceptance_rate` regardless of the models: a benchmarking aid, never for
    real output.
    """

    num_speculative_tokens: int = 0
    method: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    rejection_sample_method: str = "strict"
    synthetic_acceptance_rate: float = 0.8
    draft_seed: int | None = None  # dummy draft weights: their seed (None: the target's load seed)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens={k!r} must be an int in [0, {MAX_SPECULATIVE_TOKENS}]")
        if k == 0:
            return
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method={self.method!r}; allowed: {SPEC_METHODS}")
        if self.method == "ngram" and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={self.prompt_lookup_min}, prompt_lookup_max={self.prompt_lookup_max}: "
                "need 1 <= prompt_lookup_min <= prompt_lookup_max"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method 'draft_model' needs a draft `model` (builtin name or HF folder)")
        if self.method in ("eagle", "eagle3") and not self.model:
            raise ValueError(f"speculative method {self.method!r} needs the head's `model` (a head folder, or "
                             f"'builtin:{self.method}-NAME' for a built-in target NAME)")
        if self.rejection_sample_method not in REJECTION_SAMPLE_METHODS:
            raise ValueError(
                f"rejection_sample_method={self.rejection_sample_method!r}; allowed: {REJECTION_SAMPLE_METHODS}"
            )
        if not 0.0 <= self.synthetic_acceptance_rate <= 1.0:
            raise ValueError(f"synthetic_acceptance_rate={self.synthetic_acceptance_rate} must be in [0, 1]")

    @classmethod
    def from_dict(cls, config: dict[str, Any] | str | None) -> SpeculativeConfig:
        """From vLLM's dict (or its JSON text, as `--speculative-config` takes it); None: off."""
        if config is None:
            return cls()
        if isinstance(config, str):
            import json

            try:
                config = json.loads(config)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON ({e}): {config!r}") from None
        if not isinstance(config, dict):
            raise ValueError(f"speculative config must be a dict, got {type(config).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown}; allowed: {sorted(known)}")
        return cls(**config)

    def check_draft_vocab(self, target_vocab_size: int, draft_vocab_size: int) -> None:
        """A draft model must share the target's vocabulary (its ids are the target's ids)."""
        if draft_vocab_size != target_vocab_size:
            raise ValueError(
                f"draft model {self.model!r} has vocab_size={draft_vocab_size}, the target {target_vocab_size}: "
                "a draft model must share the target's vocabulary"
            )


MAX_KV_SPLITS = 32  # the paged attention kernel's limit on key splits (graphrunner.attention.triton_attn)


@dataclass(frozen=True)
class KernelConfig:
    """Which kernel serves each operation, chosen per runner (two runners in one process may differ).

    Every field defaults to the choice that measured fastest. Layers and attention backends
    read it once, when they are built (`graphrunner.layers.linear`, `graphrunner.attention`),
    and turn it into a plan keyed by shapes and device properties (`graphrunner.kernels.device`),
    never by GPU names. A choice a device cannot serve (no Triton, a CPU tensor) falls back to
    the torch path.

    Layers and attention:
      decode_gemv            single-row projections (and the single-row LM head) run as one Triton GEMV
                             launch instead of cuBLAS; off, the two fused GEMVs below are off too
      norm_gemv_max_k        residual add + RMSNorm fused into the next single-row GEMV for input widths
                             (hidden sizes) up to this; 0: never fused. Every GEMV program re-reads the whole
                             row to normalize it. H100, batch 1: qwen2.5-0.5b (896) 0.82 vs 0.89 ms fused,
                             llama-3.2-1b (2048) even, llama-3.1-8b (4096) 6.21 vs 5.81 ms (slower)
      swiglu_gemv_max_k      SiLU(gate) * up fused into the down projection's single-row GEMV for input widths
                             (intermediate sizes) up to this; 0: never fused. H100, batch 1: qwen2.5-0.5b (4864)
                             even, llama-3.2-1b (8192) 1.253 vs 1.191 ms unfused, llama-3.1-8b (14336) slower
      attention_rope         decode batches: the attention launch itself rotates q and k and writes the new
                             k and v into the cache (one kernel less per layer); off, a rotary + KV-write
                             kernel runs before it
      attention_max_kv_splits  the most key splits (flash-decoding) the attention plan gives a small batch,
                             in [1, MAX_KV_SPLITS]. H100, context 1024, batch 1: qwen2.5-0.5b 0.79 ms at 16 vs
                             0.83-0.87 at 32; longer contexts were not measured and may want more
      pdl                    programmatic dependent launch between the step's Triton kernels (compute
                             capability >= 9.0): each may start while its predecessor drains. Kernel profiles
                             want it off: kernels overlap and their individual times mean little
      pdl_max_rows           the largest launch, in rows, that uses PDL. H100, qwen2.5-0.5b: batch 1 0.959 ->
                             0.883 ms with PDL, but batch 8 1.218 -> 1.259 and 256 2.820 -> 3.052 (past one row
                             the projections are cuBLAS GEMMs, and early Triton kernels only hold SM slots)
    Sampling:
      greedy_head            all-greedy batches take the argmax inside the LM head's GEMM
    """

    # layers and attention
    decode_gemv: bool = True
    norm_gemv_max_k: int = 2048
    swiglu_gemv_max_k: int = 6144
    attention_rope: bool = True
    attention_max_kv_splits: int = 16
    pdl: bool = True
    pdl_max_rows: int = 1
    # sampling
    greedy_head: bool = True

    def __post_init__(self) -> None:
        for name in ("norm_gemv_max_k", "swiglu_gemv_max_k", "pdl_max_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"KernelConfig.{name}={value!r} must be an int >= 0")
        splits = self.attention_max_kv_splits
        if isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= MAX_KV_SPLITS:
            raise ValueError(f"KernelConfig.attention_max_kv_splits={splits!r} must be an int in [1, {MAX_KV_SPLITS}]")
        for f in dataclasses.fields(self):
            if f.type in (bool, "bool") and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"KernelConfig.{f.name}={getattr(self, f.name)!r} must be a bool")

    @classmethod
    def from_dict(cls, values: dict[str, Any] | KernelConfig | None) -> KernelConfig:
        """A KernelConfig from `{field: value}` (vLLM-style `kernel_config={...}`; a KernelConfig or None
        passes through / gives the defaults). ValueError naming an unknown field and the known ones."""
        if values is None:
            return cls()
        if isinstance(values, cls):
            return values
        if not isinstance(values, dict):
            raise ValueError(f"kernel_config={values!r} must be a dict of KernelConfig fields or a KernelConfig")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"kernel_config has unknown field(s) {unknown}; KernelConfig fields: {known}")
        return cls(**values)


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's names): `max_loras` adapters in one step (device slots per
    projection), each of rank <= `max_lora_rank` (every slot is padded to it), and up to
    `max_cpu_loras` adapters kept in host memory (None: max_loras). `lora_capture_sizes`: the token
    counts captured with adapters (None: `capture.dispatch.default_lora_capture_sizes`)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_capture_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _check_ints(self, ("max_loras", "max_lora_rank"), 1)
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank={self.max_lora_rank} exceeds the largest supported rank {MAX_LORA_RANK}")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        cpu = self.max_cpu_loras
        if not isinstance(cpu, int) or isinstance(cpu, bool) or cpu < self.max_loras:
            raise ValueError(f"max_cpu_loras={cpu!r} must be an int >= max_loras={self.max_loras}")
        if self.lora_capture_sizes is not None:
            object.__setattr__(self, "lora_capture_sizes", tuple(self.lora_capture_sizes))


MAX_LORA_RANK = 256  # vLLM's largest; a slot's rank tile is the rank rounded up to a power of two


KV_CONNECTORS = ("SharedStorageConnector", "CpuOffloadConnector", "NcclConnector")  # graphrunner/kv_transfer/
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """A KV connector (vLLM's `kv_transfer_config`): KV computed by one instance saved and loaded by
    another, or offloaded to host memory and brought back instead of being recomputed.

    kv_connector: one of `KV_CONNECTORS`. kv_role: "kv_producer" saves, "kv_consumer" loads,
    "kv_both" does both. kv_connector_extra_config: the connector's own options (SharedStorageConnector:
    `shared_storage_path`; CpuOffloadConnector: `cpu_bytes`; NcclConnector: `kv_ip`, `kv_port`, `backend`,
    `timeout_s`, `kv_buffer_size`), see docs/kv_transfer.md."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_connector={self.kv_connector!r} is not one of {list(KV_CONNECTORS)}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role={self.kv_role!r} is not one of {list(KV_ROLES)}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, Mapping):
            raise ValueError(f"kv_connector_extra_config={extra!r} must be a dict")
        object.__setattr__(self, "kv_connector_extra_config", MappingProxyType(dict(extra)))

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def coerce(cls, value: KVTransferConfig | Mapping[str, Any] | None) -> KVTransferConfig | None:
        """`LLM(kv_transfer_config=...)`: a KVTransferConfig, a dict of its fields, or None (off)."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"kv_transfer_config={value!r} must be a dict, a KVTransferConfig or None")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"kv_transfer_config has unknown keys {unknown}; allowed: {sorted(names)}")
        if "kv_connector" not in value:
            raise ValueError("kv_transfer_config needs 'kv_connector', one of " + str(list(KV_CONNECTORS)))
        return cls(**value)


@dataclass(frozen=True)
class LoadConfig:
    """Where weights come from: a Hugging Face folder, or `dummy` random weights from `seed`."""

    model: str = "builtin:tiny-llama"
    load_format: str = "auto"  # "auto" (safetensors in the folder) or "dummy"
    seed: int = 0


@dataclass(frozen=True)
class RunnerConfig:
    """Everything a `ModelRunner` needs, in one frozen object."""

    model: ModelConfig
    load: LoadConfig = field(default_factory=LoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    lora: LoRAConfig | None = None  # multi-LoRA serving; None: off (no LoRA buffers, graphs or work)
    kv_transfer: KVTransferConfig | None = None  # a KV connector; None: off (no calls around the step)
    dtype: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        limit = self.model.max_position_embeddings
        if self.scheduler.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.scheduler.max_model_len} exceeds the model's "
                f"max_position_embeddings={limit}"
            )

    def kv_heads_per_rank(self) -> int:
        """KV heads one rank computes and caches: num_key_value_heads over the K/V shards (the TP
        ranks; under DCP the TP / DCP groups). ValueError naming the sizes when they do not divide."""
        p, heads = self.parallel, self.model.num_key_value_heads
        p.check_decode_context_parallel(heads, self.cache.block_size)
        shards = p.tensor_parallel_size // p.decode_context_parallel_size
        if heads % shards:
            raise ValueError(f"num_key_value_heads={heads} is not divisible by tensor_parallel_size={shards}")
        return heads // shards

    @property
    def tokens_per_block(self) -> int:
        """Positions of a request one KV block serves: block_size, times D under DCP (each of
        the D ranks keeps its share of those positions in a block of its own)."""
        return self.cache.block_size * self.parallel.decode_context_parallel_size

    @property
    def max_num_blocks_per_req(self) -> int:
        return -(-self.scheduler.max_model_len // self.tokens_per_block)

    def replace(self, **changes: Any) -> RunnerConfig:
        return dataclasses.replace(self, **changes)
