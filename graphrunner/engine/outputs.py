"""The engine's output side: what each step hands back, finished outputs and stream deltas.

`LLM` runs a step, then `OutputProcessor.process(finished)` turns the scheduler's token
updates into outputs:

- finished: one cumulative `RequestOutput` per request that ended (its tokens, and its text
  when the model has a tokenizer);
- deltas: for streamed requests, one `RequestOutput` per request with news, holding only
  what is new since its last delta (`token_ids`, `text`, `logprobs`); the last one has the
  finish reason.

Stop strings are found here, as in vLLM's output processor: a request whose text now holds
one is finished in the scheduler ("stop"); the runner frees its row with the next step.
Requests that neither stream nor have stop strings are not followed step by step: their
text is decoded once, when they finish.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from graphrunner.engine.detokenizer import IncrementalDetokenizer
from graphrunner.engine.request import RequestOutput, RequestStatus
from graphrunner.engine.scheduler import Scheduler
from graphrunner.protocol import SamplingParams


@dataclass
class _Followed:
    """A request followed step by step (streamed, or matched against stop strings)."""

    prompt_token_ids: list[int]
    stream: bool
    detokenizer: IncrementalDetokenizer | None
    num_seen: int = 0  # output tokens given to the detokenizer (all of them without one)
    num_sent: int = 0  # output tokens handed out in deltas


class OutputProcessor:
    """Builds each step's outputs from the scheduler's requests (module docstring)."""

    def __init__(self, scheduler: Scheduler, tokenizer: Any | None) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self._followed: dict[str, _Followed] = {}
        self._pending: list[RequestOutput] = []  # ended between steps (aborted): reported with the next

    def add_request(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams, stream: bool) -> None:
        """Follow a queued request when it streams or has stop strings (which need a tokenizer)."""
        detokenizer = None
        if self.tokenizer is not None and (stream or params.stop):
            detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, params.min_tokens)
        if stream or detokenizer is not None:
            # One copy for all its deltas: the scheduler's list is never handed out.
            self._followed[req_id] = _Followed(list(prompt_token_ids), stream, detokenizer)

    def add_finished(self, output: RequestOutput) -> None:
        """A request that ended outside a step (aborted): its outputs come with the next `process`."""
        self._pending.append(output)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def clear(self) -> None:
        """Forget every request (the engine aborted them all after a failed step)."""
        self._followed.clear()
        self._pending.clear()

    def forget(self, req_ids: set[str]) -> None:
        """Stop following these requests and drop their unreported outputs (their stream was left)."""
        self._pending = [out for out in self._pending if out.req_id not in req_ids]
        for req_id in req_ids:
            self._followed.pop(req_id, None)

    def process(self, finished: list[RequestOutput]) -> tuple[list[RequestOutput], list[RequestOutput]]:
        """(the finished requests' outputs, the stream deltas) of one step that finished `finished`."""
        finals: list[RequestOutput] = []
        deltas: list[RequestOutput] = []
        ended, self._pending = self._pending + finished, []
        for out in ended:
            self._end(out, self._followed.pop(out.req_id, None), finals, deltas)
        for req_id, state in list(self._followed.items()):
            req = self.scheduler.requests.get(req_id)
            if req is None:  # aborted through the scheduler directly: nothing more to report
                del self._followed[req_id]
                continue
            new = req.output_token_ids[state.num_seen:]
            if not new:
                continue
            kept = state.detokenizer.add_tokens(new) if state.detokenizer is not None else None
            if kept is None:
                state.num_seen += len(new)
                if state.stream:
                    deltas.append(self._delta(req_id, state, req.output_token_ids, req.logprobs, None))
                continue
            # A stop string: the request ends at the token that completed it.
            stopped = self.scheduler.finish_request(req_id, RequestStatus.FINISHED_STOPPED)
            assert stopped is not None  # it is live
            state.num_seen += kept
            del self._followed[req_id]
            self._end(_truncated(stopped, state.num_seen, "stop"), state, finals, deltas)
        return finals, deltas

    def _end(self, out: RequestOutput, state: _Followed | None, finals: list, deltas: list) -> None:
        """The final output of a request that ended (and its last delta when it streams)."""
        if state is None:  # decoded once, now
            text = None if self.tokenizer is None else self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            finals.append(out if text is None else dataclasses.replace(out, text=text))
            return
        detokenizer = state.detokenizer
        if detokenizer is not None and not detokenizer.stopped:
            kept = detokenizer.add_tokens(out.token_ids[state.num_seen:])
            if kept is None:
                detokenizer.flush()
            else:
                out = _truncated(out, state.num_seen + kept, "stop")
        state.num_seen = len(out.token_ids)
        final = dataclasses.replace(out, text=None if detokenizer is None else detokenizer.text)
        finals.append(final)
        if state.stream:
            deltas.append(self._delta(out.req_id, state, final.token_ids, final.logprobs, final))

    def _delta(self, req_id: str, state: _Followed, token_ids: list[int], logprobs: list[dict] | None,
               final: RequestOutput | None) -> RequestOutput:
        """What is new for a streamed request since its last delta (`final`: it ended)."""
        start, state.num_sent = state.num_sent, state.num_seen
        detokenizer = state.detokenizer
        return RequestOutput(
            req_id=req_id,
            prompt_token_ids=state.prompt_token_ids,
            token_ids=token_ids[start:state.num_seen],
            finish_reason=None if final is None else final.finish_reason,
            logprobs=None if logprobs is None else logprobs[start:state.num_seen],
            prompt_logprobs=None if final is None else final.prompt_logprobs,
            text=None if detokenizer is None else detokenizer.take_delta(final is not None),
        )


def _truncated(out: RequestOutput, num_tokens: int, finish_reason: str) -> RequestOutput:
    """`out` ended after its first `num_tokens` tokens (a stop string), for `finish_reason`."""
    logprobs = None if out.logprobs is None else out.logprobs[:num_tokens]
    return dataclasses.replace(out, token_ids=out.token_ids[:num_tokens], logprobs=logprobs,
                               finish_reason=finish_reason)
