"""Structured outputs in the reference engine: grammar matchers, the step's masks, their advance.

For each request with `SamplingParams.structured_outputs` the engine keeps a grammar matcher.
Before a step samples, `StructuredOutputs.grammar_output(so)` asks each scheduled constrained
request's matcher for its next-token bitmask and packs them in vLLM's `GrammarOutput` (the runner
applies them inside the step, graphrunner/structured_outputs.py); after the step,
`accept(req_id, tokens)` advances the matcher by the tokens the request emitted, and says when
the grammar is complete (the request then ends, finish_reason "stop").

With speculative decoding (vLLM's way) a constrained decode verifies REAL drafts: before the step
runs, `place_drafts` takes the runner's proposals (`take_draft_token_ids`), cuts each constrained
request's before the first token its grammar refuses or completes with (vLLM's `validate_tokens`:
accept one by one, then roll back) and schedules them as ids (`Scheduler.schedule_drafts`); other
requests keep the runner's placeholders. Its `GrammarOutput` then has 1 + d rows for a request with d drafts: row j
is the mask after accepting drafts 0..j-1 (accepted for the masks, then rolled back); the matcher
advances by the emitted tokens only. With async scheduling every step in flight is resolved first
(the drafts and the grammar state both need it).

The matchers come from a `GrammarBackend`. `XGrammarBackend` compiles JSON schemas, regular
expressions, choices and EBNF grammars with xgrammar over the model's tokenizer (the optional
extra `pip install graphrunner[structured]`); any backend whose matchers have the protocol's
methods serves (the tests use tiny ones over token ids).
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Sequence
from itertools import chain
from typing import Any, Literal, Protocol

import numpy as np
import torch

from graphrunner.config import MAX_SPECULATIVE_TOKENS
from graphrunner.engine.bad_words import WordBans, clear_bits
from graphrunner.engine.request import RequestStatus, SequenceOutput
from graphrunner.protocol import ModelRunnerOutput, SchedulerOutput
from graphrunner.state.staging import host_buffer
from graphrunner.structured_outputs import GrammarOutput, StructuredOutputsParams, bitmask_words

logger = logging.getLogger(__name__)

__all__ = ["GrammarBackend", "GrammarMatcher", "StructuredOutputs", "XGrammarBackend", "can_compile_grammars",
           "make_structured_outputs"]


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write the allowed next tokens into `out` ([ceil(V/32)] int32, bit v % 32 of word v // 32),
        every word of it (`out` is not cleared first)."""

    def accept_token(self, token: int) -> bool:
        """Advance by `token`; False if the grammar does not allow it (the matcher is unchanged)."""

    def is_terminated(self) -> bool:
        """The grammar is complete: nothing more may follow."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculation: drafts accepted to build masks)."""


class GrammarBackend(Protocol):
    """Compiles a request's grammar. Optional: `fill_many(matchers, out, rows)` (a step's masks in one
    call) and `stop_token_ids` (a frozenset: its matchers complete only by accepting one of these,
    so the engine may accept other sampled tokens later, `StructuredOutputs.after_output`)."""

    def compile(self, params: StructuredOutputsParams) -> GrammarMatcher: ...


