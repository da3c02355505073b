"""A stateless, counter-based RNG keyed by (seed, position, token id).

Sampling draws Gumbel noise from a hash of its key instead of a stateful generator, so
a request's token at a given position depends only on its seed and logits: not on the
batch it shares, the graph mode, replays, or preemption. Pure torch integer ops, so it
runs unchanged on CPU, on CUDA and inside captured graphs.

All arithmetic stays in int64 on values below 2**32 multiplied by constants below
2**31, so no product overflows (signed overflow is avoided, not relied upon).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # odd 27-bit multiplier of a well-tested 32-bit integer finalizer
_GOLDEN = 0x1E3779B9  # 2**32 / phi, trimmed below 2**31 so products stay < 2**63


def hash32(x: torch.Tensor) -> torch.Tensor:
    """Mixes the low 32 bits of an int64 tensor; returns values in [0, 2**32)."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * _MIX) & _MASK32
    x = x ^ (x >> 16)
    x = (x * _MIX) & _MASK32
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from its 64-bit seed and the position being sampled.

    seeds: [R] int64, positions: [R] int64 -> [R] int64 in [0, 2**32).
    """
    seed_lo = seeds & _MASK32
    seed_hi = (seeds >> 32) & _MASK32
    key = hash32(seed_lo ^ hash32(seed_hi + _GOLDEN))
    return hash32(key ^ hash32(positions + 2 * _GOLDEN))


def uniform(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform noise in (0, 1), one per (row, token id). keys: [R] -> [R, V] float32."""
    token_ids = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)  # [V]
    bits = hash32(keys[:, None] ^ ((token_ids[None, :] * _GOLDEN) & _MASK32))  # [R, V]
    # 23 random bits plus the half step need 24 significant bits: exact in float32, so
    # u <= 1 - 2**-24 < 1. (With 24 bits, (2**24 - 1) + 0.5 rounds up to 2**24: u = 1,
    # log(u) = 0 and the Gumbel noise is +inf, which made argmax pick that token, or a
    # NaN from a filtered-out one, in about 1% of draws at a 152k vocabulary.)
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def gumbel(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise, [R] keys -> [R, V] float32."""
    return -torch.log(-torch.log(uniform(keys, vocab_size)))
