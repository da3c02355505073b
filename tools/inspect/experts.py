"""`inspect simulate --num-experts E --ep-size R`: per-rank expert load over a trace, with and without EPLB.

Each real token of each step is routed to `top_k` distinct experts drawn from a Zipf popularity
(expert of popularity rank i has weight 1 / (i + 1)^skew; which expert holds which rank is a seeded
permutation; skew 0 is uniform), by Gumbel top-k sampling. Two placements of the E experts on R
expert-parallel ranks are compared on the accumulated load:

- static: experts [r E/R, (r+1) E/R) on rank r (the runner without EPLB);
- EPLB: `balanced_placement` of E + `num_redundant_experts` physical slots from the load itself (the
  controller's placement after one window that saw this load), each expert's tokens split evenly over
  its replicas.

The figure is max / mean of the per-rank token count (1.0 is perfect balance): the slowest rank sets
an expert-parallel layer's time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from graphrunner.distributed.eplb import balanced_placement, load_balance, rank_loads


@dataclass(frozen=True)
class ExpertLoad:
    num_experts: int
    top_k: int
    ep_size: int
    num_redundant_experts: int
    router_skew: float
    routed_tokens: int
    static_rank_loads: list[float]
    static_balance: float  # max / mean rank load, experts placed contiguously
    eplb_rank_loads: list[float]
    eplb_balance: float  # max / mean rank load under EPLB's placement

    def to_dict(self) -> dict:
        return asdict(self)


def check_expert_args(num_experts: int, top_k: int, ep_size: int, redundant: int, skew: float) -> None:
    """ValueError naming the first bad value (before anything is simulated)."""
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"--num-experts {num_experts} and --top-k {top_k}: need 1 <= top_k <= num_experts")
    if ep_size < 1 or num_experts % ep_size:
        raise ValueError(f"--ep-size {ep_size} must be >= 1 and divide --num-experts {num_experts}")
    if redundant < 0 or (num_experts + redundant) % ep_size:
        raise ValueError(f"--num-redundant-experts {redundant} must be >= 0, and num_experts + it a multiple of "
                         f"--ep-size {ep_size}")
    if not skew >= 0:
        raise ValueError(f"--router-skew {skew} must be >= 0 (0: every expert equally popular)")


def simulate_expert_load(tokens_per_step: Sequence[int], num_experts: int, top_k: int, ep_size: int,
                         redundant: int = 0, skew: float = 1.0, seed: int = 0) -> ExpertLoad:
    """Route every step's tokens and compare the two placements (module docstring)."""
    check_expert_args(num_experts, top_k, ep_size, redundant, skew)
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, num_experts + 1, dtype=np.float64) ** skew
    log_p = np.log(popularity[rng.permutation(num_experts)] / popularity.sum())
    load = np.zeros(num_experts, dtype=np.int64)
    for tokens in tokens_per_step:
        if tokens <= 0:
            continue
        scores = log_p + rng.gumbel(size=(int(tokens), num_experts))
        chosen = np.argpartition(-scores, top_k - 1, axis=1)[:, :top_k]
        load += np.bincount(chosen.ravel(), minlength=num_experts)
    static = rank_loads(load.astype(float).tolist(), ep_size)
    placement = balanced_placement(load.tolist(), num_experts + redundant, ep_size)
    replicas = Counter(placement)
    physical = [load[e] / replicas[e] for e in placement]
    return ExpertLoad(num_experts, top_k, ep_size, redundant, skew, int(load.sum()) // top_k, static,
                      load_balance(static, ep_size), rank_loads(physical, ep_size), load_balance(physical, ep_size))


def expert_load_text(result: ExpertLoad) -> str:
    def loads(values: list[float]) -> str:
        return ", ".join(f"{v:.0f}" for v in values)

    return "\n".join([
        f"expert load:    {result.routed_tokens} tokens x top-{result.top_k} over {result.num_experts} experts, "
        f"router skew {result.router_skew:g}, {result.ep_size} expert-parallel ranks",
        f"  static:       max/mean {result.static_balance:.3f}  (tokens per rank: {loads(result.static_rank_loads)})",
        f"  EPLB (+{result.num_redundant_experts} redundant): max/mean {result.eplb_balance:.3f}  "
        f"(tokens per rank: {loads(result.eplb_rank_loads)})",
    ])


__all__ = ["ExpertLoad", "check_expert_args", "expert_load_text", "simulate_expert_load"]
