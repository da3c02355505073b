"""Rotary position embedding (Neox style, as Hugging Face Llama / Mistral / Qwen).

cos/sin for every position up to `max_position_embeddings` are precomputed once into an
fp32 buffer and gathered by `positions` at run time: no host sync, and the same tensor is
read by every captured graph. The model applies the rotation inside the attention op,
fused with the KV-cache write (graphrunner.attention.base.rope_attention); `RotaryEmbedding` owns the
table, and its `forward` is Hugging Face's formula, the reference the tests hold it to.

M-RoPE (Qwen2.5-VL, `rope_type: "mrope"`) gives each token three positions, temporal, height and
width, and splits the rotated half-dimension into `mrope_section` parts, each rotated by one of them.
`MRotaryEmbedding` keeps the same table and, once per forward, gathers each token's cos | sin row from
its three positions (`per_token`); the layers then read that [T, D] table by token index, through the
same fused rotary + KV-write path. Models with one position per token never call it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

# rope_type -> keys that must be present in the scaling dict besides rope_type itself.
ROPE_TYPES: Mapping[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "mrope": ("mrope_section",),  # default frequencies, three position axes
}


def normalize_rope_scaling(
    scaling: Mapping[str, Any] | None, *, max_position_embeddings: int
) -> dict[str, Any] | None:
    """Canonical form of a HF `rope_scaling` / `rope_parameters` dict (theta removed).

    Old checkpoints spell the type `type`, new ones `rope_type`; both become `rope_type`.
    Plain rope gives None, so that configs written either way compare equal. Raises
    ValueError naming an unknown rope_type (with the allowed set) or a missing key.
    """
    if not scaling:
        return None
    out = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; allowed: {sorted(ROPE_TYPES)}")
    out["rope_type"] = rope_type
    partial = out.pop("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    if rope_type == "llama3":
        # HF falls back to max_position_embeddings when the pretraining length is absent.
        out.setdefault("original_max_position_embeddings", max_position_embeddings)
    missing = [k for k in ROPE_TYPES[rope_type] if k not in out]
    if missing:
        raise ValueError(f"rope_type {rope_type!r} needs keys {missing}; got {sorted(out)}")
    if rope_type == "default" and len(out) == 1:
        return None
    return out


def compute_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: Mapping[str, Any] | None, *, device=None
) -> torch.Tensor:  # [head_dim // 2] float32
    """Inverse frequencies of each rotated pair, with linear or llama3 scaling applied."""
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even for rotary embeddings")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponent)
    scaling = rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; allowed: {sorted(ROPE_TYPES)}")
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])  # mrope keeps the default frequencies
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, p: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, short ones kept,
    and a smooth blend between the two bands (as HF `_compute_llama3_parameters`)."""
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies Neox-style rotary embeddings to q and k, gathered by position.

    The cache buffer `cos_sin_cache` is [max_position_embeddings, head_dim] float32: the
    first half of each row is cos, the second half sin (one gather serves both). It is
    non-persistent: it is derived from the config, never loaded from a checkpoint.
    """

    cos_sin_cache: torch.Tensor  # a buffer (register_buffer in __init__)

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        rope_theta: float,
        rope_scaling: Mapping[str, Any] | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        inv_freq = compute_inv_freq(head_dim, rope_theta, rope_scaling, device=device)
        t = torch.arange(max_position_embeddings, dtype=torch.int64, device=device).float()
        freqs = torch.outer(t, inv_freq)  # [max_pos, head_dim // 2]
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64, each < max_position_embeddings
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # new (contiguous) q [T, H, D], k [T, Hkv, D]
        cos_sin = self.cos_sin_cache.index_select(0, positions)  # [T, D]
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # HF casts cos/sin to the activation dtype and rotates in that dtype; do the same so
    # that bf16 results match it too.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def make_rotary(head_dim: int, max_position_embeddings: int, rope_theta: float,
                rope_scaling: Mapping[str, Any] | None = None, *,
                device: torch.device | str | None = None) -> RotaryEmbedding:
    """The rotary embedding a config names: `MRotaryEmbedding` for rope_type "mrope", else `RotaryEmbedding`."""
    if (rope_scaling or {}).get("rope_type") == "mrope":
        assert rope_scaling is not None
        return MRotaryEmbedding(head_dim, max_position_embeddings, rope_theta, rope_scaling, device=device)
    return RotaryEmbedding(head_dim, max_position_embeddings, rope_theta, rope_scaling, device=device)


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE: the rotated pairs split into `mrope_section` (t, h, w) parts (module docstring).

    `section` is a [1, 1, D] int64 buffer naming, for each column of a cos | sin row, which of a
    token's three positions rotates it (the sin half repeats the cos half's sections)."""

    section: torch.Tensor

    def __init__(self, head_dim: int, max_position_embeddings: int, rope_theta: float,
                 rope_scaling: Mapping[str, Any], *, device: torch.device | str | None = None) -> None:
        super().__init__(head_dim, max_position_embeddings, rope_theta, rope_scaling, device=device)
        sections = check_mrope_section(rope_scaling.get("mrope_section"), head_dim)
        half = torch.repeat_interleave(torch.arange(3, device=device), torch.tensor(sections, device=device))
        self.register_buffer("section", torch.cat([half, half]).view(1, 1, head_dim), persistent=False)

    def per_token(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T, 3] (t, h, w) int64 -> (index [T] int64, table [T, D] float32): token i's cos | sin row
        is table[index[i]], what the attention's rotary reads in place of (positions, cos_sin_cache)."""
        rows = self.cos_sin_cache[positions]  # [T, 3, D]: each position's full row
        table = rows.gather(1, self.section.expand(rows.shape[0], 1, self.head_dim)).squeeze(1)  # [T, D]
        return torch.arange(rows.shape[0], device=positions.device), table


def check_mrope_section(value: Any, head_dim: int) -> tuple[int, int, int]:
    """`mrope_section` as three ints >= 0 summing to head_dim / 2; ValueError naming the value otherwise."""
    ok = (isinstance(value, (list, tuple)) and len(value) == 3
          and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value))
    if not ok or sum(value) != head_dim // 2:
        raise ValueError(f"mrope_section={value!r} must be three ints >= 0 (t, h, w) summing to head_dim / 2 = "
                         f"{head_dim // 2}")
    return (int(value[0]), int(value[1]), int(value[2]))
