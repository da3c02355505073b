"""StepLimits: the sizes every step is bounded by, derived once from the runner's config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepLimits:
    """The sizes every step is bounded by (from the runner's config)."""

    max_num_reqs: int
    max_num_tokens: int
    max_model_len: int
    block_size: int
    max_num_blocks_per_req: int
    vocab_size: int
    uniform_decode_query_len: int  # q = 1 + num_speculative_tokens
    tokens_per_block: int = 0  # positions one block serves per request (block_size x DCP size); 0: block_size

    def __post_init__(self) -> None:
        if not self.tokens_per_block:
            object.__setattr__(self, "tokens_per_block", self.block_size)
