"""Engine-facing types: what a scheduler hands the runner each step and what comes back.

Names follow vLLM's so that an engine written against vLLM's model runner ports with
few changes. All of these are plain host-side data (lists and dicts of Python ints).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    temperature 0 means greedy. top_k <= 0 and top_p == 1 disable those filters. A
    request with a `seed` gets the same tokens whatever batch it shares a step with.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables it)")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs={self.logprobs} must be >= 0")
        # Accept lists from callers but keep the dataclass hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption.

    `output_token_ids` carries tokens generated before a preemption: the runner
    recomputes their KV together with the prompt (preemption by recompute) and
    continues sampling after them.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass
class CachedRequestData:
    """Requests that ran before and continue this step (column-wise, as in vLLM)."""

    req_ids: list[str] = field(default_factory=list)
    # Blocks appended to each request's table this step (None = no new blocks).
    new_block_ids: list[list[int] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One step's plan, from the engine's scheduler."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)

    @classmethod
    def make_empty(cls) -> "SchedulerOutput":
        return cls()


@dataclass
class ModelRunnerOutput:
    """Sampled tokens of one step.

    `sampled_token_ids[i]` belongs to `req_ids[i]`; it is empty for a request whose
    prefill chunk did not reach the end of its prompt (nothing to sample yet).
    """

    req_ids: list[str] = field(default_factory=list)
    req_id_to_index: dict[str, int] = field(default_factory=dict)
    sampled_token_ids: list[list[int]] = field(default_factory=list)

    @classmethod
    def empty(cls) -> "ModelRunnerOutput":
        return cls()
