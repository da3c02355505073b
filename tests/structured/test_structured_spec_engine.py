"""Structured outputs with speculative decoding in the reference engine (graphrunner.engine.structured).

A pure-Python grammar over token ids stands in for xgrammar (CI has none): after token a only the
tokens `allowed(a)`, and in the "end" grammar one of them, END, completes it. Injected into `LLM`'s
`StructuredOutputs`, it checks the engine's side of vLLM's scheme: a constrained decode verifies the
runner's drafts as real ids, cut before the first one the grammar refuses (or completes with); its
masks follow the drafts slot by slot; the matcher advances by the emitted tokens only. Every output
is replayed against `allowed` (not through the matcher) and equals the run without speculation,
greedy and seeded random alike (n-gram drafts are one-hot: verification is coupled to the plain
sampler), with n-gram drafts (k = 2..4) and a draft model, sync and async scheduling, eager and
CPU-emulated FULL graphs (real CUDA graphs under the gpu marker). With xgrammar (importorskip): a
JSON schema under n-gram speculation gives valid JSON.
"""

from __future__ import annotations

import numpy as np
import pytest

from graphrunner.engine import LLM
from graphrunner.engine.structured import StructuredOutputs
from graphrunner.protocol import SamplingParams
from graphrunner.structured_outputs import StructuredOutputsParams

BASE, ALPHA, END = 100, 12, 99  # the grammar's tokens: BASE .. BASE + ALPHA - 1, and END
LOOP, ENDS = StructuredOutputsParams(regex="loop"), StructuredOutputsParams(regex="end")
SMALL = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4,
             num_kv_blocks=24, seed=0)
GRAPHS = dict(enforce_eager=False, compile_backend="eager", cudagraph_capture_sizes=[1, 2, 4, 8, 16, 24, 32])


def ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def allowed(prev: int | None, ends: bool) -> list[int]:
    """The tokens the grammar allows after `prev` (None: the first token)."""
    if prev is None:
        return [BASE, BASE + 1]
    if prev == END:
        return []
    a = prev - BASE
    successors = {BASE + (5 * a + 1) % ALPHA, BASE + (7 * a + 3) % ALPHA, BASE + (a + 1) % ALPHA}
    return sorted(successors) + ([END] if ends and a % 4 == 3 else [])


def follows_grammar(tokens: list[int], ends: bool) -> bool:
    prev = None
    for token in tokens:
        if token not in allowed(prev, ends):
            return False
        prev = token
    return True


class TokenMatcher:
    """The grammar's matcher: the tokens accepted so far."""

    def __init__(self, ends: bool, rollbacks: list[int]) -> None:
        self.ends, self.history, self.rollbacks = ends, [], rollbacks

    def fill_bitmask(self, out: np.ndarray) -> None:
        assert not self.is_terminated()
        bits = np.zeros(len(out) * 32, dtype=bool)
        bits[allowed(self.history[-1] if self.history else None, self.ends)] = True
        out[:] = np.packbits(bits, bitorder="little").view("<u4").view(np.int32)

    def accept_token(self, token: int) -> bool:
        if self.is_terminated() or token not in allowed(self.history[-1] if self.history else None, self.ends):
            return False
        self.history.append(token)
        return True

    def is_terminated(self) -> bool:
        return bool(self.history) and self.history[-1] == END

    def rollback(self, num_tokens: int) -> None:
        assert 0 < num_tokens <= len(self.history)
        self.rollbacks.append(num_tokens)
        del self.history[-num_tokens:]


class TokenGrammarBackend:
    def __init__(self) -> None:
        self.rollbacks: list[int] = []

    def compile(self, params: StructuredOutputsParams) -> TokenMatcher:
        return TokenMatcher(params.regex == "end", self.rollbacks)


class Recorder:
    """Wraps an LLM's scheduler and runner: per step the planned tokens, the runner's proposals, the
    drafts the engine placed and the constrained requests' outputs so far."""

    def __init__(self, llm: LLM) -> None:
        self.llm, self.steps, self.proposals = llm, [], {}
        schedule, take, execute = llm.scheduler.schedule, llm.runner.take_draft_token_ids, llm.runner.execute_model

        def scheduled():
            so = schedule()
            self.planned = dict(so.num_scheduled_tokens)
            return so

        def taken():
            drafts = take()
            if drafts is not None:
                self.proposals.update(zip(drafts.req_ids, drafts.draft_token_ids, strict=True))
            return drafts

        def executed(so):
            if so.total_num_scheduled_tokens:
                reqs = llm.scheduler.requests
                self.steps.append((self.planned, dict(so.scheduled_spec_decode_tokens), dict(self.proposals),
                                   {rid: list(reqs[rid].output_token_ids) for rid in so.scheduled_spec_decode_tokens}))
            return execute(so)

        llm.scheduler.schedule, llm.runner.take_draft_token_ids, llm.runner.execute_model = scheduled, taken, executed


