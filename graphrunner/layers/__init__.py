"""Model building blocks: linear (tensor-parallel seam), rotary, norm, embedding / LM head."""

from graphrunner.layers.embedding import LMHead, VocabEmbedding
from graphrunner.layers.linear import ColumnLinear, MergedColumnLinear, QKVLinear, RowLinear
from graphrunner.layers.norm import RMSNorm, rms_norm
from graphrunner.layers.rotary import RotaryEmbedding, compute_inv_freq, normalize_rope_scaling

__all__ = [
    "ColumnLinear",
    "LMHead",
    "MergedColumnLinear",
    "QKVLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowLinear",
    "VocabEmbedding",
    "compute_inv_freq",
    "normalize_rope_scaling",
    "rms_norm",
]
