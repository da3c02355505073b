"""Built-in model shapes and the set of supported architectures.

Built-in models run on dummy (random) weights: they let tests, benchmarks and graph
capture exercise real model shapes without downloading a checkpoint. Their shapes copy
the public Hugging Face configs of the models they are named after.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from graphrunner.config import ModelConfig, MoEConfig, Qwen2_5_VisionConfig, VisionConfig

BUILTIN_PREFIX = "builtin:"

# Hugging Face `architectures[0]` values the Llama-family model implements. They differ
# only in flags the config carries (qkv bias, q/k norm, tied embeddings, experts), so one
# model class serves them all.
MOE_ARCHITECTURES: frozenset[str] = frozenset({"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"})
CAUSAL_ARCHITECTURES: frozenset[str] = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} | MOE_ARCHITECTURES
)
# Pooling-only checkpoints of the same decoders: the bare model (`Qwen3Model`: embedders such as
# Qwen3-Embedding saved without a head) and the sequence classifiers (a `score` head on the last token).
_DENSE_FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3")
POOLING_ARCHITECTURES: frozenset[str] = frozenset(
    {f"{f}Model" for f in _DENSE_FAMILIES} | {f"{f}ForSequenceClassification" for f in _DENSE_FAMILIES}
)
# Vision-language models: a vision tower and projector in front of a Llama-family decoder.
MULTIMODAL_ARCHITECTURES: frozenset[str] = frozenset(
    {"LlavaForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"})
SUPPORTED_ARCHITECTURES: frozenset[str] = CAUSAL_ARCHITECTURES | POOLING_ARCHITECTURES | MULTIMODAL_ARCHITECTURES
RUNNER_KINDS = ("generate", "pooling")

_LLAMA3_EOS = (128001, 128008, 128009)


def _llama3_rope(factor: float) -> dict[str, float | int | str]:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


# Read-only so that no caller can mutate a shared config (no module-global mutable state).
BUILTIN_MODELS: Mapping[str, ModelConfig] = MappingProxyType(
    {
        "builtin:tiny-llama": ModelConfig(
            name="builtin:tiny-llama",
            architecture="LlamaForCausalLM",
            vocab_size=2048,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            rope_scaling=None,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            eos_token_id=(2,),
        ),
        "builtin:qwen2.5-0.5b": ModelConfig(
            name="builtin:qwen2.5-0.5b",
            architecture="Qwen2ForCausalLM",
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            head_dim=64,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            rope_scaling=None,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
            attention_bias=True,
            eos_token_id=(151643, 151645),
        ),
        "builtin:qwen3-0.6b": ModelConfig(  # the decoder of Qwen3-0.6B and Qwen3-Embedding-0.6B
            name="builtin:qwen3-0.6b",
            architecture="Qwen3ForCausalLM",
            vocab_size=151669,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=40960,
            tie_word_embeddings=True,
            qk_norm=True,
            eos_token_id=(151645, 151643),
        ),
        "builtin:llama-3.2-1b": ModelConfig(
            name="builtin:llama-3.2-1b",
            architecture="LlamaForCausalLM",
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=_llama3_rope(32.0),
            max_position_embeddings=131072,
            tie_word_embeddings=True,
            eos_token_id=_LLAMA3_EOS,
        ),
        "builtin:llama-3.1-8b": ModelConfig(
            name="builtin:llama-3.1-8b",
            architecture="LlamaForCausalLM",
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=_llama3_rope(8.0),
            max_position_embeddings=131072,
            tie_word_embeddings=False,
            eos_token_id=_LLAMA3_EOS,
        ),
        "builtin:tiny-moe": ModelConfig(
            name="builtin:tiny-moe",
            architecture="Qwen3MoeForCausalLM",
            vocab_size=2048,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            max_position_embeddings=4096,
            qk_norm=True,
            eos_token_id=(2,),
            moe=MoEConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64),
        ),
        "builtin:qwen3-30b-a3b": ModelConfig(
            name="builtin:qwen3-30b-a3b",
            architecture="Qwen3MoeForCausalLM",
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=40960,
            tie_word_embeddings=False,
            qk_norm=True,
            eos_token_id=(151645, 151643),
            moe=MoEConfig(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
        ),
        "builtin:mixtral-8x7b": ModelConfig(
            name="builtin:mixtral-8x7b",
            architecture="MixtralForCausalLM",
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            rms_norm_eps=1e-5,
            rope_theta=1000000.0,
            max_position_embeddings=32768,
            tie_word_embeddings=False,
            eos_token_id=(2,),
            moe=MoEConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336, norm_topk_prob=True),
        ),
        "builtin:qwen1.5-moe-a2.7b": ModelConfig(
            name="builtin:qwen1.5-moe-a2.7b",
            architecture="Qwen2MoeForCausalLM",
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=24,
            num_attention_heads=16,
            num_key_value_heads=16,
            head_dim=128,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=8192,
            tie_word_embeddings=False,
            attention_bias=True,
            eos_token_id=(151643,),
            moe=MoEConfig(
                num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408, norm_topk_prob=False,
                shared_expert_intermediate_size=5632,
            ),
        ),
        # LLaVA-1.5-7B: CLIP ViT-L/14 at 336 px (576 image tokens from the second-last layer) and a
        # Llama-2-7B decoder.
        "builtin:llava-1.5-7b": ModelConfig(
            name="builtin:llava-1.5-7b",
            architecture="LlavaForConditionalGeneration",
            vocab_size=32064,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            head_dim=128,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            eos_token_id=(2,),
            vision=VisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                                image_size=336, patch_size=14, image_token_id=32000),
        ),
        "builtin:tiny-llava": ModelConfig(
            name="builtin:tiny-llava",
            architecture="LlavaForConditionalGeneration",
            vocab_size=2048,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            eos_token_id=(2,),
            vision=VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                image_size=32, patch_size=8, image_token_id=2000),
        ),
        # Qwen2.5-VL-7B-Instruct: a 32-block windowed ViT (1280 wide, full attention in blocks 7, 15, 23, 31)
        # merging 2 x 2 patches of 14 px into the Qwen2-7B-shaped decoder's 3584, M-RoPE over 16 / 24 / 24
        # rotary pairs.
        "builtin:qwen2.5-vl-7b": ModelConfig(
            name="builtin:qwen2.5-vl-7b",
            architecture="Qwen2_5_VLForConditionalGeneration",
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            head_dim=128,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            rope_scaling={"rope_type": "mrope", "mrope_section": [16, 24, 24]},
            max_position_embeddings=128000,
            tie_word_embeddings=False,
            attention_bias=True,
            eos_token_id=(151645,),
            vision=Qwen2_5_VisionConfig(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                        out_hidden_size=3584, image_token_id=151655, vision_start_token_id=151652),
        ),
    }
)


def is_builtin(model: str) -> bool:
    """True when `model` names a built-in shape (`builtin:NAME`), known or not."""
    return model.startswith(BUILTIN_PREFIX)


def get_builtin(model: str) -> ModelConfig:
    """The built-in config named `model`; ValueError listing the built-ins if unknown."""
    try:
        return BUILTIN_MODELS[model]
    except KeyError:
        raise ValueError(f"unknown builtin model {model!r}; available: {sorted(BUILTIN_MODELS)}") from None


def check_architecture(architecture: str) -> None:
    """Raise ValueError naming `architecture` and the supported set unless it is supported."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )


def decoder_architecture(architecture: str) -> str:
    """The causal-LM architecture whose decoder a pooling architecture shares (`Qwen3Model` and
    `Qwen3ForSequenceClassification` -> `Qwen3ForCausalLM`); any other architecture itself."""
    for suffix in ("ForSequenceClassification", "Model"):
        if architecture in POOLING_ARCHITECTURES and architecture.endswith(suffix):
            return architecture[: -len(suffix)] + "ForCausalLM"
    return architecture


def check_runner_kind(architecture: str, runner: str) -> None:
    """ValueError unless a runner of kind `runner` ("generate" or "pooling") can serve `architecture`:
    pooling-only checkpoints have no LM head to generate with; vision-language models do not pool."""
    if runner not in RUNNER_KINDS:
        raise ValueError(f"runner={runner!r}; allowed: {list(RUNNER_KINDS)}")
    check_architecture(architecture)
    if runner == "generate" and architecture in POOLING_ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is a pooling model (no LM head to generate with): "
                         "load it with runner='pooling' and call embed() / classify() / score()")
    if runner == "pooling" and architecture in MULTIMODAL_ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is a vision-language model; runner='pooling' serves "
                         f"{sorted(CAUSAL_ARCHITECTURES | POOLING_ARCHITECTURES)}")
