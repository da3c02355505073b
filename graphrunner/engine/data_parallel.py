"""What the DP replicas of an `LLM` agree on outside the runner's steps (CPU collectives)."""

from __future__ import annotations

from typing import Any

import torch


def any_replica(local: bool, groups: Any) -> bool:
    """`local`, or under lockstep DP whether any replica says so (one tiny CPU all-reduce).
    `groups`: the `LLM`'s process groups."""
    group = groups.dp.cpu_group
    if group is None or not groups.dp_lockstep:
        return local
    import torch.distributed as dist

    flag = torch.tensor([int(local)], dtype=torch.int64)
    with groups.exchange("DP check for unfinished requests (all-reduce over the replicas)"):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def gather_replicas(results: dict[str, Any], groups: Any) -> dict[str, Any]:
    """Every replica's `results` merged (an all-gather of Python objects over the DP group)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * groups.dp_size
    with groups.exchange("DP gather of the outputs (all-gather over the replicas)"):
        dist.all_gather_object(gathered, results, group=groups.dp.cpu_group)
    merged: dict[str, Any] = {}
    for part in gathered:
        merged.update(part)
    return merged
