"""A request's life inside the reference engine, and what the engine hands back when it ends."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from graphrunner.multimodal.features import MultiModalFeatureSpec
from graphrunner.pool.params import PoolingParams
from graphrunner.protocol import LoRARequest, ModelRunnerOutput, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted and waiting to be resumed
    RUNNING = "running"  # admitted: holds KV blocks and a row in the runner
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop token
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "finished_aborted"  # aborted by the caller

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(frozen=True)
class RequestExtras:
    """What a request hands the runner besides its token ids (vLLM's `NewRequestData` fields):
    `pooling_params` (a pooling request), `prompt_embeds` ([prompt_len, hidden], replacing the
    placeholder ids' embeddings) and `mm_features` (multimodal inputs at their placeholders).
    `embeds_hash`: the content hash of `prompt_embeds`, which keys its blocks in the prefix cache."""

    pooling_params: PoolingParams | None = None
    prompt_embeds: Any = None
    mm_features: tuple[MultiModalFeatureSpec, ...] = ()
    embeds_hash: str | None = None

    def block_key_tokens(self, token_ids: list[int]) -> list[Any]:
        """`token_ids` as the prefix cache keys them: positions an embedding fills carry its content
        hash instead of their placeholder id, so equal prompts with different images (or prompt
        embeddings) never share a block."""
        if self.embeds_hash is None and not self.mm_features:
            return token_ids
        keys: list[Any] = list(token_ids)
        if self.embeds_hash is not None and self.prompt_embeds is not None:
            n = len(self.prompt_embeds)
            keys[:n] = [self.embeds_hash] * n
        for f in self.mm_features:
            pos = f.mm_position
            keys[pos.offset : pos.end] = [f.identifier] * pos.length
        return keys


class TokenChain(Sequence[int]):
    """`head + tail` without copying either: length, items and slices (a slice is a list)."""

    __slots__ = ("head", "tail")

    def __init__(self, head: list[int], tail: list[int]) -> None:
        self.head, self.tail = head, tail

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        head, n = self.head, len(self.head)
        if isinstance(index, slice):
            start, stop, step = index.indices(n + len(self.tail))
            if step != 1:
                return (head + self.tail)[index]
            if stop <= n:
                return head[start:stop]
            if start >= n:
                return self.tail[start - n : stop - n]
            return head[start:] + self.tail[: stop - n]
        if index < 0:
            index += n + len(self.tail)
        return head[index] if index < n else self.tail[index - n]


@dataclass
class Request:
    """Scheduler-side state of one request.

    `num_computed_tokens` counts tokens whose KV is in the cache; the last sampled token
    is never computed until the step after it was sampled, so a running request always
    has `num_tokens - num_computed_tokens >= 1` tokens left to schedule.

    A running request is in prefill until its chunks reach `num_prefill_tokens` (every
    token known when it was admitted, the runner's prefill length), then decoding: each
    step computes its last sampled token, behind which speculative decoding places draft
    slots.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    # Tokens known at the last admission (prompt, plus the outputs of a resumed request).
    num_prefill_tokens: int = 0
    # Async scheduling: tokens sampled by launched steps whose output is not resolved yet,
    # one per step (a verifying step emits 1..1 + k: then a lower bound). Their values stay
    # on the device (the runner feeds them to the next step); the host counts them so that
    # it can schedule the next decode before they are known.
    num_output_placeholders: int = 0
    # Pipelined PP: the index of the last plan that ran it (engine/pipeline_rule.py).
    last_pipeline_step: int = -(1 << 62)
    # SamplingParams.logprobs: one {token_id: Logprob} per output token.
    logprobs: list[dict] | None = None
    # SamplingParams.prompt_logprobs: None for the first prompt token, then one dict each.
    prompt_logprobs: list[dict | None] | None = None
    # n > 1: a sibling queued only once this request's prompt blocks are in the prefix cache.
    wait_for: str | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at first admission
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with; None: the base model
    extras: RequestExtras = field(default_factory=RequestExtras)

    @property
    def cache_salt(self) -> int:
        """What keys its prefix-cache blocks apart from other adapters' (0: the base model)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    def __post_init__(self) -> None:
        if self.sampling_params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    def append_output(self, token: int, logprobs: dict | None) -> None:
        """One sampled token (and its logprobs when the request asked for them)."""
        if not self.output_token_ids:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)

    def take_prompt_logprobs(self, runner_output: ModelRunnerOutput) -> None:
        """Keep the first complete prompt logprobs of a step's output (a resumed request does not repeat them)."""
        got = runner_output.prompt_logprobs_dict.get(self.req_id)
        if got is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = got

    def stop_status(self, eos_token_ids: frozenset[int], max_model_len: int) -> RequestStatus | None:
        """How the last appended token ends the request, or None. Stop tokens take precedence
        over length: a final EOS reads as "stop"."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if (not params.ignore_eos and last in eos_token_ids) or last in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    @property
    def is_decoding(self) -> bool:
        """Every token known at admission is computed: each step now computes the last sampled token."""
        return 0 < self.num_prefill_tokens <= self.num_computed_tokens

    @property
    def finish_reason(self) -> str | None:
        """The reason the request ended ("stop", "length" or "abort"); None while it is live."""
        return self.status.finish_reason

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def block_key_tokens(self) -> Sequence[Any]:
        """The tokens the prefix cache keys this request's blocks by (`RequestExtras.block_key_tokens`).
        Without embeddings, a view of prompt and output: the cache slices one block of it per call, and
        joining the two lists for that cost 5.7 us a call at 1,000 tokens."""
        extras = self.extras
        if extras.embeds_hash is None and not extras.mm_features:
            return TokenChain(self.prompt_token_ids, self.output_token_ids)
        return extras.block_key_tokens(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens plus one per in-flight sampling step (equal to num_tokens when in sync)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_output_placeholders

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens_with_placeholders - self.num_computed_tokens

    def to_output(self) -> SequenceOutput:
        return SequenceOutput(
            req_id=self.req_id,
            prompt_token_ids=list(self.prompt_token_ids),
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            request_params=self.sampling_params,
            arrival_time=self.arrival_time,
            first_token_time=self.first_token_time,
        )


@dataclass
class SequenceOutput:
    """What the scheduler hands back for one of its requests (a sequence: one completion of a
    prompt): flat, token ids only. `OutputProcessor` turns these into `RequestOutput`s.

    In a stream each is a delta: `token_ids` and `logprobs` hold what is new since the
    request's previous one, and the last one has the finish reason (and the prompt logprobs).
    """

    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    # SamplingParams.logprobs=k: per generated token {token_id: Logprob} (the sampled token
    # with its rank, then the top-k); None when not asked for.
    logprobs: list[dict] | None = None
    # SamplingParams.prompt_logprobs=k: None for the first prompt token, then one dict per token.
    prompt_logprobs: list[dict | None] | None = None
    # The detokenized output (cut at a stop string); None when the model has no tokenizer.
    text: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    request_params: SamplingParams = field(default_factory=SamplingParams)  # the request's sampling params
    arrival_time: float | None = None
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    """One completion of a prompt (vLLM's `CompletionOutput`).

    Attributes:
        index: the completion's number among the prompt's `n` (or `best_of`) samples.
        text: the generated text (special tokens skipped unless asked; "" without a tokenizer).
        token_ids: the generated token ids.
        cumulative_logprob: the sum of the sampled tokens' logprobs; None unless logprobs were computed.
        logprobs: per generated token, {token_id: Logprob} (the sampled token and the top-k), when asked.
        finish_reason: "stop", "length" or "abort"; None while the request runs.
        stop_reason: the stop string or stop token id that ended it; None for EOS, length or abort.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """Whether this completion has ended (vLLM: a method)."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Times (time.monotonic()) of a request's life: queued, first token, finished."""

    arrival_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """A prompt's outputs, in vLLM's shape: `outputs[i]` is its i-th completion.

    From `LLM.generate` every output is final (`finished`). In a stream
    (`LLM.generate_stream`) each is a delta: `outputs` holds the completions with news, each
    with only its new `token_ids`, `text` and `logprobs`; the last one per prompt has
    `finished=True` (and the prompt logprobs).

    Attributes:
        request_id: the prompt's id (its number in the call order, as a string, unless given).
        prompt: the prompt text (None for a token-id prompt).
        prompt_token_ids: the prompt's token ids.
        prompt_logprobs: with `SamplingParams.prompt_logprobs=k`: None for the first prompt
            token, then {token_id: Logprob} per token.
        outputs: the completions (`n` of them when final).
        finished: every completion has ended.
        metrics: arrival, first-token and finish times.
        num_cached_tokens: prompt tokens served from the prefix cache.

    The flat fields of earlier releases (`req_id`, `token_ids`, `text`, `logprobs`,
    `finish_reason`) remain as read-only properties (of the first completion) for one release.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None

    def _first(self) -> CompletionOutput:
        if not self.outputs:
            raise AttributeError(f"request {self.request_id!r}: this output holds no completion")
        return self.outputs[0]

    @property
    def req_id(self) -> str:
        """Deprecated: `request_id`."""
        return self.request_id

    @property
    def token_ids(self) -> list[int]:
        """Deprecated: `outputs[0].token_ids`."""
        return self._first().token_ids

    @property
    def text(self) -> str:
        """Deprecated: `outputs[0].text`."""
        return self._first().text

    @property
    def logprobs(self) -> list[dict] | None:
        """Deprecated: `outputs[0].logprobs`."""
        return self._first().logprobs

    @property
    def finish_reason(self) -> str | None:
        """Deprecated: `outputs[0].finish_reason`."""
        return self._first().finish_reason
