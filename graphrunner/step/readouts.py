"""RunnerReadouts: what engines and tools read from a `ModelRunner`, kept out of runner.py.

A mixin of read-only properties over the runner's parts (buffers, state, limits); the
runner class inherits it, so `runner.vocab_size` and friends stay where users look. Also
`grammar_block`: the host memory an engine fills with a step's grammar masks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from capture.descriptor import BatchExecutionDescriptor
    from graphrunner.limits import StepLimits
    from graphrunner.state.requests import RequestState
    from graphrunner.state.sampling import SamplingStates
    from graphrunner.state.store import StateStore
    from graphrunner.step.buffers import StepBuffers
    from graphrunner.step.inputs import InputBuffers


class RunnerReadouts:
    """Read-only views of a runner (set by `ModelRunner.__init__`)."""

    buffers: StepBuffers
    state: StateStore
    limits: StepLimits
    _last_descriptor: BatchExecutionDescriptor | None

    @property
    def input_buffers(self) -> InputBuffers:
        return self.buffers.inputs

    @property
    def req_states(self) -> RequestState:
        return self.state.requests

    @property
    def sampling_states(self) -> SamplingStates:
        return self.state.sampling

    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def uniform_decode_query_len(self) -> int:
        return self.limits.uniform_decode_query_len

    @property
    def num_kv_blocks(self) -> int:
        return self.state.block_tables.num_kv_blocks if self.state.block_tables is not None else 0

    def grammar_block(self, num_rows: int, words: int) -> torch.Tensor:
        """[num_rows, words] int32 host memory (pinned on CUDA) to fill with the next step's
        `GrammarOutput` masks (pass it as `pinned`): uploaded with their placement in one copy,
        without a host copy. Valid until the block after next is taken (the runner reuses it)."""
        return self.state.sampling.grammar_block(num_rows, words)

    @property
    def last_descriptor(self) -> BatchExecutionDescriptor | None:
        """The descriptor the last executed step ran with (None before the first step)."""
        return self._last_descriptor


__all__ = ["RunnerReadouts"]
