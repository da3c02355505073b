"""Structured outputs in the reference engine: grammar matchers, the step's masks, their advance.

For each request with `SamplingParams.structured_outputs` the engine keeps a grammar matcher.
Before a step samples, `StructuredOutputs.grammar_output(so)` asks each scheduled constrained
request's matcher for its next-token bitmask and packs them in vLLM's `GrammarOutput` (the runner
applies them inside the step, graphrunner/structured_outputs.py); after the step,
`accept(req_id, tokens)` advances the matcher by the tokens the request emitted, and says when
the grammar is complete (the request then ends, finish_reason "stop").

The matchers come from a `GrammarBackend`. `XGrammarBackend` compiles JSON schemas, regular
expressions, choices and EBNF grammars with xgrammar over the model's tokenizer (the optional
extra `pip install graphrunner[structured]`); any object with the same two methods serves
(the tests use a tiny one over token ids).
"""

from __future__ import annotations

import re
from typing import Any, Protocol

import numpy as np

from graphrunner.engine.request import RequestOutput, RequestStatus
from graphrunner.protocol import ModelRunnerOutput, SchedulerOutput
from graphrunner.structured_outputs import GrammarOutput, StructuredOutputsParams, bitmask_words

__all__ = ["GrammarBackend", "GrammarMatcher", "StructuredOutputs", "XGrammarBackend", "make_structured_outputs"]


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write the allowed next tokens into `out` ([ceil(V/32)] int32, bit v % 32 of word v // 32)."""

    def accept_token(self, token: int) -> bool:
        """Advance by `token`; False if the grammar does not allow it (the matcher is unchanged)."""

    def is_terminated(self) -> bool:
        """The grammar is complete: nothing more may follow."""


class GrammarBackend(Protocol):
    def compile(self, params: StructuredOutputsParams) -> GrammarMatcher: ...


class XGrammarBackend:
    """Matchers from xgrammar over a Hugging Face tokenizer; the model's vocabulary may be larger
    than the tokenizer's (padding ids are never allowed)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        try:
            import xgrammar as xgr
        except ImportError:
            raise ImportError("structured outputs need xgrammar: pip install 'graphrunner[structured]'") from None
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))

    def compile(self, params: StructuredOutputsParams) -> GrammarMatcher:
        c = self.compiler
        kind = params.kind
        if kind == "json":
            grammar = c.compile_json_schema(str(params.json))  # normalized to text by the params
        elif kind == "regex":
            grammar = c.compile_regex(str(params.regex))
        elif kind == "choice":
            assert params.choice is not None
            grammar = c.compile_regex("|".join(f"({re.escape(choice)})" for choice in params.choice))
        else:
            grammar = c.compile_grammar(str(params.grammar))
        return _XGrammarMatcher(self._xgr, self._xgr.GrammarMatcher(grammar), self.vocab_size)


class _XGrammarMatcher:
    def __init__(self, xgr: Any, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self._mask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V/32)] int32 torch tensor

    def fill_bitmask(self, out: np.ndarray) -> None:
        self._matcher.fill_next_token_bitmask(self._mask, 0)
        words = self._mask.shape[1]
        out[:words] = self._mask[0].numpy()
        out[words:] = 0

    def accept_token(self, token: int) -> bool:
        return bool(self._matcher.accept_token(int(token)))

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class StructuredOutputs:
    """The engine's matchers: one per live constrained request."""

    def __init__(self, backend: GrammarBackend | None, vocab_size: int) -> None:
        self.backend = backend
        self.words = bitmask_words(vocab_size)
        self.matchers: dict[str, GrammarMatcher] = {}

    def check(self, req_id: str, params: StructuredOutputsParams | None) -> None:
        """ValueError naming the request when it asks for a grammar this engine cannot compile."""
        if params is not None and self.backend is None:
            raise ValueError(f"request {req_id!r}: structured_outputs need a tokenizer (a model folder with one) "
                             "and xgrammar (pip install 'graphrunner[structured]')")

    def add(self, req_id: str, params: StructuredOutputsParams | None) -> None:
        """Compile the request's grammar (errors name the request and what failed)."""
        if params is None:
            return
        self.check(req_id, params)
        assert self.backend is not None
        try:
            self.matchers[req_id] = self.backend.compile(params)
        except Exception as e:  # an invalid schema / regex / grammar: the caller's input
            raise ValueError(f"request {req_id!r}: structured_outputs {params.kind} does not compile: {e}") from None

    def remove(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)

    def grammar_output(self, so: SchedulerOutput) -> GrammarOutput | None:
        """The masks of the step's constrained requests (None when it has none)."""
        ids = [rid for rid in so.num_scheduled_tokens if rid in self.matchers]
        if not ids:
            return None
        mask = np.zeros((len(ids), self.words), dtype=np.int32)
        for i, rid in enumerate(ids):
            self.matchers[rid].fill_bitmask(mask[i])
        return GrammarOutput(ids, mask)

    def accept(self, req_id: str, tokens: list[int]) -> bool:
        """Advance `req_id`'s matcher by its new tokens; True when its grammar is now complete (or
        a token broke it: the request must end either way)."""
        matcher = self.matchers.get(req_id)
        if matcher is None:
            return False
        for token in tokens:
            if not matcher.accept_token(token):
                return True
        return matcher.is_terminated()

    # ---- the engine's seams ---------------------------------------------------------------
    def constrains(self, so: SchedulerOutput) -> bool:
        """Whether the step schedules a constrained request (its mask needs every earlier token)."""
        return bool(self.matchers) and any(rid in self.matchers for rid in so.num_scheduled_tokens)

    def sample(self, runner: Any, so: SchedulerOutput, async_output: bool = False) -> Any:
        """`runner.sample_tokens` with the step's masks (None when it has no constrained request)."""
        grammar = self.grammar_output(so) if self.matchers else None
        if grammar is None:  # the plain call: engines and wrappers that know no grammar see no change
            return runner.sample_tokens(async_output=async_output)
        return runner.sample_tokens(async_output=async_output, grammar_output=grammar)

    def after_output(self, runner_output: ModelRunnerOutput, scheduler: Any) -> list[RequestOutput]:
        """Advance the matchers by the step's tokens; end (finish_reason "stop") the requests whose
        grammar is complete or broken and still live; forget the matchers of finished requests."""
        if not self.matchers:
            return []
        ended = []
        for rid, tokens in zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True):
            if tokens and rid in self.matchers and self.accept(rid, tokens):
                out = scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
                if out is not None:  # (EOS already ended it inside the step's output)
                    ended.append(out)
        for rid in [r for r in self.matchers if r not in scheduler.requests]:
            self.remove(rid)
        return ended


def make_structured_outputs(tokenizer: Any, vocab_size: int) -> StructuredOutputs:
    """The engine's matchers: through xgrammar over `tokenizer` when both exist; else none can
    compile, and a request asking for structured outputs is refused with the reason."""
    backend = None
    if tokenizer is not None and hasattr(tokenizer, "get_vocab"):
        try:
            backend = XGrammarBackend(tokenizer, vocab_size)
        except ImportError:
            backend = None
    return StructuredOutputs(backend, vocab_size)
