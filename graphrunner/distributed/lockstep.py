"""LockstepDP: data-parallel replicas that step together, for collectives that span them.

Replicas of a dense model share no collective, so by default each runs on its own (no
per-step exchange, no padding to another replica, no dummy steps) and the runner holds no
`LockstepDP`. With `data_parallel_lockstep=True` the runner holds one and calls it at two
fixed points of the step: `dispatch` (the `DPCoordinator`'s one CPU all-reduce of every
replica's report gives the agreed descriptor) and `idle_step` (a replica with nothing
scheduled runs a dummy step of the agreed descriptor, so every collective inside the step
matches). With `enable_dbo` too, each report says whether the rank would split its step;
when the decision says microbatch, the step's forward runs as two microbatches on two
streams (`graphrunner.step.microbatch`): a uniform-decode step replays the microbatched twin
of the agreed FULL descriptor, any other step runs eagerly; both are counted in
`num_microbatched_steps`.

With expert parallelism across the replicas (`ep`, the MoE layers' `DPComm`) every MoE layer
gathers its tokens over the DP group, so every rank must run exactly the agreed token count
in every mode: eager steps pad to it too (the coordinator's `pad_eager`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from capture.descriptor import BatchExecutionDescriptor
from capture.modes import CUDAGraphMode
from graphrunner.distributed.dp_coordinator import DPCoordinator, DPDecision, DPReport, RankPlan
from graphrunner.distributed.groups import ParallelGroups
from graphrunner.distributed.pipeline_stage import PipelineStage
from graphrunner.state.features import SamplingFeatures
from graphrunner.step.microbatch import Microbatcher, wants_microbatch


class LockstepDP:
    """The agreed descriptor of every step, and the dummy steps of idle replicas.

    graphs: the runner's `StepGraphs` (dispatch table, capture state, the step body);
    pp: the rank's pipeline stage (a dummy step exchanges like a real one), None without PP.
    """

    def __init__(self, groups: ParallelGroups, graphs: Any, pp: PipelineStage | None, device: torch.device,
                 ep: Any = None, side_comms: Any = None) -> None:
        self.groups = groups
        self.graphs = graphs
        self.pp = pp
        self.device = device
        self.ep = ep  # DP + EP: the MoE layers' DPComm (None: replicas share no collective in the model)
        self.side_comms = side_comms  # DBO under DP + EP on CUDA: microbatch 1's communicators
        self._coordinator = DPCoordinator(groups.dp.cpu_group, graphs.table, pad_eager=ep is not None)
        self.last_dp_decision: DPDecision | None = None
        self.num_dummy_steps = 0  # idle-replica dummy steps run so far
        self.num_steps = 0  # steps this replica ran in lockstep (its own or a dummy)
        self._ubatch: Microbatcher | None = None  # DBO (its microbatched FULL graphs capture through it)
        if groups.config.enable_dbo:
            body = graphs.body
            self._ubatch = body.microbatch = Microbatcher(body.limits.max_num_reqs, device, ep, side_comms,
                                                          self._agree_sizes if ep is not None else None)

    @property
    def num_microbatched_steps(self) -> int:
        """Steps whose forward actually ran as two microbatches (DBO; 0 without it)."""
        return self._ubatch.num_steps if self._ubatch is not None else 0

    @property
    def num_microbatched_graph_steps(self) -> int:
        """Of those, the steps that replayed a microbatched FULL graph."""
        return self._ubatch.num_graph_steps if self._ubatch is not None else 0

    def dispatch(self, num_reqs: int, num_tokens: int, uniform: int | None,
                 force_eager: bool = False) -> BatchExecutionDescriptor:
        """The step's descriptor as every replica agreed it (one all-reduce)."""
        plan = self._coordinate(num_reqs, num_tokens, uniform, force_eager)
        assert plan.descriptor is not None and not plan.dummy, "a busy DP rank got no descriptor"
        if plan.microbatch:
            twin = self.graphs.microbatch_twin(plan.descriptor)
            if twin is not None:  # the two microbatches' FULL graph: every rank agreed on the descriptor
                assert self._ubatch is not None, "built with enable_dbo"
                self._ubatch.replayed(twin)
                return twin
            # two microbatches run eagerly at this rank's real size (step/microbatch.py)
            tokens = plan.descriptor.num_tokens if self.ep is not None else num_tokens  # DP + EP: the agreed one
            return BatchExecutionDescriptor(CUDAGraphMode.NONE, tokens, num_reqs)
        return plan.descriptor

    def idle_step(self) -> bool:
        """A replica with nothing scheduled: join the coordination and run a dummy step of the
        agreed size, so that every collective inside the step (TP, PP, EP) matches. False when
        every replica was idle and nobody ran anything."""
        plan = self._coordinate(0, 0, None)
        if plan.descriptor is None:  # every replica is idle: nobody runs anything
            return False
        self.num_dummy_steps += 1
        self._dummy_step(plan.descriptor)
        return True

    def _coordinate(self, num_reqs: int, num_tokens: int, uniform: int | None, force_eager: bool = False) -> RankPlan:
        """One DP all-reduce; returns this rank's `RankPlan` (and arms or disarms DBO's split)."""
        graphs = self.graphs
        wants = self._wants_microbatch(num_reqs, num_tokens, uniform)
        # Before capture every step is eager: report NONE so that nobody replays.
        report = DPReport.from_batch(graphs.table, num_reqs, num_tokens, uniform, wants_microbatch=wants,
                                     force_eager=force_eager or not graphs.captured)
        with self.groups.exchange("DP step agreement (all-reduce over the data-parallel replicas)"):
            decision = self._coordinator.coordinate(report)
        self.last_dp_decision = decision
        plan = decision.for_rank(self.groups.dp_rank)
        self.num_steps += not plan.skip
        if self._ubatch is not None:
            self._ubatch.arm(plan.ubatch_split if plan.microbatch and not plan.dummy else None)
        return plan

    def _wants_microbatch(self, num_reqs: int, num_tokens: int, uniform: int | None) -> bool:
        """DBO (config.enable_dbo): whether this rank would split its step; builds the microbatcher once."""
        config, body = self.groups.config, self.graphs.body
        if not config.enable_dbo:
            return False
        return wants_microbatch(num_reqs, num_tokens, uniform, body.limits.uniform_decode_query_len,
                                config.dbo_decode_token_threshold, config.dbo_prefill_token_threshold)

    def _agree_sizes(self, first: int, second: int) -> tuple[int, int]:
        """An eager microbatched step under DP + EP: the largest first and second microbatch over the
        replicas (their cuts differ), which each microbatch's MoE layers pad to (one CPU all-reduce)."""
        sizes = torch.tensor([first, second], dtype=torch.int64)
        with self.groups.exchange("DBO microbatch sizes (all-reduce over the data-parallel replicas)"):
            dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=self.groups.dp.cpu_group)
        return int(sizes[0]), int(sizes[1])

    def _dummy_step(self, desc: BatchExecutionDescriptor) -> None:
        """The agreed descriptor over scratch entries only: the same graph / compiled / eager
        body (and PP exchange) as a real step of that shape, touching no live request."""
        graphs = self.graphs
        body = graphs.body
        query_lens = graphs.capture_query_lens(desc)
        num_reqs_padded = desc.num_reqs if desc.num_reqs is not None else len(query_lens)
        batch = body.dummy_batch(query_lens, SamplingFeatures(), num_reqs_padded, desc.num_tokens)
        body.current_batch = batch
        if self.pp is not None:
            self.pp.receive(batch)
        graphs.run(desc, batch)
        if self.pp is not None:
            self.pp.send(batch, None, body.post_update)
        body.current_batch = None
        body.reset_scratch_row()


__all__ = ["LockstepDP"]
