"""The engine's deferred matcher advance (graphrunner.engine.structured): a step without stop tokens is
recorded whole by `after_output` and sorted per request by the next `grammar_output` / `place_drafts`.

Against the request-by-request deferral (the code before, as a reference subclass), over random
schedules of a token-id grammar that completes only through a stop token: partial schedules (requests
skipped for several steps, so tokens pile up), outputs applied late and several in a row (async
scheduling), empty entries (prefill chunks), refused tokens (a broken request ends at its next output),
stop tokens, aborted requests and ids re-used after they ended. Every step's masks, ended requests and
matcher states agree.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.engine.structured import StructuredOutputs
from graphrunner.protocol import ModelRunnerOutput, SchedulerOutput
from graphrunner.structured_outputs import StructuredOutputsParams

VOCAB = 40
STOP = 0  # the backend's one stop token


class _StopChoice:
    """Matcher: one of `choices` (token tuples), then STOP, which alone completes it."""

    def __init__(self, choices: list[tuple[int, ...]]) -> None:
        self.choices, self.prefix, self.done = choices, (), False

    def _allowed(self) -> set[int]:
        if self.done:
            return set()
        n = len(self.prefix)
        allowed = {c[n] for c in self.choices if len(c) > n and c[:n] == self.prefix}
        return allowed | ({STOP} if self.prefix in self.choices else set())

    def fill_bitmask(self, out: np.ndarray) -> None:
        bits = np.zeros(len(out) * 32, dtype=bool)
        bits[list(self._allowed())] = True
        out[:] = np.packbits(bits, bitorder="little").view("<u4").view(np.int32)

    def accept_token(self, token: int) -> bool:
        if token not in self._allowed():
            return False
        if token == STOP:
            self.done = True
        else:
            self.prefix += (token,)
        return True

    def is_terminated(self) -> bool:
        return self.done

    def rollback(self, num_tokens: int) -> None:
        raise AssertionError("no speculation here")


class _Backend:
    stop_token_ids = frozenset({STOP})

    def compile(self, params: StructuredOutputsParams) -> _StopChoice:
        assert params.choice is not None
        return _StopChoice([tuple(int(t) for t in c.split()) for c in params.choice])


class _Scheduler:
    """The scheduler's side of `after_output`: live requests, finish_request."""

    def __init__(self) -> None:
        self.requests: dict[str, object] = {}
        self.finished: list[str] = []

    def finish_request(self, rid: str, status) -> str | None:
        if self.requests.pop(rid, None) is None:
            return None
        self.finished.append(rid)
        return rid


def _choices(rng: np.random.Generator) -> StructuredOutputsParams:
    words = [" ".join(map(str, rng.integers(1, VOCAB, size=int(rng.integers(1, 6))))) for _ in range(3)]
    return StructuredOutputsParams(choice=list(dict.fromkeys(words)))


class _RequestByRequest(StructuredOutputs):
    """The reference: the deferral as it was before steps were recorded whole (every output sorted
    into `pending` request by request, accepted for the requests of the next masks)."""

    def after_output(self, runner_output, scheduler):
        if not self.matchers:
            return []
        ended, stops, matchers, pending = [], self._stops, self.matchers, self._pending
        for rid, tokens in zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True):
            if not tokens or rid not in matchers:
                continue
            if stops is not None and stops.isdisjoint(tokens) and rid not in self.broken:
                pending[rid] = [*pending[rid], *tokens] if rid in pending else list(tokens)
            elif rid in self.broken or self.accept(rid, tokens):
                out = scheduler.finish_request(rid, None)
                if out is not None:
                    ended.append(out)
        for rid in [r for r in self.matchers if r not in scheduler.requests]:
            self.remove(rid)
        return ended

    def _flush(self, ids):
        pending, matchers = self._pending, self.matchers
        for rid in ids:
            tokens = pending.pop(rid, None)
            if tokens is not None:
                accept = matchers[rid].accept_token
                if not all(accept(token) for token in tokens):
                    self.broken.add(rid)


def _sample(rng: np.random.Generator, ids: list[str], rows: dict[str, np.ndarray]) -> list[list[int]]:
    """A token per scheduled request: mostly one its mask allows, sometimes none (a prefill chunk) or
    any (refused: never under a mask, the request breaks)."""
    sampled = []
    for rid in ids:
        allowed = (np.flatnonzero(np.unpackbits(rows[rid].view(np.uint8), bitorder="little")[:VOCAB])
                   if rid in rows else np.arange(1, VOCAB))
        roll = rng.random()
        if roll < 0.1:
            sampled.append([])
        elif roll < 0.15 or not len(allowed):
            sampled.append([int(rng.integers(1, VOCAB))])
        else:
            sampled.append([int(rng.choice(allowed))])
    return sampled


