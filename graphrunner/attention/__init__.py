"""Attention backends behind one interface (base.py): a graph-safe Triton paged backend
for CUDA and a torch reference for CPU, chosen by `get_attention_backend`."""

from graphrunner.attention.base import AttentionBackend, AttentionMetadata, rope_attention
from graphrunner.attention.kv_write import write_kv
from graphrunner.attention.registry import get_attention_backend

__all__ = ["AttentionMetadata", "AttentionBackend", "get_attention_backend", "rope_attention", "write_kv"]