class XGrammarBackend:
    """Matchers from xgrammar over a Hugging Face tokenizer; the model's vocabulary may be larger
    than the tokenizer's (padding ids are never allowed).

    fill_threads: the threads of a step's mask fill (`fill_many`; an int or "auto", xgrammar's
    hardware_concurrency / 2). xgrammar 0.2.8 starts and joins them inside every
    `batch_fill_next_token_bitmask` call (no pool lives between calls): that costs ~65 us per call
    with 2 threads on a 2-core machine, more under a sandboxed kernel, against ~3 us per JSON mask
    of a 152k vocabulary. One thread (the default) fills the masks one after another in C++."""

    def __init__(self, tokenizer: Any, vocab_size: int, fill_threads: int | Literal["auto"] = 1) -> None:
        try:
            import xgrammar as xgr
        except ImportError:
            raise ImportError("structured outputs need xgrammar: pip install 'graphrunner[structured]'") from None
        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info)
        # A matcher (terminate_without_stop_token=False) completes only by accepting one of these.
        self.stop_token_ids = frozenset(info.stop_token_ids)
        self._batch = xgr.BatchGrammarMatcher(fill_threads)
        batch: Any = self._batch._handle
        self._batch_fill = batch.batch_fill_next_token_bitmask  # (handles, out, rows, debug_print)

    def fill_many(self, matchers: Sequence[GrammarMatcher], out: np.ndarray, rows: list[int] | None = None) -> None:
        """out[rows[i]] = matchers[i]'s mask (rows None: out[i]), in one call into xgrammar: at 64
        requests of a 152k vocabulary several times faster than a Python loop over the matchers."""
        self._batch_fill([m._handle for m in matchers], out, rows, False)  # type: ignore[attr-defined]
        words = -(-self.vocab_size // 32)
        if words < out.shape[1]:
            out[list(range(len(matchers))) if rows is None else rows, words:] = 0

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
        return _XGrammarMatcher(self._xgr.GrammarMatcher(grammar, **_rollback_kwargs(self._xgr)), self.vocab_size)


def _rollback_kwargs(xgr: Any) -> dict[str, Any]:
    """Speculation rolls back up to k tokens. xgrammar >= 0.1.2x rolls back without limit by default
    (max_rollback_tokens=-1, deprecated); older versions default to 0 and need a bound >= k."""
    default = inspect.signature(xgr.GrammarMatcher).parameters["max_rollback_tokens"].default
    return {} if default == -1 else {"max_rollback_tokens": MAX_SPECULATIVE_TOKENS}


class _XGrammarMatcher:
    """One xgrammar matcher. Its per-step calls go to xgrammar's FFI object directly (two Python
    frames fewer per call: the engine makes one or two per request and step)."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self._handle = handle = matcher._handle
        self._accept, self._terminated, self._rollback = handle.accept_token, handle.is_terminated, handle.rollback
        self._words = bitmask_words(vocab_size)

    def fill_bitmask(self, out: np.ndarray) -> None:
        self._matcher.fill_next_token_bitmask(out[: self._words], 0)  # a 1-D row: filled in place
        out[self._words :] = 0

    def accept_token(self, token: int) -> bool:
        return bool(self._accept(int(token), False))

    def is_terminated(self) -> bool:
        return bool(self._terminated())

    def rollback(self, num_tokens: int) -> None:
        self._rollback(num_tokens)


def _valid_prefix(matcher: GrammarMatcher, drafts: Sequence[int]) -> list[int]:
    """The drafts before the first one the grammar refuses (vLLM's validate_tokens) or the one that
    completes it (nothing may follow that token, but a step emits one after its accepted drafts);
    `matcher` is left as it was."""
    accepted = 0
    for token in drafts:
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        accepted += 1
    keep = accepted - 1 if accepted and matcher.is_terminated() else accepted
    if accepted:
        matcher.rollback(accepted)
    return list(drafts[:keep])


def _fill_rows(matcher: GrammarMatcher, drafts: Sequence[int], out: np.ndarray) -> None:
    """out: [1 + len(drafts), words]; row j = the mask after drafts 0..j-1, `matcher` left as it was.
    A row past a refused draft allows every token: it is never sampled, as the row before it
    refuses that draft. So does a row past a terminated grammar (vLLM's rule; `_valid_prefix`
    never drafts the grammar's last token)."""
    accepted, live = 0, True
    for j, row in enumerate(out):
        live = live and not matcher.is_terminated()
        if live:
            matcher.fill_bitmask(row)
        else:
            row[:] = -1
        if j < len(drafts) and live:
            if drafts[j] < 0:
                raise ValueError(f"draft {j} is a placeholder (-1): a grammar needs the draft ids (place_drafts)")
            live = matcher.accept_token(drafts[j])
            accepted += live
    if accepted:
        matcher.rollback(accepted)


def _fill_each(matchers: list[GrammarMatcher], drafts: Sequence[Sequence[int]], mask: np.ndarray,
               fill_many: Any) -> None:
    """mask: [sum of 1 + len(drafts[i]), words]; the rows of each matcher in order (`_fill_rows`),
    the live ones without drafts together through `fill_many` when the backend has it."""
    batched: list[tuple[int, GrammarMatcher]] = []  # (mask row, matcher)
    start = 0
    for matcher, tokens in zip(matchers, drafts, strict=True):
        if fill_many is not None and not tokens and not matcher.is_terminated():
            batched.append((start, matcher))
        else:
            _fill_rows(matcher, tokens, mask[start : start + 1 + len(tokens)])
        start += 1 + len(tokens)
    if batched:
        fill_many([m for _, m in batched], mask, [row for row, _ in batched])


_MAX_UNSORTED = 8  # deferred steps kept as they came (`after_output`); more are sorted into `pending`


class StructuredOutputs:
    """The engine's matchers: one per live constrained request."""

    def __init__(self, backend: GrammarBackend | None, vocab_size: int) -> None:
        self.backend = backend
        self.words = bitmask_words(vocab_size)
        self.matchers: dict[str, GrammarMatcher] = {}
        self.drafts: dict[str, list[int]] = {}  # speculation: each constrained request's last proposals
        # The requests whose grammar is complete. Only `accept` advances a matcher for good (drafts
        # are accepted and rolled back), so this is each matcher's is_terminated() without asking it.
        self.terminated: set[str] = set()
        # Sampled tokens not yet accepted (`after_output`), accepted before the request's next mask
        # or drafts; `broken`: a deferred token was refused (never under its masks): it ends next output.
        self._pending: dict[str, list[int]] = {}
        self.broken: set[str] = set()
        # Steps whose tokens are all deferred, as they came ((req_ids, sampled_token_ids) each): their
        # sorting into `pending` is left to the next `grammar_output` too (`_flush`), off the gap between steps.
        self.unsorted: list[tuple[list[str], list[list[int]]]] = []
        self._stops: frozenset[int] | None = getattr(backend, "stop_token_ids", None)
        # Requests with bad words of several tokens (engine/bad_words.py): their mask rows ban what
        # their last tokens make a word's end; with a grammar, on top of its mask.
        self.bans: dict[str, WordBans] = {}
        # The packed allowed_token_ids of constrained requests that have them: a step whose grammar or
        # bad words leave none of them ends the request on one of them (`_keep_allowed`).
        self.allowed: dict[str, np.ndarray] = {}

    @property
    def pending(self) -> dict[str, list[int]]:
        """Request id -> its sampled tokens not yet accepted, in order (the deferred steps sorted in)."""
        if self.unsorted:
            self._sort_unsorted()
        return self._pending

    def check(self, req_id: str, params: StructuredOutputsParams | None) -> None:
        """ValueError naming the request when it asks for a grammar this engine cannot compile."""
        if params is not None and self.backend is None:
            raise ValueError(f"request {req_id!r}: structured_outputs need a tokenizer (a model folder with one) "
                             "and xgrammar (pip install 'graphrunner[structured]')")

    def add(self, req_id: str, params: StructuredOutputsParams | None,
            bad_words_token_ids: Sequence[Sequence[int]] = (),
            allowed_token_ids: Sequence[int] | None = None) -> None:
        """Compile the request's grammar (errors name the request and what failed); keep its bad
        words of several tokens (`SamplingParams.bad_words_token_ids`) and, beside either, its
        `allowed_token_ids`."""
        if bad_words_token_ids:
            self.bans[req_id] = WordBans(bad_words_token_ids)
        if allowed_token_ids is not None and (params is not None or bad_words_token_ids):
            bits = np.zeros(self.words * 32, dtype=bool)
            bits[list(allowed_token_ids)] = True
            self.allowed[req_id] = np.packbits(bits, bitorder="little").view("<u4").view(np.int32)
        if params is None:
            return
        self.check(req_id, params)
        if self.unsorted:  # a finished request's deferred tokens never reach a new one of the same id
            self._sort_unsorted()
        assert self.backend is not None
        try:
            self.matchers[req_id] = self.backend.compile(params)
        except Exception as e:  # an invalid schema / regex / grammar: the caller's input
            raise ValueError(f"request {req_id!r}: structured_outputs {params.kind} does not compile: {e}") from None

    def remove(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)
        self.bans.pop(req_id, None)
        self.drafts.pop(req_id, None)
        self.terminated.discard(req_id)
        self._pending.pop(req_id, None)
        self.broken.discard(req_id)
        self.allowed.pop(req_id, None)

    def grammar_output(self, so: SchedulerOutput, device: Any = None, block: Any = None) -> GrammarOutput | None:
        """The masks of the step's constrained requests (None when it has none), in vLLM's layout:
        1 + len(so.scheduled_spec_decode_tokens[req_id]) rows per request (`place_drafts` first).
        Those with a grammar come first, then those with bad words only; bad words clear bits of
        either. device: the runner's; the masks are filled in a host block it uploads as is (pinned
        on CUDA): `block(num_rows, words)`'s (the runner's persistent staging,
        `ModelRunner.grammar_block`; valid until the block after next) or a fresh one."""
        ids = [rid for rid in so.num_scheduled_tokens if rid in self.matchers]
        ban_only = [rid for rid in so.num_scheduled_tokens if rid in self.bans and rid not in self.matchers]
        if not ids and not ban_only:
            return None
        if ids and (self._pending or self.unsorted):
            self._flush(ids)
        spec = so.scheduled_spec_decode_tokens
        drafts = [spec.get(rid, []) for rid in ids] if spec else []
        num_rows = len(ids) + sum(map(len, drafts))  # the grammar rows
        all_ids = ids + ban_only
        shape = (len(all_ids) + sum(len(spec.get(rid, [])) for rid in all_ids) if spec else len(all_ids), self.words)
        staged = block(*shape) if block is not None else host_buffer(shape, torch.int32, device or "cpu")
        mask = staged.numpy()  # every row is written whole below
        matchers = [self.matchers[rid] for rid in ids]
        fill_many = getattr(self.backend, "fill_many", None)
        if ids and fill_many is not None and num_rows == len(ids) and self.terminated.isdisjoint(ids):
            fill_many(matchers, mask[:num_rows])  # the common step: one live row each, in order
        elif ids:
            _fill_each(matchers, drafts or [[]] * len(ids), mask[:num_rows], fill_many)
        mask[num_rows:] = -1  # bad words only: every token allowed but the bans below
        if self.bans:
            self._apply_bans(all_ids, spec, mask)
        if self.allowed:
            self._keep_allowed(all_ids, spec, mask)
        return GrammarOutput(all_ids, mask, pinned=staged)

    def _keep_allowed(self, ids: list[str], spec: dict[str, list[int]], mask: np.ndarray) -> None:
        """A row whose grammar or bad words leave none of its request's allowed_token_ids would sample
        from nothing (an all -inf row: token 0, outside the set). Such a row takes the allowed set
        instead, so the token is one of them, and the request ends with it (finish_reason "stop"):
        its grammar cannot go on from there. One AND per constrained row with allowed ids."""
        start = 0
        for rid in ids:
            rows = 1 + (len(spec.get(rid, [])) if spec else 0)
            allowed = self.allowed.get(rid)
            if allowed is not None:
                for row in range(start, start + rows):
                    if not np.bitwise_and(mask[row], allowed).any():
                        logger.warning("request %r: its structured output or bad words allow none of its "
                                       "allowed_token_ids at this position; it ends with one of them", rid)
                        mask[row] = allowed
                        self.broken.add(rid)
            start += rows

    def _apply_bans(self, ids: list[str], spec: dict[str, list[int]], mask: np.ndarray) -> None:
        """Clear the banned tokens in the rows of `ids` that have bad words (row j after drafts 0..j-1)."""
        start = 0
        for rid in ids:
            tokens = spec.get(rid, []) if spec else []
            bans = self.bans.get(rid)
            if bans is not None:
                for j in range(1 + len(tokens)):
                    banned = bans.banned(tokens[:j])
                    if banned:
                        clear_bits(mask[start + j], banned)
            start += 1 + len(tokens)

    def accept(self, req_id: str, tokens: list[int]) -> bool:
        """Advance `req_id`'s matcher by its new tokens; True when its grammar is now complete (or
        a token broke it: the request must end either way)."""
        matcher = self.matchers.get(req_id)
        if matcher is None:
            return False
        if self.unsorted:
            self._sort_unsorted()
        deferred = self._pending.pop(req_id, None)
        for token in tokens if deferred is None else [*deferred, *tokens]:
            if not matcher.accept_token(token):
                return True
        if matcher.is_terminated():
            self.terminated.add(req_id)
            return True
        return False

    def _flush(self, ids: Sequence[str]) -> None:
        """Accept the deferred tokens of `ids` (before their masks or drafts). None is a stop token,
        so none completes a grammar: no is_terminated() to ask."""
        pending, matchers, broken = self._pending, self.matchers, self.broken
        if len(self.unsorted) == 1 and not pending:  # one step's tokens: accepted as they come
            (req_ids, sampled), wanted = self.unsorted.pop(), set(ids)
            for rid, step_tokens in zip(req_ids, sampled, strict=True):
                if step_tokens and rid in matchers:
                    if rid not in wanted:
                        pending[rid] = list(step_tokens)
                    elif not all(map(matchers[rid].accept_token, step_tokens)):
                        broken.add(rid)
            return
        if self.unsorted:
            self._sort_unsorted()
        for rid in ids:
            tokens = pending.pop(rid, None)
            if tokens is not None and not all(map(matchers[rid].accept_token, tokens)):
                broken.add(rid)

    def _sort_unsorted(self) -> None:
        """The deferred steps' tokens into `pending`, per request, in step order."""
        steps, self.unsorted = self.unsorted, []
        pending, matchers = self._pending, self.matchers
        for req_ids, sampled in steps:
            for rid, tokens in zip(req_ids, sampled, strict=True):
                if tokens and rid in matchers:
                    pending[rid] = [*pending[rid], *tokens] if rid in pending else list(tokens)

    # ---- the engine's seams ---------------------------------------------------------------
    def wants_drafts(self, scheduler: Any) -> bool:
        """Speculation with a live grammar: steps need the runner's drafts as ids (and, with async
        scheduling, every step in flight resolved before the next is planned)."""
        return bool(self.matchers or self.bans) and scheduler.num_speculative_tokens > 0

    def place_drafts(self, runner: Any, so: SchedulerOutput, scheduler: Any) -> None:
        """Before `execute_model(so)`, speculation: each constrained decode verifies the runner's
        drafts as real ids, cut at the first one its grammar refuses; the other requests keep
        their placeholders (their drafts never leave the device)."""
        if not self.wants_drafts(scheduler):
            return
        taken = runner.take_draft_token_ids()  # the last step's proposals (every step's is taken here)
        if taken is not None:
            self.drafts.update((rid, list(ids)) for rid, ids in zip(taken.req_ids, taken.draft_token_ids, strict=True)
                               if rid in self.matchers or rid in self.bans)
        if self._pending or self.unsorted:
            self._flush([rid for rid in so.num_scheduled_tokens if rid in self.matchers])
        cached = so.scheduled_cached_reqs
        computed = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))  # before the step
        for rid, num_tokens in list(so.num_scheduled_tokens.items()):
            req = scheduler.requests.get(rid)
            if (rid not in self.matchers and rid not in self.bans) or req is None or num_tokens < 2:
                continue
            if 0 < req.num_prefill_tokens <= computed.get(rid, -1):  # a decode (not a prefill chunk)
                drafts = self.drafts.get(rid, [])[: num_tokens - 1]
                if rid in self.matchers:
                    drafts = _valid_prefix(self.matchers[rid], drafts)
                if rid in self.bans:
                    drafts = self.bans[rid].valid_drafts(drafts)
                scheduler.schedule_drafts(so, rid, drafts)

    def constrains(self, so: SchedulerOutput) -> bool:
        """Whether the step schedules a constrained request (its mask needs every earlier token)."""
        matchers, bans = self.matchers, self.bans
        return bool(matchers or bans) and any(rid in matchers or rid in bans for rid in so.num_scheduled_tokens)

    def sample(self, runner: Any, so: SchedulerOutput, async_output: bool = False) -> Any:
        """`runner.sample_tokens` with the step's masks (None when it has no constrained request)."""
        grammar = (self.grammar_output(so, getattr(runner, "device", None), getattr(runner, "grammar_block", None))
                   if self.matchers or self.bans else None)
        if grammar is None:  # the plain call: engines and wrappers that know no grammar see no change
            return runner.sample_tokens(async_output=async_output)
        return runner.sample_tokens(async_output=async_output, grammar_output=grammar)

    def after_output(self, runner_output: ModelRunnerOutput, scheduler: Any) -> list[SequenceOutput]:
        """Advance the matchers by the step's tokens; end (finish_reason "stop") the requests whose
        grammar is complete or broken and still live; forget the matchers of finished requests.

        With a backend's `stop_token_ids`, tokens that cannot complete a grammar are only recorded:
        the matchers accept them in the next `grammar_output` (or `place_drafts`), which runs while
        the step's forward does, instead of here, between two steps, where the device waits. A step
        without any stop token (the usual one) is recorded whole, in one append: even sorting its
        tokens per request waits for `grammar_output`. Bad words take their requests' tokens at once."""
        ended: list[SequenceOutput] = []
        if self.bans:
            self._advance_bans(runner_output, scheduler, ended)
        if not self.matchers:
            return ended
        stops, sampled = self._stops, runner_output.sampled_token_ids
        if stops is not None and not self.broken and stops.isdisjoint(chain.from_iterable(sampled)):
            self.unsorted.append((runner_output.req_ids, sampled))  # no token can complete a grammar: all deferred
            if len(self.unsorted) > _MAX_UNSORTED:  # steps without a constrained request: no masks come to sort
                self._sort_unsorted()
        else:
            self._advance(runner_output.req_ids, sampled, scheduler, ended)
        requests = scheduler.requests
        for rid in [r for r in self.matchers if r not in requests]:
            self.remove(rid)
        return ended

    def _advance_bans(self, runner_output: ModelRunnerOutput, scheduler: Any, ended: list[SequenceOutput]) -> None:
        """The bad-words requests' new tokens; end those `_keep_allowed` forced; forget those that finished."""
        bans = self.bans
        for rid, tokens in zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True):
            if tokens and rid in bans:
                bans[rid].accept(tokens)
                if rid in self.broken and rid not in self.matchers:  # `_keep_allowed` forced this token
                    out = scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
                    if out is not None:
                        ended.append(out)
        for rid in [r for r in bans if r not in scheduler.requests]:
            del bans[rid]

    def _advance(self, req_ids: list[str], sampled: list[list[int]], scheduler: Any,
                 ended: list[SequenceOutput]) -> None:
        """`after_output` request by request: defer what cannot complete a grammar, accept the rest."""
        if self.unsorted:  # earlier steps' tokens first
            self._sort_unsorted()
        stops, matchers, pending = self._stops, self.matchers, self._pending
        for rid, tokens in zip(req_ids, sampled, strict=True):
            if not tokens or rid not in matchers:
                continue
            if stops is not None and stops.isdisjoint(tokens) and rid not in self.broken:
                pending[rid] = [*pending[rid], *tokens] if rid in pending else list(tokens)
            elif rid in self.broken or self.accept(rid, tokens):
                out = scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
                if out is not None:  # (EOS already ended it inside the step's output)
                    ended.append(out)


def can_compile_grammars(tokenizer: Any) -> bool:
    """Whether `make_structured_outputs` will have a backend: a tokenizer and xgrammar installed."""
    import importlib.util

    has_vocab = tokenizer is not None and hasattr(tokenizer, "get_vocab")
    return has_vocab and importlib.util.find_spec("xgrammar") is not None


def make_structured_outputs(tokenizer: Any, vocab_size: int,
                            fill_threads: int | Literal["auto"] = 1) -> StructuredOutputs:
    """The engine's matchers: through xgrammar over `tokenizer` when both exist (`fill_threads`:
    `XGrammarBackend`'s); else none can compile, and a request asking for structured outputs is
    refused with the reason. Under speculative decoding the matchers also roll back
    (`GrammarMatcher.rollback`)."""
    backend = None
    if can_compile_grammars(tokenizer):
        try:
            backend = XGrammarBackend(tokenizer, vocab_size, fill_threads)
        except ImportError:
            backend = None
    return StructuredOutputs(backend, vocab_size)
