"""Which running requests a step may take under pipelined PP (the scheduler's pipeline rule).

With P stages, a request's sampled token reaches stage 0 only after its step has passed every
stage, and the engine keeps several batches in flight so that every stage has work. The rule
lets a request run again while that token is still on its way (a placeholder, as async
scheduling on one GPU does) once its last step is at least P steps old: the token is then
due, and stage 0 applies the last stage's broadcast of it on the device before the new
step's inputs are prepared (`PipelineStage.receive`). So the host never waits for a
token before it launches the next batch; a stage waits only for the broadcast itself.

Each step takes at most ceil(running / P) running requests, so the batches in flight stay
about equal in size (P lanes form by themselves: a request scheduled at step s is eligible
again at s + P). Steps are counted as plans with tokens, which is what the runner counts.

`disjoint=True` is the earlier rule (`pp_token_placeholders=False`): a request with a token in
flight waits until the host has it, so the batches in flight hold disjoint requests and the
host resolves a batch before its requests run again.
"""

from __future__ import annotations

from collections.abc import Iterable

from graphrunner.engine.request import Request

__all__ = ["PipelineRule"]


class PipelineRule:
    """The pipeline rule of a scheduler whose plans go through `depth` = P >= 2 stages."""

    def __init__(self, depth: int, disjoint: bool = False) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 2:
            raise ValueError(f"pipeline depth={depth!r} must be an int >= 2 (the pipeline's stage count)")
        self.depth, self.disjoint = depth, disjoint
        self.num_steps = 0  # plans with tokens so far: the index of the next one

    def waits(self, req: Request) -> bool:
        """For `req` with a token in flight: True while it ran in one of the last P - 1 plans
        (disjoint: while any token is in flight)."""
        return self.disjoint or req.last_pipeline_step > self.num_steps - self.depth

    def cap(self, num_running: int) -> int:
        """Running requests one plan may take: an equal share of P batches in flight (disjoint: all)."""
        return num_running if self.disjoint else -(-num_running // self.depth)

    def launched(self, requests: Iterable[Request]) -> None:
        """A plan with tokens was made with these requests."""
        for req in requests:
            req.last_pipeline_step = self.num_steps
        self.num_steps += 1
