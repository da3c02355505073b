"""Process groups: the world split into DP x PP x PCP x TP, each with a device and a CPU group.

    groups = init_distributed(parallel_config, device)   # reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*
    groups.tp.device_group    # NCCL on CUDA, gloo on a CPU: in-graph all-reduces
    groups.dp.cpu_group       # gloo: the per-step DP coordination all-reduce
    groups.pp_broadcast_group # sibling device group of the PP group: sampled-token broadcast
    ...
    groups.destroy()          # after the runner released its graphs and pool

Rank layout (TP innermost, then prefill context parallel (PCP), then PP, then DP):

    rank = ((dp * pp_size + pp) * pcp_size + pcp) * tp_size + tp

so the TP ranks of one stage are neighbours (one NVLink island on a node), the PCP ranks
that split a prefill follow, then the PP stages of one replica, and each DP replica is one
contiguous block. Decode context parallel (DCP) groups add no ranks: each is a run of
`dcp_size` consecutive ranks of a TP group (ranks that hold the same KV heads, each keeping
a shard of their sequence). Without context parallelism (pcp = dcp = 1) the layout and the
order in which groups are created are the DP x PP x TP ones.

A single process (no WORLD_SIZE, or WORLD_SIZE=1, and a 1x1x1 config) needs neither a
launcher nor a process group: every group is a `ParallelGroup` of size 1 with no
torch group, and every collective built on them is a no-op.

Every torch group gets `ParallelConfig.collective_timeout_s`, so a dead or stalled
peer makes the surviving ranks raise (gloo: on the connection loss or at the timeout;
NCCL: from the watchdog) instead of waiting for ever.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from graphrunner.config import ParallelConfig

logger = logging.getLogger("graphrunner.distributed")

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class CollectiveError(RuntimeError):
    """A step's communication with its peers failed (a peer died, stalled past the
    collective timeout, or diverged); the message says which exchange and where."""


@dataclass
class ParallelGroup:
    """One group this rank belongs to (TP, PP or DP): its members and its torch groups.

    `ranks` are global ranks in group order; `device_group` runs tensor collectives on
    the device (NCCL / gloo on a CPU), `cpu_group` small host-side ones (gloo). Both are
    None when the group has one member: callers skip collectives then.
    """

    name: str
    ranks: list[int]
    rank_in_group: int
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.ranks[self.rank_in_group]

    @property
    def is_first(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def first_rank(self) -> int:
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        return self.ranks[-1]

    @property
    def next_rank(self) -> int:
        """Global rank of the next member (wraps around)."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous member (wraps around)."""
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    @property
    def device_group_name(self) -> str:
        """The torch name of the device group ("" for a group of one): what the in-graph ops take."""
        return "" if self.device_group is None else self.device_group.group_name


def group_ranks(tp_size: int, pp_size: int, dp_size: int, pcp_size: int = 1,
                dcp_size: int = 1) -> dict[str, list[list[int]]]:
    """Every TP, PCP, PP, DP and DCP group of the world as lists of global ranks (pure; layout above)."""
    if tp_size % dcp_size:
        raise ValueError(f"dcp_size={dcp_size} must divide tp_size={tp_size}")

    def rank(dp: int, pp: int, c: int, tp: int) -> int:
        return ((dp * pp_size + pp) * pcp_size + c) * tp_size + tp

    D, P, C, T = range(dp_size), range(pp_size), range(pcp_size), range(tp_size)
    tp_groups = [[rank(d, p, c, t) for t in T] for d in D for p in P for c in C]
    return {
        "tp": tp_groups,
        "pcp": [[rank(d, p, c, t) for c in C] for d in D for p in P for t in T],
        "pp": [[rank(d, p, c, t) for p in P] for d in D for c in C for t in T],
        "dp": [[rank(d, p, c, t) for d in D] for p in P for c in C for t in T],
        "dcp": [g[i : i + dcp_size] for g in tp_groups for i in range(0, tp_size, dcp_size)],
    }


def coordinates(rank: int, tp_size: int, pp_size: int, pcp_size: int = 1) -> tuple[int, int, int]:
    """(dp, pp, tp) coordinates of a global rank (`pcp_coordinate` gives its PCP rank)."""
    return rank // (tp_size * pcp_size * pp_size), (rank // (tp_size * pcp_size)) % pp_size, rank % tp_size


