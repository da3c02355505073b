"""The engine's grammar matchers (graphrunner.engine.structured): masks per step, advance, completion.

A tiny backend over token ids (a choice among token sequences) checks `StructuredOutputs` itself
without a grammar library; the xgrammar backend is checked over a small offline tokenizer when
xgrammar is installed (the optional extra `graphrunner[structured]`).
"""

from __future__ import annotations

import string

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.engine.structured import StructuredOutputs, XGrammarBackend
from graphrunner.protocol import SchedulerOutput
from graphrunner.structured_outputs import StructuredOutputsParams, bitmask_words

VOCAB = 64


def _allowed(row: np.ndarray, vocab: int = VOCAB) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]).tolist())


class _SequenceChoice:
    """Matcher: the output is one of `choices` (token-id tuples)."""

    def __init__(self, choices: list[tuple[int, ...]]) -> None:
        self.choices, self.prefix = choices, ()

    def _live(self) -> list[tuple[int, ...]]:
        return [c for c in self.choices if c[: len(self.prefix)] == self.prefix]

    def fill_bitmask(self, out: np.ndarray) -> None:
        bits = np.zeros(len(out) * 32, dtype=bool)
        for c in self._live():
            if len(c) > len(self.prefix):
                bits[c[len(self.prefix)]] = True
        out[:] = np.packbits(bits, bitorder="little").view("<u4").view(np.int32)

    def accept_token(self, token: int) -> bool:
        if not any(len(c) > len(self.prefix) and c[len(self.prefix)] == token for c in self._live()):
            return False
        self.prefix += (token,)
        return True

    def is_terminated(self) -> bool:
        return self.prefix in self.choices


class _Backend:
    def compile(self, params: StructuredOutputsParams) -> _SequenceChoice:
        assert params.choice is not None
        return _SequenceChoice([tuple(int(t) for t in c.split()) for c in params.choice])


def _so(*req_ids: str) -> SchedulerOutput:
    so = SchedulerOutput()
    so.num_scheduled_tokens = dict.fromkeys(req_ids, 1)
    return so


@given(choices=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4, unique=True), min_size=1,
                        max_size=4, unique_by=tuple), pick=st.integers(0, 3))
def test_masks_follow_the_matcher_until_the_grammar_completes(choices, pick) -> None:
    so_ = StructuredOutputs(_Backend(), VOCAB)
    params = StructuredOutputsParams(choice=[" ".join(map(str, c)) for c in choices])
    so_.add("r", params)
    target = choices[pick % len(choices)]
    for i, token in enumerate(target):
        out = so_.grammar_output(_so("r", "free"))
        assert out is not None and out.structured_output_request_ids == ["r"]  # "free" has no grammar
        assert out.grammar_bitmask.shape == (1, bitmask_words(VOCAB))
        assert token in _allowed(out.grammar_bitmask[0])
        done = so_.accept("r", [token])
        complete = tuple(target[: i + 1]) in {tuple(c) for c in choices}
        assert done == complete
        if done:
            break
    assert so_.grammar_output(_so("free")) is None


def test_a_disallowed_token_ends_the_request_and_errors_name_it() -> None:
    so_ = StructuredOutputs(_Backend(), VOCAB)
    so_.add("r", StructuredOutputsParams(choice=["1 2"]))
    assert so_.accept("r", [5]) is True  # not allowed: the request must end
    with pytest.raises(ValueError, match="request 'x': structured_outputs need a tokenizer"):
        StructuredOutputs(None, VOCAB).add("x", StructuredOutputsParams(regex="a+"))
    StructuredOutputs(None, VOCAB).add("y", None)  # unconstrained requests need nothing


def _tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for piece in [*string.ascii_lowercase, *string.digits, *' {}":,[]', "yes", "no", "true", "false"]:
        vocab[piece] = len(vocab)
    model = tokenizers.models.WordPiece(vocab, unk_token="<unk>", max_input_chars_per_word=100)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(model), unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


