"""A request's life inside the reference engine, and what the engine hands back when it ends."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from graphrunner.protocol import ModelRunnerOutput, SamplingParams


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

    def __post_init__(self) -> None:
        if self.sampling_params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    def append_output(self, token: int, logprobs: dict | None) -> None:
        """One sampled token (and its logprobs when the request asked for them)."""
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

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            req_id=self.req_id,
            prompt_token_ids=list(self.prompt_token_ids),
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
        )


@dataclass
class RequestOutput:
    """A finished request, shaped like vLLM's: `.token_ids` are the generated tokens only.

    In a stream (`LLM.generate_stream`) each output is a delta: `token_ids`, `text` and
    `logprobs` hold what is new since that request's previous output, and the last one
    has the finish reason (and the prompt logprobs).
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
    # The detokenized output (special tokens skipped, cut before a stop string); None when
    # the model has no tokenizer.
    text: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