def build(spec: dict | None, device: str = "cpu", graphs: dict | None = None, **kw) -> tuple[LLM, TokenGrammarBackend]:
    llm = LLM("builtin:tiny-llama", device=device, speculative_config=spec, **SMALL, **(graphs or {}), **kw)
    backend = TokenGrammarBackend()
    llm._structured = StructuredOutputs(backend, llm.runner.vocab_size)  # no tokenizer: the fake grammar
    return llm, backend


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy and seeded-random requests under both grammars (prompts whose n-grams the grammar
    allows, and prompts whose drafts it refuses), an unconstrained one beside them."""
    g = [BASE, BASE + 6, BASE + 7, BASE + 6, BASE + 7]
    prompts = [g * 2, [BASE + 3] * 6, [7, 8, 9, 7, 8], g + [5, 6], [1, 2, 3, 1, 2, 3], [BASE + 1, BASE + 6] * 4]
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=LOOP),
        SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=ENDS),
        SamplingParams(max_tokens=20, temperature=0.8, seed=3, structured_outputs=LOOP),
        SamplingParams(max_tokens=20, temperature=1.0, seed=4, structured_outputs=ENDS),
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, top_k=3, structured_outputs=LOOP),
    ]
    return prompts, params


def generate(llm: LLM) -> tuple[list[tuple[list[int], str | None]], int]:
    steps = [0]
    execute = llm.runner.execute_model

    def counting(so):
        steps[0] += bool(so.total_num_scheduled_tokens)
        return execute(so)

    llm.runner.execute_model = counting
    prompts, params = workload()
    outs = llm.generate(prompts, params)
    return [(o.token_ids, o.finish_reason) for o in outs], steps[0]


def watch_full(llm: LLM) -> list[bool]:
    """Per constrained step (its launch waits for the masks): whether it replayed a FULL graph."""
    full: list[bool] = []

    def sampling(*args, run=llm.runner.sample_tokens, runner=llm.runner, **kwargs):
        out = run(*args, **kwargs)
        if kwargs.get("grammar_output") is not None:
            full.append(runner.last_descriptor is not None and runner.last_descriptor.is_full)
        return out

    llm.runner.sample_tokens = sampling
    return full


@pytest.fixture(scope="module")
def plain() -> tuple[list[tuple[list[int], str | None]], int]:
    return generate(build(None)[0])


def check_run(llm: LLM, backend: TokenGrammarBackend, recorder: Recorder, plain, k: int, drafts_accepted: bool):
    got, steps = generate(llm)
    expected, plain_steps = plain
    assert got == expected  # speculation is exact: per-slot masks give the plain run's tokens
    prompts, params = workload()
    for (tokens, reason), p in zip(got, params, strict=True):
        if p.structured_outputs is not None:
            assert follows_grammar(tokens, p.structured_outputs.regex == "end"), tokens
            assert reason == ("stop" if tokens[-1] == END else "length")
    assert any(t[-1] == END for t, _ in got)  # a grammar completed (inside a speculative run or at its end)
    if drafts_accepted:
        assert steps < plain_steps
    assert backend.rollbacks and max(backend.rollbacks) <= k
    assert llm.scheduler.num_preemptions > 0
    check_drafts(recorder, params, k)


def check_drafts(recorder: Recorder, params: list[SamplingParams], k: int) -> None:
    """Placed drafts: only constrained decodes get them, real ids, the runner's proposals cut just
    before the first token the grammar refuses or completes with (or at the planned slots)."""
    placed = cut = 0
    for planned, drafts, proposals, outputs in recorder.steps:
        for rid, ids in drafts.items():
            ends = params[int(rid)].structured_outputs == ENDS
            assert params[int(rid)].structured_outputs is not None
            proposal = list(proposals.get(rid, []))
            assert ids == proposal[: len(ids)] and len(ids) <= min(k, planned[rid] - 1)
            assert follows_grammar(outputs[rid] + ids, ends) and END not in ids
            room = min(len(proposal), planned[rid] - 1)
            if len(ids) < room:  # the cut: the next proposal is refused, or completes the grammar
                history = outputs[rid] + ids
                nxt = proposal[len(ids)]
                assert nxt == END or nxt not in allowed(history[-1] if history else None, ends)
                cut += 1
            placed += bool(ids)
    assert placed and cut


@pytest.mark.parametrize("k, async_scheduling, graphs", [
    (2, False, None), (3, True, None), (4, False, None), (4, True, None),
    (3, False, GRAPHS), (2, True, {**GRAPHS, "cudagraph_mode": "FULL"}),
], ids=["k2-sync", "k3-async", "k4-sync", "k4-async", "k3-sync-graphs", "k2-async-full"])
def test_ngram_speculation_follows_the_grammar_and_matches_plain_decoding(plain, k, async_scheduling, graphs):
    llm, backend = build(ngram(k), graphs=graphs, async_scheduling=async_scheduling)
    full = watch_full(llm)
    check_run(llm, backend, Recorder(llm), plain, k, drafts_accepted=True)
    assert not llm.scheduler.has_unfinished_requests() and not llm._in_flight
    assert any(full) == (graphs is not None)  # graphs: verifying steps with per-slot masks replay FULL graphs


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_draft_model_speculation_follows_the_grammar(plain, async_scheduling):
    """The tiny model drafting for itself drafts its unconstrained choice: mostly refused, cut."""
    spec = {"method": "draft_model", "model": "builtin:tiny-llama", "num_speculative_tokens": 2}
    llm, backend = build(spec, async_scheduling=async_scheduling)
    recorder = Recorder(llm)
    got, _ = generate(llm)
    assert got == plain[0]
    assert recorder.steps and all(set(drafts) <= {"0", "1", "2", "3", "5"} for _, drafts, _, _ in recorder.steps)


# ------------------------------------------------------------------------------ xgrammar


def test_json_schema_with_ngram_speculation(tmp_path) -> None:
    """Random weights: only the per-slot masks keep the speculative output valid JSON (and exact)."""
    pytest.importorskip("xgrammar")
    import json

    from tests.engine.test_engine_text import make_text_model

    folder = make_text_model(tmp_path)
    flag = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}
    pair = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
            "required": ["ok", "n"], "additionalProperties": False}
    params = [SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=StructuredOutputsParams(json=flag))]
    params += [SamplingParams(max_tokens=60, temperature=1.0, seed=seed,
                              structured_outputs=StructuredOutputsParams(json=pair)) for seed in (6, 7)]
    outs, placed = {}, []
    for spec in (None, ngram(3)):
        llm = LLM(str(folder), device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
                  max_model_len=128, block_size=8, num_kv_blocks=96, speculative_config=spec)
        execute = llm.runner.execute_model

        def executed(so, execute=execute):
            placed.extend(ids for ids in so.scheduled_spec_decode_tokens.values() if ids)
            return execute(so)

        llm.runner.execute_model = executed
        outs[spec is not None] = [(o.text, o.finish_reason) for o in llm.generate(["café", "hello", "hello"], params)]
        llm.shutdown()
    assert placed  # real drafts verified under the grammar
    for (text, reason), p in zip(outs[True], params, strict=True):
        value = json.loads(text)
        assert reason == "stop" and isinstance(value["ok"], bool)
        assert set(value) == set(json.loads(str(p.structured_outputs.json))["required"])
        assert "n" not in value or type(value["n"]) is int
    assert outs[True] == outs[False]


class _Eager:
    """An xgrammar backend without `stop_token_ids`: the engine accepts every token in after_output."""

    def __init__(self, backend) -> None:
        self.compile, self.fill_many = backend.compile, backend.fill_many


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("k", [0, 3], ids=["plain", "ngram3"])
def test_deferred_accepts_give_the_same_tokens(tmp_path, k, async_scheduling) -> None:
    """Tokens that cannot complete a grammar are accepted before the next mask instead of right
    after the step: the same tokens and finish reasons, greedy and seeded, with and without EOS
    ignored (the grammar completes on EOS), with ngram drafts verified under the grammar."""
    pytest.importorskip("xgrammar")
    from tests.engine.test_engine_text import make_text_model

    folder = make_text_model(tmp_path)
    pair = StructuredOutputsParams(json={"type": "object", "required": ["ok", "n"], "additionalProperties": False,
                                         "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}}})
    params = [SamplingParams(max_tokens=48, temperature=0.0, structured_outputs=pair)]
    params += [SamplingParams(max_tokens=48, temperature=1.0, seed=seed, ignore_eos=seed == 7,
                              structured_outputs=pair) for seed in (6, 7)]
    outs, deferred = [], []
    for eager in (False, True):
        llm = LLM(str(folder), device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
                  max_model_len=128, block_size=8, num_kv_blocks=96, speculative_config=ngram(k) if k else None,
                  async_scheduling=async_scheduling)
        if eager:
            llm._structured = StructuredOutputs(_Eager(llm._structured.backend), llm.runner.vocab_size)
        after_output = llm._structured.after_output

        def recording(output, scheduler, structured=llm._structured, after_output=after_output):
            ended = after_output(output, scheduler)
            deferred.append(bool(structured.pending))  # tokens left for the next mask or drafts
            return ended

        llm._structured.after_output = recording
        placed: list[dict] = []  # the drafts each step verifies: cut by the same grammar states
        execute = llm.runner.execute_model

        def executed(so, execute=execute, placed=placed):
            placed.append(dict(so.scheduled_spec_decode_tokens))
            return execute(so)

        llm.runner.execute_model = executed
        got = [(list(o.token_ids), o.finish_reason) for o in llm.generate(["café", "hello", "hello"], params)]
        outs.append((got, placed))
        llm.shutdown()
    assert any(deferred) and outs[0] == outs[1]


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_grammar_with_speculation_in_full_cuda_graphs() -> None:
    """Real CUDA graphs: verifying steps with per-slot masks replay FULL graphs, same tokens."""
    expected = generate(build(None, "cuda")[0])
    for k, async_scheduling in ((3, False), (2, True)):
        llm, backend = build(ngram(k), "cuda", {**GRAPHS, "cudagraph_mode": "FULL"}, async_scheduling=async_scheduling)
        full = watch_full(llm)
        check_run(llm, backend, Recorder(llm), expected, k, drafts_accepted=True)
        assert any(full)