def _admit(rng: np.random.Generator, engine: StructuredOutputs, scheduler: _Scheduler, next_id: int) -> int:
    """0-2 admissions (new ids, or ids that finished or were aborted), maybe an abort."""
    for _ in range(int(rng.integers(0, 3))):
        reuse = bool(scheduler.finished) and rng.random() < 0.3
        rid = scheduler.finished.pop(0) if reuse else f"r{next_id}"
        next_id += not reuse
        if rid not in scheduler.requests:
            engine.add(rid, _choices(rng) if rng.random() < 0.8 else None)
            scheduler.requests[rid] = SimpleNamespace()
    live = list(scheduler.requests)
    if live and rng.random() < 0.1:
        aborted = live[int(rng.integers(len(live)))]
        scheduler.requests.pop(aborted)
        scheduler.finished.append(aborted)
    return next_id


def _run(engine: StructuredOutputs, seed: int, steps: int) -> list:
    """One random schedule with up to two outputs in flight (async scheduling: a step's output is
    applied after later steps launched, several outputs in a row); every observable per step."""
    rng = np.random.default_rng(seed)
    scheduler, seen, next_id, in_flight = _Scheduler(), [], 0, []

    def resolve(keep: int) -> None:
        while len(in_flight) > keep:
            seen.append(("ended", engine.after_output(in_flight.pop(0), scheduler)))

    for _ in range(steps):
        next_id = _admit(rng, engine, scheduler, next_id)
        if rng.random() < 0.5:
            resolve(0)
        busy = {rid for out in in_flight for rid in out.req_ids}
        # (a request in flight is scheduled again now and then: not the engine's way under a grammar, whose
        # masks need every earlier token, but both deferrals must still agree)
        ids = [rid for rid in scheduler.requests if (rid not in busy or rng.random() < 0.2) and rng.random() < 0.7]
        so = SchedulerOutput()
        so.num_scheduled_tokens = dict.fromkeys(ids, 1)
        grammar = engine.grammar_output(so)
        rows = {} if grammar is None else dict(zip(grammar.structured_output_request_ids, grammar.grammar_bitmask,
                                                   strict=True))
        seen.append({rid: row.tolist() for rid, row in rows.items()})
        in_flight.append(ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                           sampled_token_ids=_sample(rng, ids, rows)))
        resolve(int(rng.integers(0, 3)))
        # (`pending` itself would sort the recorded steps: compared once, at the end)
        prefixes = {rid: m.prefix for rid, m in engine.matchers.items()}
        seen.append((sorted(engine.broken), sorted(engine.terminated), prefixes))
    resolve(0)
    return [*seen, engine.pending]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), steps=st.integers(1, 40))
def test_deferred_steps_equal_the_request_by_request_deferral(seed, steps) -> None:
    reference = _run(_RequestByRequest(_Backend(), VOCAB), seed, steps)
    assert _run(StructuredOutputs(_Backend(), VOCAB), seed, steps) == reference


def test_a_step_without_stop_tokens_is_recorded_whole_and_sorted_by_the_next_masks() -> None:
    engine, scheduler = StructuredOutputs(_Backend(), VOCAB), _Scheduler()
    for rid in ("a", "b"):
        engine.add(rid, StructuredOutputsParams(choice=["1 2", "3"]))
        scheduler.requests[rid] = SimpleNamespace()
    out = ModelRunnerOutput(req_ids=["a", "b", "free"], req_id_to_index={"a": 0, "b": 1, "free": 2},
                            sampled_token_ids=[[1], [3], [STOP]])  # an unconstrained request's EOS: sorted now
    assert engine.after_output(out, scheduler) == [] and engine.unsorted == [] and engine._pending == {"a": [1],
                                                                                                          "b": [3]}
    out = ModelRunnerOutput(req_ids=["b", "a"], req_id_to_index={"b": 0, "a": 1}, sampled_token_ids=[[], [2]])
    assert engine.after_output(out, scheduler) == [] and len(engine.unsorted) == 1
    so = SchedulerOutput()
    so.num_scheduled_tokens = {"a": 1}
    grammar = engine.grammar_output(so)  # a's tokens 1, 2 accepted; b's 3 stays pending
    assert grammar is not None and engine.unsorted == [] and engine._pending == {"b": [3]}
    assert engine.matchers["a"].prefix == (1, 2) and engine.matchers["b"].prefix == ()
