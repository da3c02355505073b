"""Engine-facing types: what a scheduler hands the runner each step and what comes back.

Names follow vLLM's so that an engine written against vLLM's model runner ports with
few changes. All of these are plain host-side data (lists and dicts of Python ints).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (vLLM's names and semantics).

    temperature 0 means greedy. top_k <= 0, top_p == 1 and min_p == 0 disable those
    filters. repetition_penalty == 1 and frequency/presence_penalty == 0 disable the
    penalties; repetition counts prompt and output tokens, frequency/presence count
    output tokens only. logit_bias maps token id -> additive bias; allowed_token_ids
    restricts sampling to those ids. Until `min_tokens` tokens were generated, the
    stop ids and EOS (unless ignore_eos) cannot be drawn. `logprobs=k` returns the
    sampled token's logprob and rank plus the top-k (k=0: the sampled token only);
    `prompt_logprobs=k` does the same for every prompt position. A request with a
    `seed` gets the same tokens whatever batch it shares a step with. Vocabulary-
    dependent limits (token ids < vocab, slot counts) are checked by
    `SamplingStates.validate`, since the vocabulary is the runner's.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: "Mapping[int, float] | None" = None
    allowed_token_ids: tuple[int, ...] | None = None
    min_tokens: int = 0
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be a finite value >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1] (0 disables it)")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be a finite value > 0 (1 disables it)")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name}={value} must be in [-2, 2] (0 disables it)")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens} must be >= 0")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name}={value} must be >= 0 (or None to disable it)")
        # Accept lists/dicts from callers but keep the dataclass hashable and immutable.
        stop = tuple(int(t) for t in self.stop_token_ids)
        if any(t < 0 for t in stop):
            raise ValueError(f"stop_token_ids={stop} must be >= 0")
        object.__setattr__(self, "stop_token_ids", stop)
        if self.allowed_token_ids is not None:
            allowed = tuple(int(t) for t in self.allowed_token_ids)
            if not allowed:
                raise ValueError("allowed_token_ids=[] is empty: it would allow no token (use None to allow all)")
            if any(t < 0 for t in allowed):
                raise ValueError(f"allowed_token_ids contains a negative id: {min(allowed)}")
            object.__setattr__(self, "allowed_token_ids", allowed)
        if self.logit_bias is not None:
            bias = FrozenLogitBias(self.logit_bias)
            object.__setattr__(self, "logit_bias", bias if bias else None)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


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


class ModelRunnerOutput:
    """Sampled tokens of one step.

    `sampled_token_ids[i]` belongs to `req_ids[i]`; it is empty for a request whose
    prefill chunk did not reach the end of its prompt (nothing to sample yet).

    The runner builds this from a token array (`from_token_array`): the per-entry lists
    and the id -> index map are made on first access, not per step. Building 256
    one-token lists costs ~12 us, a fifth of the per-step host budget; an engine that
    reads `token_array` / `sampled_token(i)` never pays it.
    """

    __slots__ = ("req_ids", "_index", "_index_source", "_sampled", "_tokens", "_produces", "logprobs",
                 "prompt_logprobs_dict")

    def __init__(
        self,
        req_ids: list[str] | None = None,
        req_id_to_index: dict[str, int] | None = None,
        sampled_token_ids: list[list[int]] | None = None,
        logprobs: "list[list[dict[int, Logprob]]] | None" = None,
        prompt_logprobs_dict: "dict[str, list[dict[int, Logprob] | None]] | None" = None,
    ):
        self.req_ids: list[str] = req_ids if req_ids is not None else []
        self._index = req_id_to_index if req_id_to_index is not None else ({} if req_ids is None else None)
        self._index_source: dict[str, int] | None = None
        self._sampled = sampled_token_ids if sampled_token_ids is not None else ([] if req_ids is None else None)
        self._tokens: np.ndarray | None = None
        self._produces: np.ndarray | None = None
        # Per entry, one `{token_id: Logprob}` per sampled token (the sampled token first, with
        # its rank, then the request's top-k); [] for entries that asked for none. None when
        # no entry of the step asked for logprobs.
        self.logprobs = logprobs
        # Requests whose prompt logprobs completed this step: req_id -> PromptLogprobs.
        self.prompt_logprobs_dict = prompt_logprobs_dict if prompt_logprobs_dict is not None else {}

    @classmethod
    def from_token_array(
        cls,
        req_ids: list[str],
        tokens: np.ndarray,
        produces: np.ndarray | None = None,
        index_source: dict[str, int] | None = None,
        logprobs: "list[list[dict[int, Logprob]]] | None" = None,
        prompt_logprobs_dict: "dict[str, list[dict[int, Logprob] | None]] | None" = None,
    ) -> "ModelRunnerOutput":
        """One token per entry. tokens: [R] int (owned by the output: not a view of a
        reused buffer); produces: [R] bool, False where the entry sampled nothing (None:
        every entry did); index_source: `req_ids`' id -> index map, copied on first access
        (None: built from req_ids)."""
        out = cls(req_ids, None, None, logprobs, prompt_logprobs_dict)
        out._tokens, out._produces, out._index_source = tokens, produces, index_source
        return out

    @classmethod
    def empty(cls) -> "ModelRunnerOutput":
        return cls()

    # ---- lazily built views ----------------------------------------------------------
    @property
    def req_id_to_index(self) -> dict[str, int]:
        if self._index is None:
            src = self._index_source
            self._index = dict(src) if src is not None else {rid: i for i, rid in enumerate(self.req_ids)}
        return self._index

    @req_id_to_index.setter
    def req_id_to_index(self, value: dict[str, int]) -> None:
        self._index = value

    @property
    def sampled_token_ids(self) -> list[list[int]]:
        if self._sampled is None:
            assert self._tokens is not None
            if self._produces is None:
                self._sampled = [[t] for t in self._tokens.tolist()]
            else:
                self._sampled = [[t] if p else [] for t, p in zip(self._tokens.tolist(), self._produces.tolist())]
        return self._sampled

    @sampled_token_ids.setter
    def sampled_token_ids(self, value: list[list[int]]) -> None:
        self._sampled, self._tokens, self._produces = value, None, None

    @property
    def token_array(self) -> np.ndarray | None:
        """[R] int32, entry i's sampled token (meaningless where it sampled nothing); None
        for an output built from lists."""
        return self._tokens

    def sampled_token(self, index: int) -> int | None:
        """Entry `index`'s one sampled token, None where it sampled nothing."""
        if self._tokens is not None and self._sampled is None:
            if self._produces is not None and not self._produces[index]:
                return None
            return int(self._tokens[index])
        toks = self.sampled_token_ids[index]
        if len(toks) > 1:
            raise ValueError(f"entry {index} sampled {len(toks)} tokens; use sampled_token_ids")
        return toks[0] if toks else None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModelRunnerOutput):
            return NotImplemented
        return (self.req_ids == other.req_ids and self.req_id_to_index == other.req_id_to_index
                and self.sampled_token_ids == other.sampled_token_ids and self.logprobs == other.logprobs
                and self.prompt_logprobs_dict == other.prompt_logprobs_dict)

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        return (f"ModelRunnerOutput(req_ids={self.req_ids!r}, sampled_token_ids={self.sampled_token_ids!r}, "
                f"logprobs={'None' if self.logprobs is None else '...'}, "
                f"prompt_logprobs_dict={list(self.prompt_logprobs_dict)!r})")


