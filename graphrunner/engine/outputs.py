"""The engine's output side: the scheduler's sequences turned into vLLM-shaped `RequestOutput`s.

A prompt (a *parent*, `RequestOutput.request_id`) runs as one scheduler request, or as `n` (or
`best_of`) of them for parallel sampling (its *children*, one per `CompletionOutput.index`).
`LLM` runs a step, then `OutputProcessor.process(finished)` turns the scheduler's token updates
into outputs:

- finished: one cumulative `RequestOutput` per parent whose children have all ended (their
  tokens, and their text when the model has a tokenizer; with best_of > n the n children of
  highest cumulative logprob);
- deltas: for streamed parents, one `RequestOutput` per parent with news, whose `outputs` hold
  only what is new since each child's last delta (`token_ids`, `text`, `logprobs`); the last
  one is `finished`.

Stop strings are found here, as in vLLM's output processor: a request whose text now holds
one is finished in the scheduler ("stop"); the runner frees its row with the next step.
Requests that neither stream nor have stop strings are not followed step by step: their
text is decoded once, when they finish. Logprobs get their `decoded_token` here.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from graphrunner.engine.detokenizer import IncrementalDetokenizer
from graphrunner.engine.request import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    RequestStatus,
    SequenceOutput,
)
from graphrunner.engine.scheduler import Scheduler
from graphrunner.protocol import Logprob, SamplingParams


@dataclass
class _Parent:
    """A prompt and its children (scheduler requests), until every child has ended."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # as the caller gave them (n, best_of, logprobs asked or not)
    child_ids: list[str]
    stream: bool
    arrival_time: float = field(default_factory=time.monotonic)
    done: dict[int, CompletionOutput] = field(default_factory=dict)
    prompt_logprobs: list[dict | None] | None = None
    num_cached_tokens: int = 0
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.child_ids)


@dataclass
class _Child:
    """One scheduler request of a parent; `followed` when it streams or has stop strings."""

    parent: _Parent
    index: int
    params: SamplingParams  # the child's (n = 1, derived seed, logprobs for best_of)
    detokenizer: IncrementalDetokenizer | None
    followed: bool
    num_seen: int = 0  # output tokens given to the detokenizer (all of them without one)
    num_sent: int = 0  # output tokens handed out in deltas


