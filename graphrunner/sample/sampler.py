"""Graph-safe token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Per-request settings live in persistent per-row tensors (`SamplingStates`), written
with staged writes at admission; a step gathers them through `idx_mapping`. Random
rows use the Gumbel-max trick with noise from a stateless hash of (seed, position,
token id), so a seeded request's tokens do not depend on its batch or on replays.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from graphrunner.protocol import SamplingParams
from graphrunner.sample import rng
from graphrunner.staging import StagedRowWrites


@dataclass(frozen=True)
class SamplingFeatures:
    """Which parts of the pipeline a batch needs (decided on the host from mirrors).

    They select code paths, so they are static per captured graph.
    """

    any_random: bool = False
    any_top_k: bool = False
    any_top_p: bool = False

    @classmethod
    def all_on(cls) -> "SamplingFeatures":
        return cls(True, True, True)


def default_seed(base_seed: int, req_id: str) -> int:
    """Seed of a request that gave none: stable across preemption and re-admission."""
    digest = hashlib.blake2b(f"{base_seed}:{req_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class SamplingStates:
    """Per-row sampling settings on the device, with host mirrors for feature flags."""

    def __init__(self, num_rows: int, device: torch.device, base_seed: int = 0):
        self.base_seed = base_seed
        self.temperature = torch.zeros(num_rows, dtype=torch.float32, device=device)  # [rows]
        self.top_k = torch.zeros(num_rows, dtype=torch.int32, device=device)  # [rows], 0 = off
        self.top_p = torch.ones(num_rows, dtype=torch.float32, device=device)  # [rows], 1 = off
        self.seed = torch.zeros(num_rows, dtype=torch.int64, device=device)  # [rows]
        self.random_np = np.zeros(num_rows, dtype=bool)
        self.top_k_np = np.zeros(num_rows, dtype=np.int64)
        self.top_p_np = np.ones(num_rows, dtype=np.float64)
        self._writes = StagedRowWrites(
            {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "seed": self.seed},
            device=device,
        )

    def add_request(self, row: int, req_id: str, params: SamplingParams, vocab_size: int) -> None:
        seed = params.seed if params.seed is not None else default_seed(self.base_seed, req_id)
        top_k = params.top_k if 0 < params.top_k < vocab_size else 0
        self.random_np[row] = not params.is_greedy
        self.top_k_np[row] = top_k
        self.top_p_np[row] = params.top_p
        self._writes.stage(row, temperature=params.temperature, top_k=top_k, top_p=params.top_p, seed=seed)

    def features(self, rows: np.ndarray) -> SamplingFeatures:
        """What the batch with these state rows needs. Greedy rows ignore top-k/top-p."""
        random = self.random_np[rows]
        if not random.any():
            return SamplingFeatures()
        return SamplingFeatures(
            any_random=True,
            any_top_k=bool((self.top_k_np[rows][random] > 0).any()),
            any_top_p=bool((self.top_p_np[rows][random] < 1.0).any()),
        )

    def apply_staged_writes(self) -> None:
        self._writes.apply()


def apply_top_k_top_p(
    logits: torch.Tensor,  # [R, V] float32, already temperature-scaled
    top_k: torch.Tensor,  # [R] int32, 0 = off
    top_p: torch.Tensor,  # [R] float32, 1 = off
    use_top_k: bool,
    use_top_p: bool,
) -> torch.Tensor:  # [R, V] with filtered-out entries at -inf
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [R, V]
    ranks = torch.arange(vocab_size, device=logits.device)  # [V]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_top_k:
        k = torch.where(top_k > 0, top_k, vocab_size).to(torch.int64)  # [R]
        drop |= ranks[None, :] >= k[:, None]
    if use_top_p:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep a token while the mass strictly before it is below top_p (the first always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


class Sampler:
    """Turns the logits of the sampled rows into one token per row, graph-safely."""

    def __init__(self, states: SamplingStates):
        self.states = states

    def __call__(
        self,
        logits: torch.Tensor,  # [R, V] float32
        idx_mapping: torch.Tensor,  # [R] int32: batch entry -> state row
        positions: torch.Tensor,  # [R] position of the token being sampled (= seq_len)
        features: SamplingFeatures,
        out: torch.Tensor,  # [R] int32, written in place
    ) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)  # [R]
        if not features.any_random:
            return out.copy_(greedy)
        rows = idx_mapping.long()
        temperature = self.states.temperature[rows]  # [R]
        is_greedy = temperature == 0.0
        scaled = logits / torch.where(is_greedy, 1.0, temperature)[:, None]
        if features.any_top_k or features.any_top_p:
            scaled = apply_top_k_top_p(
                scaled, self.states.top_k[rows], self.states.top_p[rows], features.any_top_k, features.any_top_p
            )
        keys = rng.row_keys(self.states.seed[rows], positions.long())  # [R]
        sampled = (scaled + rng.gumbel(keys, logits.shape[-1])).argmax(dim=-1)  # [R]
        return out.copy_(torch.where(is_greedy, greedy, sampled))