def pcp_coordinate(rank: int, tp_size: int, pcp_size: int) -> int:
    """The PCP rank of a global rank."""
    return (rank // tp_size) % pcp_size


@dataclass
class ParallelGroups:
    """This process's place in the DP x PP x TP world and its groups.

    `device` is the device this rank runs on (cuda:LOCAL_RANK under a launcher on CUDA).
    """

    config: ParallelConfig
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    tp: ParallelGroup
    pp: ParallelGroup
    dp: ParallelGroup
    pp_broadcast_group: dist.ProcessGroup | None = None
    world_cpu_group: dist.ProcessGroup | None = None
    owns_world: bool = False  # True when init_distributed created the default group
    pcp: ParallelGroup | None = None  # prefill context parallel group (a group of one without PCP)
    dcp: ParallelGroup | None = None  # decode context parallel group (ranks of the TP group)
    _destroyed: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.pcp is None:
            self.pcp = ParallelGroup("pcp", [self.rank], 0)
        if self.dcp is None:
            self.dcp = ParallelGroup("dcp", [self.rank], 0)

    @classmethod
    def single(cls, config: ParallelConfig | None = None, device: torch.device | str = "cpu") -> ParallelGroups:
        """The world of one process: every group has one member and no torch group."""
        config = config or ParallelConfig()
        if config.world_size != 1:
            raise ValueError(f"ParallelGroups.single needs a 1x1x1 config, got world size {config.world_size}")
        return cls(
            config, 0, 1, 0, torch.device(device),
            ParallelGroup("tp", [0], 0), ParallelGroup("pp", [0], 0), ParallelGroup("dp", [0], 0),
        )

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def tp_size(self) -> int:
        return self.tp.world_size

    @property
    def pp_size(self) -> int:
        return self.pp.world_size

    @property
    def dp_size(self) -> int:
        return self.dp.world_size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank_in_group

    @property
    def pp_rank(self) -> int:
        return self.pp.rank_in_group

    @property
    def dp_rank(self) -> int:
        return self.dp.rank_in_group

    @property
    def pcp_size(self) -> int:
        assert self.pcp is not None
        return self.pcp.world_size

    @property
    def pcp_rank(self) -> int:
        assert self.pcp is not None
        return self.pcp.rank_in_group

    @property
    def dcp_size(self) -> int:
        assert self.dcp is not None
        return self.dcp.world_size

    @property
    def dcp_rank(self) -> int:
        assert self.dcp is not None
        return self.dcp.rank_in_group

    @property
    def dp_lockstep(self) -> bool:
        """DP replicas step together (config.data_parallel_lockstep); else each runs on its own."""
        return self.dp_size > 1 and self.config.data_parallel_lockstep

    @property
    def is_driver(self) -> bool:
        """TP rank 0 and PP rank 0 of its DP replica: the rank that prints for the replica."""
        return self.tp_rank == 0 and self.pp_rank == 0

    @contextmanager
    def exchange(self, what: str) -> Iterator[None]:
        """Re-raise a failed collective as CollectiveError naming the exchange, this rank's
        place and the timeout (used only on multi-process paths: no cost for one process)."""
        try:
            yield
        except CollectiveError:
            raise
        except RuntimeError as e:
            raise CollectiveError(
                f"{what} failed on rank {self.rank} (tp {self.tp_rank}/{self.tp_size}, pp {self.pp_rank}/"
                f"{self.pp_size}, dp {self.dp_rank}/{self.dp_size}; collective_timeout_s="
                f"{self.config.collective_timeout_s}): a peer died, stalled or diverged: {e}"
            ) from e

    def raise_step_failure(self, error: RuntimeError) -> NoReturn:
        """Raise for a step whose forward failed: under TP/PP/DP a CollectiveError naming this
        rank's place (TP all-reduces run inside the model); for one process `error` as it is."""
        if self.world_size == 1 or isinstance(error, CollectiveError):
            raise error
        with self.exchange("the step's forward (its tensor-parallel all-reduces)"):
            raise error

    def agree_min(self, value: int) -> int:
        """The minimum of `value` over the world (e.g. KV blocks: every rank sizes the same cache)."""
        if self.world_cpu_group is None:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.world_cpu_group)
        return int(t.item())

    def check_context_parallel(self, has_draft_model: bool) -> None:
        """Refuse the context-parallel combinations the step does not run (ValueError naming them)."""
        pcp, dcp = self.pcp_size, self.dcp_size
        if pcp > 1 and dcp > 1:
            raise ValueError(f"prefill_context_parallel_size={pcp} with decode_context_parallel_size={dcp}: "
                             "use one kind of context parallelism at a time")
        if dcp > 1 and has_draft_model:
            raise ValueError(f"decode_context_parallel_size={dcp} with a draft model: the drafter's KV is not "
                             "sharded; use method 'ngram' or DCP 1")
        if pcp > 1 and self.pp_size > 1:
            raise ValueError(f"prefill_context_parallel_size={pcp} with pipeline_parallel_size={self.pp_size}: "
                             "PCP runs with PP of 1 only")
        if pcp > 1 and has_draft_model:
            raise ValueError(f"prefill_context_parallel_size={pcp} with a draft model: the drafter's catch-up "
                             "prefill is not split over the PCP group; use method 'ngram' or PCP 1")

    def barrier(self) -> None:
        """A CPU barrier over the whole world (no-op alone)."""
        if self.world_cpu_group is not None:
            dist.barrier(group=self.world_cpu_group)

    def destroy(self) -> None:
        """Destroy every group this object created. Call after the runner released graphs and pool."""
        if self._destroyed:
            return
        self._destroyed = True
        if self.owns_world and dist.is_initialized():
            dist.destroy_process_group()  # destroys the subgroups too
        for g in (self.tp, self.pp, self.dp, self.pcp, self.dcp):
            if g is not None:
                g.device_group = g.cpu_group = None
        self.pp_broadcast_group = self.world_cpu_group = None


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(f"environment variable {name} is not set (start with torchrun or `graphrunner launch`)")
        return default
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={value!r} is not an integer") from None


