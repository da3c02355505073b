"""StepBuffers: every tensor a step reads or writes on the device, in one place.

A captured graph bakes in the address of every tensor its step touches (docs/architecture.md §4),
so each of them is allocated once, at its largest size, before capture, and rewritten in
place afterwards. `StepBuffers` holds them all — the per-step inputs, the per-request
state rows, the sampled-logprob outputs, the pipeline-parallel stage buffers and the KV
caches — and derives the list of graph-visible tensors from its fields (`static_tensors`),
so that the debug address check cannot miss a holder that someone adds later.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from graphrunner.layers.lora.weights import LoraBuffers
from graphrunner.spec_decode.step import SpecBuffers
from graphrunner.state.block_tables import BlockTables
from graphrunner.state.features import SamplingFeatures
from graphrunner.state.requests import RequestState
from graphrunner.state.sampling import SamplingStates
from graphrunner.step.inputs import InputBuffers


@dataclass
class LogprobBuffers:
    """Sampled-token logprobs: column 0 = the sampled token, then the top-K (K = the
    all-features variant's). Persistent so that captured graphs write them in place.
    One row per sampled position: k + 1 per batch entry with speculative decoding."""

    values: torch.Tensor  # [positions, K_all + 1] float32
    token_ids: torch.Tensor  # [positions, K_all + 1] int32
    ranks: torch.Tensor  # [positions] int32

    @classmethod
    def allocate(cls, num_positions: int, device: torch.device) -> LogprobBuffers:
        cols = SamplingFeatures.all_on().num_logprobs + 1
        return cls(
            values=torch.zeros(num_positions, cols, dtype=torch.float32, device=device),
            token_ids=torch.zeros(num_positions, cols, dtype=torch.int32, device=device),
            ranks=torch.zeros(num_positions, dtype=torch.int32, device=device),
        )


@dataclass
class StageBuffers:
    """Pipeline parallelism: (hidden, residual) received from the previous stage and sent
    to the next, [max_num_tokens, hidden] each; None where this stage has no such peer."""

    hidden_in: torch.Tensor | None = None
    residual_in: torch.Tensor | None = None
    hidden_out: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None

    @classmethod
    def allocate(cls, max_num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device, *,
                 receives: bool, sends: bool) -> StageBuffers:
        def buf() -> torch.Tensor:
            return torch.zeros(max_num_tokens, hidden_size, dtype=dtype, device=device)

        return cls(
            hidden_in=buf() if receives else None, residual_in=buf() if receives else None,
            hidden_out=buf() if sends else None, residual_out=buf() if sends else None,
        )


@dataclass
class StepBuffers:
    """The graph-visible tensors of a runner, grouped by owner."""

    inputs: InputBuffers
    requests: RequestState
    sampling: SamplingStates
    logprobs: LogprobBuffers
    stage: StageBuffers = field(default_factory=StageBuffers)
    spec: SpecBuffers | None = None  # speculative decoding's per-entry slots
    block_tables: BlockTables | None = None
    kv_caches: list[torch.Tensor] = field(default_factory=list)
    draft_kv_caches: list[torch.Tensor] = field(default_factory=list)  # the draft model's, same blocks
    lora: LoraBuffers | None = None  # the per-step LoRA slot metadata (LoRA on)
    pool: Any = None  # a pooling runner's pooled rows (pool.runner.PoolBuffers)
    embeds: Any = None  # prompt / multimodal embeddings the first stage reads (multimodal.embeds.EmbedBuffers)
    mrope: Any = None  # M-RoPE models' (t, h, w) positions the first stage reads (multimodal.mrope.MRopeBuffers)

    def static_tensors(self) -> dict[str, torch.Tensor]:
        """Every device tensor of every holder, by `holder.attribute` name (debug address checks).

        Host tensors (pinned upload slots) are left out: graphs never read them.
        """
        found: dict[str, torch.Tensor] = {}
        for f in dataclasses.fields(self):
            _collect(f.name, getattr(self, f.name), found)
        device = self.inputs.packed.device
        return {name: t for name, t in found.items() if t.device == device}


def _collect(name: str, value: object, found: dict[str, torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        found[name] = value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if isinstance(item, torch.Tensor):
                found[f"{name}[{i}]"] = item
    elif value is not None:
        for attr, item in vars(value).items():
            if isinstance(item, torch.Tensor):
                found[f"{name}.{attr}"] = item
