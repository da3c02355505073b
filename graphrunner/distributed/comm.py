"""Tensor-parallel collectives that work eagerly, under torch.compile and inside CUDA graphs.

Three custom ops, `graphrunner::tp_all_reduce`, `graphrunner::tp_all_gather` and
`graphrunner::tp_reduce_scatter`, wrap
`torch.distributed` collectives on a group named by its torch group name (a string is
a plain op argument, so the compiled graph carries no ProcessGroup object). To dynamo
and inductor they are opaque functional ops with a fake implementation: the pieces of
a PIECEWISE model trace and compile around them without graph breaks, on every
backend (NCCL on CUDA, gloo on a CPU), which the functional collectives of
`torch.distributed._functional_collectives` do not guarantee for gloo. Eagerly (and
so inside a FULL graph capture, or a piece's capture) the op issues the collective
on the current stream: captured NCCL collectives replay with the graph.

`TPComm` is what layers hold: the rank/size of the TP group and its collectives, identity
for a group of one. Under data parallelism with expert parallelism it also carries the
`DPComm` of the DP group the experts are spread over (the same ops, keyed by the DP device
group's name).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta

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


@torch.library.custom_op("graphrunner::tp_reduce_scatter", mutates_args=())
def tp_reduce_scatter(x: torch.Tensor, world_size: int, rank: int, group_name: str) -> torch.Tensor:
    """[world_size * n, *S] on each rank -> [n, *S]: the sum over the group of every rank's
    rows [rank * n, (rank + 1) * n)."""
    group = _group(group_name)
    x = x.contiguous()
    n = x.shape[0] // world_size
    out = torch.empty((n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    if x.device.type == "cuda":
        dist.reduce_scatter_tensor(out, x, group=group)
    else:  # gloo has no reduce-scatter: an all-reduce, then this rank's rows
        summed = x.clone()
        dist.all_reduce(summed, group=group)
        out.copy_(summed[rank * n : (rank + 1) * n])
    return out


@tp_reduce_scatter.register_fake
def _tp_reduce_scatter_fake(x: torch.Tensor, world_size: int, rank: int, group_name: str) -> torch.Tensor:
    return x.new_empty((x.shape[0] // world_size, *x.shape[1:]))


class DPComm:
    """The data-parallel group as an expert-parallel MoE layer sees it (DP + EP).

    Every DP replica runs the same padded token count each step (lockstep DP), so a layer's
    tokens gather over the group into one static-size batch [size * T, H] and its partial
    expert outputs reduce-scatter back to [T, H]: both are fixed-size collectives that FULL
    graphs capture. `pad_tokens` (set around a microbatch by the step, None otherwise) is the
    size every replica pads a call's tokens to when its own count differs from its peers'.
    """

    def __init__(self, size: int, rank: int, group_name: str) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"dp rank={rank} must be in [0, size={size})")
        if size > 1 and not group_name:
            raise ValueError(f"DPComm with size={size} needs the DP device group's name")
        self.size, self.rank, self.group_name = size, rank, group_name
        self.pad_tokens: int | None = None

    def gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [size * T_pad, H]: every replica's tokens, replica d at rows [d T_pad, (d+1) T_pad)."""
        pad = self.pad_tokens
        if pad is not None and pad > x.shape[0]:
            x = torch.nn.functional.pad(x, (0, 0, 0, pad - x.shape[0]))
        g = torch.ops.graphrunner.tp_all_gather(x, self.size, self.group_name)  # [size, T_pad, H]
        return g.reshape(self.size * x.shape[0], x.shape[1])

    def scatter_tokens(self, out: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """[size * T_pad, H] partial sums -> [num_tokens, H]: this replica's rows, summed over the group."""
        mine = torch.ops.graphrunner.tp_reduce_scatter(out, self.size, self.rank, self.group_name)
        return mine if mine.shape[0] == num_tokens else mine[:num_tokens]

    def __repr__(self) -> str:
        return f"DPComm(size={self.size}, rank={self.rank}, group={self.group_name!r})"


def second_communicators(groups, tp: TPComm) -> Callable[[], AbstractContextManager[None]]:
    """DBO under DP + EP on CUDA: a second TP and DP communicator for the microbatch on the side stream.

    NCCL collectives of one communicator must not run concurrently from two streams; the two
    microbatches' collectives do, so the side stream's get their own communicators over the same
    ranks. Returns a context manager that points the layers' `TPComm` / `DPComm` at them while the
    second microbatch is issued (it runs the eager modules, which read the names per call). Every
    rank of the world creates every group, in the same order, as `init_distributed` does."""
    from graphrunner.distributed.groups import group_ranks

    cfg = groups.config
    layout = group_ranks(cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.data_parallel_size,
                         cfg.prefill_context_parallel_size, cfg.decode_context_parallel_size)
    backend = "nccl" if groups.device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=cfg.collective_timeout_s)
    names = {"tp": tp.group_name, "dp": tp.dp.group_name if tp.dp is not None else ""}
    for kind in ("tp", "dp"):
        for ranks in layout[kind]:
            group = dist.new_group(ranks, backend=backend, timeout=timeout) if len(ranks) > 1 else None
            if groups.rank in ranks and group is not None:
                names[kind] = group.group_name

    @contextmanager
    def use() -> Iterator[None]:
        saved = tp.group_name, tp.dp.group_name if tp.dp is not None else ""
        tp.group_name = names["tp"] if tp.size > 1 else tp.group_name
        if tp.dp is not None:
            tp.dp.group_name = names["dp"]
        try:
            yield
        finally:
            tp.group_name = saved[0]
            if tp.dp is not None:
                tp.dp.group_name = saved[1]

    return use