def test_xgrammar_backend_masks_choice_regex_json_and_ebnf() -> None:
    pytest.importorskip("xgrammar")
    tok = _tokenizer()
    so_ = StructuredOutputs(XGrammarBackend(tok, VOCAB), VOCAB)
    ids = tok.convert_tokens_to_ids
    so_.add("choice", StructuredOutputsParams(choice=["yes", "no"]))
    so_.add("regex", StructuredOutputsParams(regex="[0-9]+"))
    so_.add("json", StructuredOutputsParams(json={"type": "boolean"}))
    so_.add("ebnf", StructuredOutputsParams(grammar='root ::= "a" "b"*'))
    out = so_.grammar_output(_so("choice", "regex", "json", "ebnf"))
    assert out is not None
    masks = dict(zip(out.structured_output_request_ids, out.grammar_bitmask, strict=True))
    assert {ids("yes"), ids("no")} <= _allowed(masks["choice"]) and ids("7") not in _allowed(masks["choice"])
    assert ids("7") in _allowed(masks["regex"]) and ids("a") not in _allowed(masks["regex"])
    assert ids("true") in _allowed(masks["json"]) and ids("7") not in _allowed(masks["json"])
    assert _allowed(masks["ebnf"]) == {ids("a")}
    assert so_.accept("choice", [ids("no")]) is False  # the choice is complete: only EOS may follow
    after = so_.grammar_output(_so("choice"))
    assert after is not None and _allowed(after.grammar_bitmask[0]) == {tok.eos_token_id}
    assert so_.accept("choice", [tok.eos_token_id]) is True  # terminated
    assert so_.accept("ebnf", [ids("a"), ids("b")]) is False  # "b"* may go on
    with pytest.raises(ValueError, match="request 'bad': structured_outputs regex does not compile"):
        so_.add("bad", StructuredOutputsParams(regex="(unclosed"))


def test_xgrammar_masks_filled_together_equal_one_by_one() -> None:
    """The thread-pool fill (`XGrammarBackend.fill_many`) writes the same rows as each matcher's own
    fill, for live, advanced and completed grammars side by side."""
    pytest.importorskip("xgrammar")
    tok = _tokenizer()
    ids = tok.convert_tokens_to_ids

    class OneByOne:  # the same backend without fill_many: grammar_output fills each matcher itself
        def __init__(self, backend):
            self.compile = backend.compile

    params = [StructuredOutputsParams(choice=["yes", "no"]), StructuredOutputsParams(regex="[0-9]+"),
              StructuredOutputsParams(json={"type": "boolean"}), StructuredOutputsParams(grammar='root ::= "a" "b"*')]
    outputs = []
    for backend in (XGrammarBackend(tok, VOCAB), OneByOne(XGrammarBackend(tok, VOCAB))):
        so_ = StructuredOutputs(backend, VOCAB)
        for i, p in enumerate(params):
            so_.add(f"r{i}", p)
        so_.accept("r1", [ids("7")])
        so_.accept("r3", [ids("a"), ids("b")])
        so_.accept("r0", [ids("no")])  # complete: only EOS may follow
        out = so_.grammar_output(_so("r0", "r1", "r2", "r3"))
        assert out is not None
        outputs.append(out.grammar_bitmask)
    np.testing.assert_array_equal(outputs[0], outputs[1])


class _OneByOne:
    """An xgrammar backend without fill_many: grammar_output fills each matcher itself (`_fill_rows`)."""

    def __init__(self, backend):
        self.compile = backend.compile


