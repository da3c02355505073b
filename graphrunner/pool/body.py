"""PoolingBody: the step body of a pooling runner: prepare inputs -> forward -> pool.

No sampler and no post-update: a pooling request's prompt is its whole life, so nothing is
appended to its history. The same function runs eagerly, inside FULL graphs and around the
PIECEWISE pieces (`StepBody.run` calls these overrides).
"""

from __future__ import annotations

from graphrunner.step.body import StepBody
from graphrunner.step.inputs import InputBatch


class PoolingBody(StepBody):
    """`StepBody` whose last stages pool into `buffers.pool.rows` instead of sampling."""

    def forward_and_sample(self, batch: InputBatch, piecewise: bool = False) -> None:
        hidden = self.forward(batch, piecewise)  # [T_pad, H]
        pool = self.buffers.pool
        assert pool is not None, "load_model() allocates the pooled rows"
        r_pad = batch.num_reqs_padded
        self.model.pool(hidden, batch.query_start_loc, batch.logits_indices, out=pool.rows[:r_pad])

    def post_update(self, batch: InputBatch) -> None:
        """Nothing to advance: a pooling step samples no token."""