# ---- logprob containers (vLLM's shape) ----------------------------------------------


class FrozenLogitBias(dict):
    """An immutable, hashable `{token_id: bias}` mapping (SamplingParams.logit_bias).

    Keys are ints (str keys, as JSON clients send them, are converted); biases must be
    finite. Mutating methods raise TypeError, so SamplingParams stays hashable.
    """

    def __init__(self, items: "Mapping[int, float] | None" = None):
        clean: dict[int, float] = {}
        for token, bias in dict(items or {}).items():
            try:
                token_id = int(token)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias key {token!r} is not a token id") from None
            if token_id < 0:
                raise ValueError(f"logit_bias token id {token_id} must be >= 0")
            bias = float(bias)
            if not math.isfinite(bias):
                raise ValueError(f"logit_bias[{token_id}]={bias} must be finite")
            clean[token_id] = bias
        super().__init__(clean)

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))

    def _immutable(self, *args, **kwargs):
        raise TypeError("SamplingParams.logit_bias is immutable")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _immutable  # type: ignore[assignment]

    def __ior__(self, other):  # type: ignore[override]
        self._immutable()

    def __reduce__(self):
        return (FrozenLogitBias, (dict(self),))


@dataclass(frozen=True)
class Logprob:
    """One token's log probability (vLLM's `Logprob`): rank 1 is the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# A generated position's logprobs: token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]  # one dict per generated token
# Prompt positions' logprobs; the first prompt token has none (no context), as in vLLM.
PromptLogprobs = list[dict[int, Logprob] | None]  # one entry per prompt token