_SCHEMA = {"type": "object", "required": ["a", "b"],
           "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "string"}}}}


@pytest.mark.parametrize("seed", [None, 0, 1], ids=["greedy", "seeded0", "seeded1"])
def test_xgrammar_fill_paths_agree_along_json_outputs(seed) -> None:
    """Along JSON outputs (r0 a scripted object that completes; the others the smallest allowed id
    each step, or seeded picks), the step's masks are the same from the one-call fill of every live
    row (1 and 2 threads) and from each matcher's own fill: also with drafts placed (speculation:
    rows along the drafts, then rolled back) and with a completed request listed beside live ones.
    Accepting gives the same answers."""
    pytest.importorskip("xgrammar")
    tok = _tokenizer()
    rng = np.random.default_rng(seed)
    base = XGrammarBackend(tok, VOCAB)
    engines = [StructuredOutputs(b, VOCAB) for b in (base, XGrammarBackend(tok, VOCAB, fill_threads=2),
                                                     _OneByOne(base))]
    for e in engines:
        for rid in ("r0", "r1", "r2"):
            e.add(rid, StructuredOutputsParams(json=_SCHEMA))
    script = [*tok.convert_tokens_to_ids(list('{"a":1,"b":["x"]}')), tok.eos_token_id]
    live, ended, row = ["r0", "r1", "r2"], [], np.zeros(bitmask_words(VOCAB), dtype=np.int32)
    for step in range(24):
        so = _so(*live, *ended)  # a request completed last step is listed once more (all tokens allowed)
        if step % 3 == 2 and len(live) > 1:  # speculation: the last live request verifies two drafts
            engines[2].matchers[live[-1]].fill_bitmask(row)
            so.scheduled_spec_decode_tokens = {live[-1]: [min(_allowed(row)), int(rng.integers(0, VOCAB))]}
        outs = [e.grammar_output(so) for e in engines]
        assert outs[0] is not None and outs[0].pinned is not None
        for out in outs[1:]:
            assert out is not None and out.structured_output_request_ids == outs[0].structured_output_request_ids
            np.testing.assert_array_equal(out.grammar_bitmask, outs[0].grammar_bitmask)
        for e in engines:
            for rid in ended:
                e.remove(rid)
        ended, start = [], 0
        for rid in outs[0].structured_output_request_ids:
            allowed = sorted(_allowed(outs[0].grammar_bitmask[start]))
            start += 1 + len(so.scheduled_spec_decode_tokens.get(rid, []))
            if rid not in live:
                continue
            token = script[step] if rid == "r0" else allowed[0] if seed is None else int(rng.choice(allowed))
            assert token in allowed
            done = {e.accept(rid, [token]) for e in engines}
            assert len(done) == 1, (rid, token)
            if done.pop():
                live.remove(rid)
                ended.append(rid)
    assert "r0" not in live and "r0" not in engines[0].matchers  # it completed, then left


def test_deferred_tokens_are_accepted_before_drafts_and_masks() -> None:
    """xgrammar: after_output only records a step's tokens that cannot complete the grammar (no stop
    token); place_drafts cuts the next drafts, and grammar_output fills the next mask, from the
    state after them. A stop token is accepted at once (the grammar completes, the request ends)."""
    pytest.importorskip("xgrammar")
    from types import SimpleNamespace

    from graphrunner.protocol import CachedRequestData, DraftTokenIds, ModelRunnerOutput

    tok = _tokenizer()
    ids = tok.convert_tokens_to_ids
    so_ = StructuredOutputs(XGrammarBackend(tok, VOCAB), VOCAB)
    so_.add("r", StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                               "required": ["a"], "additionalProperties": False}))
    placed, finished = {}, []
    scheduler = SimpleNamespace(
        requests={"r": SimpleNamespace(num_prefill_tokens=1)}, num_speculative_tokens=2,
        schedule_drafts=lambda so, rid, drafts: placed.__setitem__(rid, drafts),
        finish_request=lambda rid, status: finished.append(rid))
    output = ModelRunnerOutput(req_ids=["r"], req_id_to_index={"r": 0}, sampled_token_ids=[[ids("{")]])
    assert so_.after_output(output, scheduler) == [] and so_.pending == {"r": [ids("{")]}
    runner = SimpleNamespace(take_draft_token_ids=lambda: DraftTokenIds(["r"], [[ids('"'), ids("a")]]))
    so = _so("r")
    so.num_scheduled_tokens["r"] = 3
    so.scheduled_cached_reqs = CachedRequestData(req_ids=["r"], num_computed_tokens=[5])
    so_.place_drafts(runner, so, scheduler)
    assert placed == {"r": [ids('"'), ids("a")]} and not so_.pending  # '"' is refused before '{'
    for token, allowed in (('"', ids("a")), ("a", ids('"')), ('"', ids(":"))):  # {"a": next
        output.sampled_token_ids = [[ids(token)]]
        so_.after_output(output, scheduler)
        out = so_.grammar_output(_so("r"))
        assert out is not None and allowed in _allowed(out.grammar_bitmask[0]) and not so_.pending
    output.sampled_token_ids = [[ids(":"), ids("7"), ids("}"), tok.eos_token_id]]  # ends with a stop token
    so_.after_output(output, scheduler)
    assert finished == ["r"] and "r" in so_.terminated and not so_.pending
    # A deferred token the grammar refuses (never sampled under its masks): the request ends next output.
    so_.add("b", StructuredOutputsParams(regex="[0-9]+"))
    scheduler.requests["b"] = SimpleNamespace(num_prefill_tokens=1)
    broken = ModelRunnerOutput(req_ids=["b"], req_id_to_index={"b": 0}, sampled_token_ids=[[ids("x")]])
    so_.after_output(broken, scheduler)
    assert so_.grammar_output(_so("b")) is not None and so_.broken == {"b"}
    broken.sampled_token_ids = [[ids("7")]]
    so_.after_output(broken, scheduler)
    assert finished == ["r", "b"]


