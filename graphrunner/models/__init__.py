"""Llama-family models, their configs (built-in or Hugging Face folders) and weight loading."""

from graphrunner.models.llama import LlamaForCausalLM
from graphrunner.models.loader import (
    CheckpointError,
    checkpoint_dtype,
    init_dummy_weights,
    is_builtin,
    iter_checkpoint_weights,
    load_model,
    load_model_config,
    load_tokenizer,
)
from graphrunner.models.registry import BUILTIN_MODELS, SUPPORTED_ARCHITECTURES

__all__ = [
    "BUILTIN_MODELS",
    "CheckpointError",
    "LlamaForCausalLM",
    "SUPPORTED_ARCHITECTURES",
    "checkpoint_dtype",
    "init_dummy_weights",
    "is_builtin",
    "iter_checkpoint_weights",
    "load_model",
    "load_model_config",
    "load_tokenizer",
]