def _new_groups(
    layout: dict[str, list[list[int]]], rank: int, backend: str, timeout: timedelta
) -> tuple[dict[str, ParallelGroup], dist.ProcessGroup | None]:
    """Create every TP, PP and DP group of `layout`; returns this rank's group of each kind
    and its PP broadcast communicator (None without pipeline parallelism)."""
    mine: dict[str, ParallelGroup] = {}
    pp_broadcast = None
    # Every rank must create every group, in the same order, members or not (groups of one
    # create nothing, so without context parallelism the order is the DP x PP x TP one).
    for kind in ("tp", "pcp", "pp", "dp", "dcp"):
        for ranks in layout[kind]:
            device_group = dist.new_group(ranks, backend=backend, timeout=timeout) if len(ranks) > 1 else None
            cpu_group = dist.new_group(ranks, backend="gloo", timeout=timeout) if len(ranks) > 1 else None
            sibling = None
            if kind == "pp" and len(ranks) > 1:
                # A second communicator over the same ranks, so that the sampled-token
                # broadcast never queues behind the hidden-state send/recv.
                sibling = dist.new_group(ranks, backend=backend, timeout=timeout)
            if rank in ranks:
                mine[kind] = ParallelGroup(kind, list(ranks), ranks.index(rank), device_group, cpu_group)
                if kind == "pp":
                    pp_broadcast = sibling
    return mine, pp_broadcast


def init_distributed(parallel_config: ParallelConfig, device: torch.device | str | None = None) -> ParallelGroups:
    """Join the world described by the torchrun env variables and build the DP x PP x TP groups.

    `device`: "cuda" (any index: each rank takes cuda:LOCAL_RANK), "cpu", or None (cuda
    when available). Raises RuntimeError naming the mismatch when WORLD_SIZE differs from
    tp * pp * dp. With WORLD_SIZE unset (or 1) and a 1x1x1 config, returns
    `ParallelGroups.single` without touching torch.distributed.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    # A world someone else initialized (a test harness, a host program) wins over the env.
    preset = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size() if preset else _env_int("WORLD_SIZE", 1)
    expected, pc = parallel_config.world_size, parallel_config
    if world_size != expected:
        raise RuntimeError(
            f"WORLD_SIZE={world_size} but tp*pcp*pp*dp = {pc.tensor_parallel_size}*{pc.prefill_context_parallel_size}*"
            f"{pc.pipeline_parallel_size}*{pc.data_parallel_size} = {expected}; "
            f"start {expected} processes (e.g. `graphrunner launch --nproc {expected} -- ...`)"
        )
    if world_size == 1:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return ParallelGroups.single(parallel_config, device)
    rank = dist.get_rank() if preset else _env_int("RANK")
    local_rank = _env_int("LOCAL_RANK", rank if preset else 0)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=parallel_config.collective_timeout_s)
    owns_world = not dist.is_initialized()
    if owns_world:
        kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(
            f"torch.distributed is already initialized with rank {dist.get_rank()} of {dist.get_world_size()}, "
            f"but the environment says rank {rank} of {world_size}"
        )
    tp_size = parallel_config.tensor_parallel_size
    pp_size = parallel_config.pipeline_parallel_size
    dp_size = parallel_config.data_parallel_size
    world_cpu_group = dist.new_group(list(range(world_size)), backend="gloo", timeout=timeout)
    layout = group_ranks(tp_size, pp_size, dp_size, pc.prefill_context_parallel_size, pc.decode_context_parallel_size)
    mine, pp_broadcast = _new_groups(layout, rank, backend, timeout)
    groups = ParallelGroups(
        parallel_config, rank, world_size, local_rank, device, mine["tp"], mine["pp"], mine["dp"],
        pp_broadcast_group=pp_broadcast, world_cpu_group=world_cpu_group, owns_world=owns_world,
        pcp=mine["pcp"], dcp=mine["dcp"],
    )
    logger.info(
        "rank %d/%d: dp %d/%d pp %d/%d pcp %d/%d tp %d/%d (dcp %d/%d) on %s (%s)",
        rank, world_size, groups.dp_rank, dp_size, groups.pp_rank, pp_size, groups.pcp_rank, groups.pcp_size,
        groups.tp_rank, tp_size, groups.dcp_rank, groups.dcp_size, device, backend,
    )
    return groups


__all__ = ["ENV_VARS", "CollectiveError", "ParallelGroup", "ParallelGroups", "coordinates", "group_ranks",
           "init_distributed", "pcp_coordinate"]