def test_a_mask_disjoint_from_allowed_token_ids_samples_from_them_and_ends_the_request() -> None:
    """A grammar (or bad words) that leaves none of a request's allowed_token_ids would leave an all
    -inf row (token 0, outside the set): the row takes the allowed set, the request ends after it."""
    so_ = StructuredOutputs(_Backend(), VOCAB)
    so_.add("g", StructuredOutputsParams(choice=["1 2"]), allowed_token_ids=[5, 6])  # disjoint
    so_.add("ok", StructuredOutputsParams(choice=["1 2"]), allowed_token_ids=[1, 5])  # overlaps: untouched
    out = so_.grammar_output(_so("g", "ok"))
    assert out is not None
    masks = dict(zip(out.structured_output_request_ids, out.grammar_bitmask, strict=True))
    assert _allowed(masks["g"]) == {5, 6} and _allowed(masks["ok"]) == {1}
    assert so_.broken == {"g"}

    class _Scheduler:
        requests = {"g": None, "ok": None}
        finished: list[str] = []

        def finish_request(self, rid, status):
            self.finished.append(rid)

    from graphrunner.protocol import ModelRunnerOutput

    sched = _Scheduler()
    so_.after_output(ModelRunnerOutput(req_ids=["g", "ok"], sampled_token_ids=[[5], [1]]), sched)
    assert sched.finished == ["g"]


# ---------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory):
    pytest.importorskip("xgrammar")
    from tests.engine.test_engine_text import make_text_model

    return make_text_model(tmp_path_factory.mktemp("structured_model"))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_llm_output_follows_choice_regex_and_json(text_folder, async_scheduling: bool) -> None:
    """Random weights: only the masks make the outputs valid. The request ends when its grammar is
    complete (EOS, the one token the mask then allows); an unconstrained request runs beside them."""
    import json

    from graphrunner.engine import LLM
    from graphrunner.protocol import SamplingParams

    llm = LLM(str(text_folder), device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
              max_model_len=128, block_size=8, num_kv_blocks=96, async_scheduling=async_scheduling)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(
            choice=["hello world", "the graph runner"])),
        SamplingParams(max_tokens=40, temperature=1.0, seed=5, structured_outputs=StructuredOutputsParams(
            regex="(the|fox) (quick|lazy) dog")),
        SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema)),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    ]
    outs = llm.generate(["hello", "the", "café", "hello world"], params)
    llm.shutdown()
    assert outs[0].text in ("hello world", "the graph runner") and outs[0].finish_reason == "stop"
    assert outs[1].text in ("the quick dog", "the lazy dog", "fox quick dog", "fox lazy dog")
    assert isinstance(json.loads(outs[2].text)["ok"], bool)
    assert len(outs[3].token_ids) == 6  # unconstrained, untouched


def test_structured_outputs_without_a_tokenizer_are_refused() -> None:
    from graphrunner.engine import LLM
    from graphrunner.protocol import SamplingParams

    llm = LLM("builtin:tiny-llama", device="cpu", num_kv_blocks=32)
    with pytest.raises(ValueError, match="request '0': structured_outputs need a tokenizer"):
        llm.generate([[1, 2]], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")))
    llm.shutdown()


def test_bad_words_that_ban_the_last_allowed_token_end_the_request_on_it() -> None:
    """allowed_token_ids=[9] with the bad word (9, 9): after one 9 nothing is left to sample. The
    request ends on a 9 (never token 0, outside the set); the next request is served as usual."""
    from graphrunner.engine import LLM
    from graphrunner.protocol import SamplingParams

    llm = LLM("builtin:tiny-llama", device="cpu", num_kv_blocks=32, max_model_len=64)
    trapped, free = llm.generate([[1, 2, 3], [1, 2, 3]], [
        SamplingParams(max_tokens=5, temperature=0.0, allowed_token_ids=[9], bad_words_token_ids=[[9, 9]]),
        SamplingParams(max_tokens=5, temperature=0.0, allowed_token_ids=[9, 11], bad_words_token_ids=[[9, 9]])])
    assert trapped.token_ids == [9, 9] and trapped.finish_reason == "stop"
    assert len(free.token_ids) == 5 and set(free.token_ids) <= {9, 11} and free.finish_reason == "length"
    llm.shutdown()
