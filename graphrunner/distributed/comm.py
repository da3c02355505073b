"""Tensor-parallel collectives that work eagerly, under torch.compile and inside CUDA graphs.

Two custom ops, `graphrunner::tp_all_reduce` and `graphrunner::tp_all_gather`, wrap
`torch.distributed` collectives on a group named by its torch group name (a string is
a plain op argument, so the compiled graph carries no ProcessGroup object). To dynamo
and inductor they are opaque functional ops with a fake implementation: the pieces of
a PIECEWISE model trace and compile around them without graph breaks, on every
backend (NCCL on CUDA, gloo on a CPU), which the functional collectives of
`torch.distributed._functional_collectives` do not guarantee for gloo. Eagerly (and
so inside a FULL graph capture, or a piece's capture) the op issues the collective
on the current stream: captured NCCL collectives replay with the graph.

`TPComm` is what layers hold: the rank/size of the TP group and the two collectives,
identity for a group of one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _group(name: str) -> dist.ProcessGroup:
    from torch.distributed import distributed_c10d as c10d

    resolve = getattr(c10d, "_resolve_process_group", None)
    if resolve is not None:
        return resolve(name)
    for pg, pg_name in c10d._world.pg_names.items():  # older torch
        if pg_name == name:
            return pg
    raise RuntimeError(f"no process group named {name!r}")


@torch.library.custom_op("graphrunner::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of `x` over the group (a new tensor; `x` is untouched)."""
    out = x.clone()
    dist.all_reduce(out, group=_group(group_name))
    return out


@tp_all_reduce.register_fake
def _tp_all_reduce_fake(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("graphrunner::tp_all_gather", mutates_args=())
def tp_all_gather(x: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    """[*S] on each rank -> [world_size, *S], rank-ordered."""
    group = _group(group_name)
    x = x.contiguous()
    out = torch.empty((world_size, *x.shape), dtype=x.dtype, device=x.device)
    if x.device.type == "cuda":
        dist.all_gather_into_tensor(out, x, group=group)
    else:  # gloo: the list form is the one every version supports
        dist.all_gather(list(out.unbind(0)), x, group=group)
    return out


@tp_all_gather.register_fake
def _tp_all_gather_fake(x: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    return x.new_empty((world_size, *x.shape))


class TPComm:
    """A tensor-parallel group as the layers see it: size, rank, all-reduce, all-gather.

    `group_name` is the torch name of the TP device group ("" for a group of one).
    """

    def __init__(self, size: int = 1, rank: int = 0, group_name: str = "", dcp_size: int = 1,
                 expert_parallel: bool = False) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"tp rank={rank} must be in [0, size={size})")
        if size > 1 and not group_name:
            raise ValueError(f"TPComm with size={size} needs the TP device group's name")
        if size % dcp_size:
            raise ValueError(f"decode_context_parallel_size={dcp_size} must divide the TP size {size}")
        self.size, self.rank, self.group_name = size, rank, group_name
        # MoE layers split their experts over the group instead of each expert's width.
        self.expert_parallel = expert_parallel
        # DCP: the K/V heads are sharded over size // dcp_size groups of dcp_size ranks each.
        self.dcp_size = dcp_size

    @property
    def kv_shards(self) -> tuple[int, int]:
        """(number of K/V head shards, this rank's shard): one per DCP group."""
        return self.size // self.dcp_size, self.rank // self.dcp_size

    @classmethod
    def from_groups(cls, groups, *, expert_parallel: bool = False) -> TPComm:
        """From a `ParallelGroups` (its TP group)."""
        return cls(groups.tp_size, groups.tp_rank, groups.tp.device_group_name, groups.dcp_size, expert_parallel)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        return torch.ops.graphrunner.tp_all_reduce(x, self.group_name)

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[R, n] per rank -> [R, size * n]: rank r's columns at [r*n, (r+1)*n)."""
        if self.size == 1:
            return x
        g = torch.ops.graphrunner.tp_all_gather(x, self.size, self.group_name)  # [size, R, n]
        return g.permute(1, 0, 2).reshape(x.shape[0], self.size * x.shape[1])

    def __repr__(self) -> str:
        return (f"TPComm(size={self.size}, rank={self.rank}, group={self.group_name!r}, dcp_size={self.dcp_size}, "
                f"expert_parallel={self.expert_parallel})")


__all__ = ["TPComm", "tp_all_gather", "tp_all_reduce"]