class OutputProcessor:
    """Builds each step's outputs from the scheduler's requests (module docstring)."""

    def __init__(self, scheduler: Scheduler, tokenizer: Any | None) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, _Child] = {}
        self._followed: dict[str, _Child] = {}  # the children that stream or have stop strings
        self._completed: list[_Parent] = []  # parents whose last child ended in this `process`
        self._pending: list[SequenceOutput] = []  # ended between steps (aborted): reported with the next
        self._token_text: dict[int, str] = {}  # decoded_token of each token id seen in logprobs

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    children: list[tuple[str, SamplingParams]], stream: bool) -> None:
        """Follow a queued prompt and its children (scheduler ids with their params)."""
        parent = _Parent(request_id, prompt, list(prompt_token_ids), params, [c for c, _ in children], stream)
        self._parents[request_id] = parent
        for index, (child_id, child_params) in enumerate(children):
            detokenizer = None
            if self.tokenizer is not None and child_params.detokenize and (stream or child_params.stop):
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer, child_params.stop, child_params.min_tokens,
                    include_stop_str_in_output=child_params.include_stop_str_in_output,
                    skip_special_tokens=child_params.skip_special_tokens)
            child = _Child(parent, index, child_params, detokenizer, followed=stream or detokenizer is not None)
            self._children[child_id] = child
            if child.followed:
                self._followed[child_id] = child

    def child_ids(self, request_id: str) -> list[str]:
        """The scheduler ids of a live prompt's children (none for an unknown or finished id)."""
        parent = self._parents.get(request_id)
        return [] if parent is None else list(parent.child_ids)

    def add_finished(self, output: SequenceOutput) -> None:
        """A request that ended outside a step (aborted): its outputs come with the next `process`."""
        self._pending.append(output)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def clear(self) -> None:
        """Forget every request (the engine aborted them all after a failed step)."""
        self._parents.clear()
        self._children.clear()
        self._followed.clear()
        self._pending.clear()

    def forget(self, request_ids: set[str]) -> None:
        """Stop following these prompts and drop their unreported outputs (their stream was left)."""
        child_ids = {c for r in request_ids if r in self._parents for c in self._parents.pop(r).child_ids}
        self._pending = [out for out in self._pending if out.req_id not in child_ids]
        for child_id in child_ids:
            self._children.pop(child_id, None)
            self._followed.pop(child_id, None)

    def process(self, finished: list[SequenceOutput]) -> tuple[list[RequestOutput], list[RequestOutput]]:
        """(the finished prompts' outputs, the stream deltas) of one step that finished `finished`."""
        finals: list[RequestOutput] = []
        news: dict[str, list[CompletionOutput]] = {}  # stream deltas per parent, in child order of news
        ended, self._pending = self._pending + finished, []
        for out in ended:
            child = self._children.pop(out.req_id, None)
            self._followed.pop(out.req_id, None)
            if child is None:  # queued on the scheduler directly: an output of its own
                parent = _Parent(out.req_id, None, out.prompt_token_ids, out.request_params, [out.req_id], False)
                self._parents[out.req_id] = parent
                child = _Child(parent, 0, out.request_params, None, followed=False)
            self._end(out, child, news)
        for req_id, child in list(self._followed.items()):
            req = self.scheduler.requests.get(req_id)
            if req is None:  # aborted through the scheduler directly: nothing more to report
                del self._followed[req_id], self._children[req_id]
                continue
            new = req.output_token_ids[child.num_seen:]
            if not new:
                continue
            kept = child.detokenizer.add_tokens(new) if child.detokenizer is not None else None
            if kept is None:
                child.num_seen += len(new)
                if child.parent.stream:
                    news.setdefault(child.parent.request_id, []).append(
                        self._delta(child, req.output_token_ids, req.logprobs, None))
                continue
            # A stop string: the request ends at the token that completed it.
            stopped = self.scheduler.finish_request(req_id, RequestStatus.FINISHED_STOPPED)
            assert stopped is not None  # it is live
            child.num_seen += kept
            del self._followed[req_id], self._children[req_id]
            self._end(_truncated(stopped, child.num_seen, "stop"), child, news)
        deltas = []
        for request_id, outputs in news.items():
            parent = self._parents[request_id]
            deltas.append(self._request_output(parent, sorted(outputs, key=lambda c: c.index), parent.finished))
        completed, self._completed = self._completed, []
        for parent in completed:
            if self._parents.pop(parent.request_id, None) is not None:
                finals.append(self._request_output(parent, self._final_outputs(parent), True))
        return finals, deltas

    def _end(self, out: SequenceOutput, child: _Child, news: dict[str, list[CompletionOutput]]) -> None:
        """Record a child that ended (and its last delta when it streams)."""
        parent = child.parent
        detokenizer = child.detokenizer
        if not child.followed:
            params = child.params
            text = "" if self.tokenizer is None or not params.detokenize else \
                self.tokenizer.decode(out.token_ids, skip_special_tokens=params.skip_special_tokens)
        else:
            if detokenizer is not None and not detokenizer.stopped:
                kept = detokenizer.add_tokens(out.token_ids[child.num_seen:])
                if kept is None:
                    detokenizer.flush()
                else:
                    out = _truncated(out, child.num_seen + kept, "stop")
            child.num_seen = len(out.token_ids)
            text = "" if detokenizer is None else detokenizer.text
        if child.index == 0:
            parent.prompt_logprobs = self._decoded_prompt(out.prompt_logprobs)
            parent.num_cached_tokens = out.num_cached_tokens
        if out.first_token_time is not None:
            parent.first_token_time = min(parent.first_token_time or out.first_token_time, out.first_token_time)
        parent.done[child.index] = CompletionOutput(
            index=child.index, text=text, token_ids=list(out.token_ids),
            cumulative_logprob=_cumulative(out.token_ids, out.logprobs),
            logprobs=self._decoded(out.logprobs) if parent.params.logprobs is not None else None,
            finish_reason=out.finish_reason, stop_reason=self._stop_reason(out, child))
        if parent.finished:
            self._completed.append(parent)
        if parent.stream:
            news.setdefault(parent.request_id, []).append(self._delta(child, out.token_ids, out.logprobs, out))

    def _stop_reason(self, out: SequenceOutput, child: _Child) -> int | str | None:
        """The stop string or stop token id that ended the child (vLLM's stop_reason), else None."""
        if out.finish_reason != "stop":
            return None
        if child.detokenizer is not None and child.detokenizer.stop_reason is not None:
            return child.detokenizer.stop_reason
        if out.token_ids and out.token_ids[-1] in child.params.stop_token_ids:
            return out.token_ids[-1]
        return None

    def _delta(self, child: _Child, token_ids: list[int], logprobs: list[dict] | None,
               final: SequenceOutput | None) -> CompletionOutput:
        """What is new for a streamed child since its last delta (`final`: it ended)."""
        start, child.num_sent = child.num_sent, child.num_seen
        detokenizer = child.detokenizer
        wanted = logprobs is not None and child.parent.params.logprobs is not None
        return CompletionOutput(
            index=child.index,
            text="" if detokenizer is None else detokenizer.take_delta(final is not None),
            token_ids=list(token_ids[start:child.num_seen]),
            cumulative_logprob=_cumulative(token_ids[:child.num_seen], logprobs),
            logprobs=self._decoded(logprobs[start:child.num_seen]) if wanted and logprobs is not None else None,
            finish_reason=None if final is None else final.finish_reason,
            stop_reason=None if final is None else self._stop_reason(final, child),
        )

    def _final_outputs(self, parent: _Parent) -> list[CompletionOutput]:
        """A finished parent's completions: by index, or the n best by cumulative logprob (best_of > n)."""
        outputs = [parent.done[i] for i in sorted(parent.done)]
        if len(outputs) > parent.params.n:
            outputs = sorted(outputs, key=lambda c: -float("inf") if c.cumulative_logprob is None
                             else c.cumulative_logprob, reverse=True)[:parent.params.n]
            if parent.params.logprobs is None:  # computed only to rank them
                outputs = [dataclasses.replace(c, cumulative_logprob=None) for c in outputs]
        return outputs

    def _request_output(self, parent: _Parent, outputs: list[CompletionOutput], finished: bool) -> RequestOutput:
        metrics = RequestMetrics(parent.arrival_time, parent.first_token_time,
                                 time.monotonic() if finished else None)
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt, prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=parent.prompt_logprobs if finished else None, outputs=outputs, finished=finished,
            metrics=metrics, num_cached_tokens=parent.num_cached_tokens)

    def _token(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _decoded(self, logprobs: list[dict] | None) -> list[dict] | None:
        """Logprobs with `decoded_token` filled (when the model has a tokenizer)."""
        if logprobs is None or self.tokenizer is None:
            return logprobs
        return [{t: Logprob(lp.logprob, lp.rank, self._token(t)) for t, lp in entry.items()} for entry in logprobs]

    def _decoded_prompt(self, logprobs: list[dict | None] | None) -> list[dict | None] | None:
        if logprobs is None or self.tokenizer is None:
            return logprobs
        return [None if entry is None else self._decoded([entry])[0] for entry in logprobs]  # type: ignore[index]


def _cumulative(token_ids: list[int], logprobs: list[dict] | None) -> float | None:
    """The sum of the sampled tokens' logprobs, or None when none were computed."""
    if logprobs is None:
        return None
    return float(sum(entry[t].logprob for t, entry in zip(token_ids, logprobs, strict=False) if t in entry))


def _truncated(out: SequenceOutput, num_tokens: int, finish_reason: str) -> SequenceOutput:
    """`out` ended after its first `num_tokens` tokens (a stop string), for `finish_reason`."""
    logprobs = None if out.logprobs is None else out.logprobs[:num_tokens]
    return dataclasses.replace(out, token_ids=out.token_ids[:num_tokens], logprobs=logprobs,
                               finish_reason=finish_reason)
