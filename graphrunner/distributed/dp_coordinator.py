"""DP coordination: one CPU all-reduce per step so every DP rank runs the same batch shape.

Each DP rank has its own scheduler and requests, but collectives inside the model (and
captured graphs) need every rank to run the same padded shape in the same mode, or none
(docs/architecture.md §4). Per step every rank reports

    DPReport(num_tokens, mode, uniform_token_count, num_reqs, wants_microbatch)

and all ranks derive the same `DPDecision` from the full list of reports with the pure
function `coordinate(reports, table)`:

1. All ranks idle (0 tokens)            -> skip: nobody runs anything.
2. Mode: the minimum desired mode in capability order NONE < PIECEWISE < FULL over
   busy ranks (an idle rank has no batch, so no constraint).
3. Size: max num_tokens and max num_reqs over ranks.
4. Uniform decode: only when every busy rank is uniform with the same q (idle ranks are
   compatible with anything); else the batch is mixed.
5. Re-dispatch with the shared table at (max num_reqs, max num_tokens, agreed q). The
   inputs are identical on every rank, so is the descriptor. If it is above the agreed
   mode, the table's candidate of exactly the agreed mode is taken, else NONE.
6. Idle ranks run a dummy step of the agreed descriptor (`RankPlan.dummy`). Under NONE a
   busy rank runs its own batch unpadded (docs/architecture.md §4) and the descriptor is
   NONE(max tokens, max reqs): the agreed size an idle rank's dummy step uses. With
   `pad_eager` (expert parallelism across the replicas: every MoE layer all-gathers its
   tokens over the DP group, which needs equal sizes) a busy rank under NONE pads its
   tokens to the agreed max too, with its own request count, as PIECEWISE does.
7. Microbatching (two microbatches, split at `split = padded // 2` where padded is the
   agreed token count): all-or-nothing -- every rank must want it -- and abandoned when
   any rank's second microbatch would be empty, i.e. unless
   `min(real tokens over ranks) > padded // 2` (padding goes to the second microbatch,
   so a rank with fewer real tokens than the split would send it only padding; an idle
   rank always abandons it). A rank wants it under `ParallelConfig.enable_dbo` (at least
   two requests and the DBO token threshold); the runner executes the decision in
   `graphrunner.step.microbatch` (eagerly, cut at the request boundary nearest the split).

Wire: `DPCoordinator.coordinate` does one `all_reduce(MAX)` on the DP CPU (gloo) group
of an int64 tensor [dp_size, 5]: each rank writes its own row and fills the others with
a sentinel below every valid value, so MAX leaves every rank with every report. That is
one collective, like packing negated minimum fields into a single row would be, but it
also gives the per-rank real token counts that the microbatch rule (the minimum) and the
padding-waste accounting (per rank) need, and makes the pure function literally what
each rank runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from capture.descriptor import BatchExecutionDescriptor
from capture.dispatch import DispatchTable
from capture.modes import CUDAGraphMode

__all__ = [
    "DPCoordinator",
    "DPDecision",
    "DPReport",
    "RankPlan",
    "coordinate",
    "mode_from_ordinal",
    "mode_ordinal",
]

# Capability order of runtime modes: a rank can always run a step in a lower mode than it
# asked for (FULL -> PIECEWISE -> eager), never a higher one.
_MODE_ORDER: tuple[CUDAGraphMode, ...] = (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL)


def mode_ordinal(mode: CUDAGraphMode) -> int:
    """NONE -> 0, PIECEWISE -> 1, FULL -> 2. Raises ValueError for a non-runtime mode."""
    try:
        return _MODE_ORDER.index(mode)
    except ValueError:
        raise ValueError(
            f"mode {mode!r} is not a runtime mode; allowed: {[m.name for m in _MODE_ORDER]}"
        ) from None


def mode_from_ordinal(ordinal: int) -> CUDAGraphMode:
    if not 0 <= ordinal < len(_MODE_ORDER):
        raise ValueError(f"mode ordinal {ordinal} outside [0, {len(_MODE_ORDER)})")
    return _MODE_ORDER[ordinal]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class DPReport:
    """What one DP rank wants to run this step.

    num_tokens: real tokens scheduled (0 = idle rank; then num_reqs must be 0 too).
    mode: the runtime mode the rank's local dispatch chose (or NONE when it must run eager).
    uniform_token_count: q when every request has exactly q tokens, else None.
    num_reqs: real requests scheduled.
    wants_microbatch: the rank would split this step into two microbatches.
    """

    num_tokens: int
    mode: CUDAGraphMode
    uniform_token_count: int | None
    num_reqs: int
    wants_microbatch: bool = False

    def __post_init__(self) -> None:
        mode_ordinal(self.mode)
        if not _is_int(self.num_tokens) or self.num_tokens < 0:
            raise ValueError(f"num_tokens={self.num_tokens!r} must be an int >= 0")
        if not _is_int(self.num_reqs) or not 0 <= self.num_reqs <= self.num_tokens:
            raise ValueError(f"num_reqs={self.num_reqs!r} must be an int in [0, num_tokens={self.num_tokens}]")
        if (self.num_reqs == 0) != (self.num_tokens == 0):
            raise ValueError(f"num_reqs={self.num_reqs} with num_tokens={self.num_tokens}: both 0 (idle) or both > 0")
        q = self.uniform_token_count
        if q is not None and (not _is_int(q) or q < 1 or self.num_tokens != self.num_reqs * q):
            raise ValueError(
                f"uniform_token_count={q!r} needs num_tokens == num_reqs * q, got {self.num_tokens}, {self.num_reqs}"
            )

    @property
    def idle(self) -> bool:
        return self.num_tokens == 0

    @classmethod
    def idle_report(cls) -> DPReport:
        """What an idle rank sends: no tokens, no constraint on the mode."""
        return cls(0, CUDAGraphMode.FULL, None, 0, False)

    @classmethod
    def from_batch(
        cls,
        table: DispatchTable,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        *,
        wants_microbatch: bool = False,
        force_eager: bool = False,
    ) -> DPReport:
        """A rank's report from its local batch: its desired mode is what `table.dispatch`
        picks (NONE with `force_eager`). num_tokens == 0 gives the idle report."""
        if num_tokens == 0:
            return cls.idle_report()
        mode = CUDAGraphMode.NONE if force_eager else table.dispatch(num_reqs, num_tokens, uniform_token_count).cg_mode
        return cls(num_tokens, mode, uniform_token_count, num_reqs, wants_microbatch)

    # Wire row: [num_tokens, mode ordinal, q or -1, num_reqs, wants_microbatch]
    def pack(self) -> list[int]:
        q = -1 if self.uniform_token_count is None else self.uniform_token_count
        return [self.num_tokens, mode_ordinal(self.mode), q, self.num_reqs, int(self.wants_microbatch)]

    @classmethod
    def unpack(cls, row: Sequence[int]) -> DPReport:
        num_tokens, mode, q, num_reqs, ubatch = (int(v) for v in row)
        return cls(num_tokens, mode_from_ordinal(mode), None if q < 0 else q, num_reqs, bool(ubatch))


NUM_FIELDS = 5


@dataclass(frozen=True)
class RankPlan:
    """What one rank runs: `descriptor` (None = skip the step), as a dummy step or its own batch."""

    descriptor: BatchExecutionDescriptor | None
    dummy: bool  # idle rank: run a dummy step of `descriptor` so collectives match
    microbatch: bool
    ubatch_split: int | None  # first token of the second microbatch

    @property
    def skip(self) -> bool:
        return self.descriptor is None


@dataclass(frozen=True)
class DPDecision:
    """The step every DP rank agreed on; identical on every rank.

    descriptor: the agreed descriptor (None when every rank is idle: skip the step).
    num_tokens / num_reqs: max over ranks; uniform_token_count: the agreed q or None.
    microbatch / ubatch_split: the microbatch decision (split = num_tokens_padded // 2).
    real_tokens / run_tokens: per rank, the real tokens and the tokens it executes
    (padded size; a busy rank under NONE runs unpadded; an idle rank runs the dummy).
    """

    descriptor: BatchExecutionDescriptor | None
    num_tokens: int
    num_reqs: int
    uniform_token_count: int | None
    microbatch: bool
    ubatch_split: int | None
    real_tokens: tuple[int, ...]
    real_reqs: tuple[int, ...]
    run_tokens: tuple[int, ...]
    pad_eager: bool = False  # busy ranks under NONE pad their tokens to the agreed max (DP + EP)

    @property
    def skip(self) -> bool:
        return self.descriptor is None

    @property
    def dp_size(self) -> int:
        return len(self.real_tokens)

    def is_dummy(self, rank: int) -> bool:
        """True when `rank` is idle but must run a dummy step of the agreed descriptor."""
        return self.descriptor is not None and self.real_tokens[rank] == 0

    def local_descriptor(self, rank: int) -> BatchExecutionDescriptor | None:
        """The descriptor `rank` executes: the agreed one, except a busy rank under NONE
        runs eager at its own real size."""
        d = self.descriptor
        if d is None:
            return None
        if d.is_eager and self.real_tokens[rank] > 0:
            tokens = d.num_tokens if self.pad_eager else self.real_tokens[rank]
            return BatchExecutionDescriptor(CUDAGraphMode.NONE, tokens, self.real_reqs[rank])
        return d

    def for_rank(self, rank: int) -> RankPlan:
        return RankPlan(self.local_descriptor(rank), self.is_dummy(rank), self.microbatch, self.ubatch_split)

    @property
    def total_real_tokens(self) -> int:
        return sum(self.real_tokens)

    @property
    def total_run_tokens(self) -> int:
        return sum(self.run_tokens)

    @property
    def padding_tokens(self) -> tuple[int, ...]:
        """Per rank: tokens executed that carry no request (padding or a dummy step)."""
        return tuple(r - t for r, t in zip(self.run_tokens, self.real_tokens, strict=True))

    @property
    def waste(self) -> float:
        """Padded (executed) over real tokens, all ranks together; 1.0 = no waste, inf = all idle work."""
        if self.total_real_tokens == 0:
            return 1.0 if self.total_run_tokens == 0 else float("inf")
        return self.total_run_tokens / self.total_real_tokens


def _capped(table: DispatchTable, desc: BatchExecutionDescriptor, mode: CUDAGraphMode, num_reqs: int,
            num_tokens: int, q: int | None) -> BatchExecutionDescriptor:
    """`desc`, or the table's candidate of exactly `mode` if desc is above it, else NONE."""
    if mode_ordinal(desc.cg_mode) <= mode_ordinal(mode):
        return desc
    if mode is not CUDAGraphMode.NONE:
        for cand in table.candidates(num_tokens):
            if cand.cg_mode is mode and cand.fits(num_reqs, num_tokens, q):
                return cand
    return BatchExecutionDescriptor(CUDAGraphMode.NONE, num_tokens, num_reqs)


def coordinate(reports: Sequence[DPReport], table: DispatchTable, pad_eager: bool = False) -> DPDecision:
    """The DP decision from every rank's report (pure; the same on every rank). See the module doc."""
    if not reports:
        raise ValueError("coordinate() needs one report per DP rank, got none")
    real_tokens = tuple(r.num_tokens for r in reports)
    real_reqs = tuple(r.num_reqs for r in reports)
    busy = [r for r in reports if not r.idle]
    if not busy:
        return DPDecision(None, 0, 0, None, False, None, real_tokens, real_reqs, (0,) * len(reports), pad_eager)

    num_tokens = max(real_tokens)
    num_reqs = max(real_reqs)
    mode = min((r.mode for r in busy), key=mode_ordinal)
    qs = {r.uniform_token_count for r in busy}
    q = qs.pop() if len(qs) == 1 else None  # a None among them makes the set > 1 or {None}

    desc = _capped(table, table.dispatch(num_reqs, num_tokens, q), mode, num_reqs, num_tokens, q)
    if desc.is_eager:
        desc = BatchExecutionDescriptor(CUDAGraphMode.NONE, num_tokens, num_reqs)
        run_tokens = tuple(t if t > 0 and not pad_eager else num_tokens for t in real_tokens)
    else:
        run_tokens = (desc.num_tokens,) * len(reports)

    padded = desc.num_tokens
    split = padded // 2
    # All-or-nothing, and every rank's second microbatch [split, real) must hold a real token.
    microbatch = all(r.wants_microbatch for r in reports) and split >= 1 and min(real_tokens) > split
    return DPDecision(
        desc, num_tokens, num_reqs, q, microbatch, split if microbatch else None, real_tokens, real_reqs, run_tokens,
        pad_eager,
    )


# Every valid field is >= -1; rows of other ranks hold this so MAX keeps the owner's values.
_SENTINEL = -(2**62)


class DPCoordinator:
    """The per-step DP all-reduce over the DP CPU (gloo) group, then `coordinate`.

    cpu_group: the DP CPU group; None = dp_size 1 (no collective, the decision is local).
    table: this rank's DispatchTable (the same configuration on every DP rank).
    timeout_s: how long to wait for the all-reduce before a RuntimeError naming the
        collective (None: the group's own timeout).
    pad_eager: busy ranks under NONE pad to the agreed token count (rule 6; DP + EP).
    """

    def __init__(self, cpu_group: dist.ProcessGroup | None, table: DispatchTable, *,
                 timeout_s: float | None = None, pad_eager: bool = False) -> None:
        self.group = cpu_group
        self.table = table
        self.pad_eager = pad_eager
        self.timeout_s = timeout_s
        if cpu_group is None:
            self.dp_size, self.dp_rank = 1, 0
        else:
            self.dp_size = dist.get_world_size(cpu_group)
            self.dp_rank = dist.get_rank(cpu_group)
        self._buf = torch.empty(self.dp_size, NUM_FIELDS, dtype=torch.int64)  # [dp, fields], host
        self._step = 0
        self.last_decision: DPDecision | None = None

    def gather_reports(self, report: DPReport) -> list[DPReport]:
        """Every rank's report, in DP rank order (the one collective of the step)."""
        step = self._step
        self._step += 1
        if self.group is None or self.dp_size == 1:
            return [report]
        buf = self._buf
        buf.fill_(_SENTINEL)
        buf[self.dp_rank] = torch.tensor(report.pack(), dtype=torch.int64)
        work = dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        try:
            if self.timeout_s is None:
                work.wait()
            else:
                work.wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            limit = "the group's timeout" if self.timeout_s is None else f"timeout_s={self.timeout_s}"
            raise RuntimeError(
                f"DP coordination all_reduce (step {step}, DP rank {self.dp_rank} of {self.dp_size}) did not "
                f"complete within {limit}: a peer DP rank is stalled or dead ({e})"
            ) from e
        rows = buf.tolist()
        if any(v == _SENTINEL for row in rows for v in row):
            raise RuntimeError(f"DP coordination step {step}: a rank sent no report: {rows}")
        return [DPReport.unpack(row) for row in rows]

    def coordinate(self, report: DPReport) -> DPDecision:
        """One all-reduce, then the shared decision (use `.for_rank(self.dp_rank)` for this rank's plan)."""
        decision = coordinate(self.gather_reports(report), self.table, self.pad_eager)
        self.last_decision = decision
        return decision

    def plan(self, report: DPReport) -> RankPlan:
        """`coordinate(report).for_rank(self.dp_rank)`."""
        return self.coordinate(report).for_rank(self.dp_rank)