class TPComm:
    """A tensor-parallel group as the layers see it: size, rank, all-reduce, all-gather.

    `group_name` is the torch name of the TP device group ("" for a group of one).
    """

    def __init__(self, size: int = 1, rank: int = 0, group_name: str = "", dcp_size: int = 1,
                 expert_parallel: bool = False, dp: DPComm | None = None,
                 num_redundant_experts: int = 0, record_expert_load: bool = False) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"tp rank={rank} must be in [0, size={size})")
        if size > 1 and not group_name:
            raise ValueError(f"TPComm with size={size} needs the TP device group's name")
        if size % dcp_size:
            raise ValueError(f"decode_context_parallel_size={dcp_size} must divide the TP size {size}")
        self.size, self.rank, self.group_name = size, rank, group_name
        # MoE layers split their experts over the group instead of each expert's width.
        self.expert_parallel = expert_parallel
        # DP + EP: the experts are spread over every rank of the DP x TP grid (None: over TP only).
        self.dp = dp if expert_parallel and dp is not None and dp.size > 1 else None
        # EPLB: physical expert slots beyond the logical experts, and per-slot load counting.
        self.num_redundant_experts = num_redundant_experts
        self.record_expert_load = record_expert_load
        # DCP: the K/V heads are sharded over size // dcp_size groups of dcp_size ranks each.
        self.dcp_size = dcp_size

    @property
    def kv_shards(self) -> tuple[int, int]:
        """(number of K/V head shards, this rank's shard): one per DCP group."""
        return self.size // self.dcp_size, self.rank // self.dcp_size

    @property
    def ep_size(self) -> int:
        """Ranks the experts are spread over: DP x TP under DP + EP, else TP."""
        return self.size * (self.dp.size if self.dp is not None else 1)

    @property
    def ep_rank(self) -> int:
        """This rank's place among them: dp_rank * TP + tp_rank."""
        return (self.dp.rank * self.size if self.dp is not None else 0) + self.rank

    @classmethod
    def from_groups(cls, groups, *, expert_parallel: bool = False, num_redundant_experts: int = 0,
                    record_expert_load: bool = False) -> TPComm:
        """From a `ParallelGroups` (its TP group; with expert parallelism and lockstep DP also its DP group)."""
        dp = None
        if expert_parallel and groups.dp_size > 1 and groups.dp_lockstep:
            dp = DPComm(groups.dp_size, groups.dp_rank, groups.dp.device_group_name)
        return cls(groups.tp_size, groups.tp_rank, groups.tp.device_group_name, groups.dcp_size, expert_parallel,
                   dp, num_redundant_experts, record_expert_load)

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
                f"expert_parallel={self.expert_parallel}, dp={self.dp!r})")


__all__ = ["DPComm", "TPComm", "tp_all_gather", "tp_all_reduce", "tp_reduce_scatter"]
