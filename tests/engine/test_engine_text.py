"""Text in, text out: text prompts, `RequestOutput.text`, `SamplingParams.stop`.

The model folder is a tiny random llama (tests/hf_fixtures.py) with a byte-level BPE tokenizer
trained offline on a few sentences; the model's vocab_size is the tokenizer's, so every
sampled id decodes. `make_text_model` is shared with tests/engine/test_engine_stream.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("graphrunner.runner")
tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from graphrunner.engine import LLM  # noqa: E402
from graphrunner.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from graphrunner.protocol import SamplingParams  # noqa: E402
from tests.hf_fixtures import make_hf_checkpoint  # noqa: E402

CORPUS = ["hello world, the graph runner runs graphs.", "stop here. the quick brown fox jumps over the lazy dog",
          "héllo wörld: café crème brûlée, naïve façade"] * 4
EOS = "<eos>"


# A chat template for the text model's tokenizer (llm.chat, /v1/chat/completions).
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def add_chat_template(folder: Path) -> Path:
    """Give the tokenizer folder of `make_text_model` a chat template; returns the folder."""
    config = folder / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["chat_template"] = CHAT_TEMPLATE
    config.write_text(json.dumps(data))
    return folder


def make_text_model(folder: Path) -> Path:
    """A random llama folder with a byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[EOS], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    eos_id = tok.token_to_id(EOS)
    make_hf_checkpoint("llama", folder, vocab_size=tok.get_vocab_size(), bos_token_id=eos_id, eos_token_id=eos_id)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(folder)
    return folder


def make_llm(folder: Path, **kw) -> LLM:
    kw = {"device": "cpu", "dtype": "float32", "max_num_seqs": 8, "max_num_batched_tokens": 64,
          "max_model_len": 128, "block_size": 8, "num_kv_blocks": 96, **kw}
    return LLM(str(folder), **kw)


def word_tokens(tokenizer) -> list[int]:
    """Ids whose own text is at least two whole characters: outputs restricted to them have
    no partial UTF-8 sequence, so a stop string can be chosen from their pieces."""
    ids = []
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i], skip_special_tokens=True)
        if len(text) >= 2 and "\ufffd" not in text:
            ids.append(i)
    return ids


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_text_model(tmp_path_factory.mktemp("text_model"))


@pytest.fixture(scope="module")
def llm(folder) -> LLM:
    return make_llm(folder)


@pytest.fixture(scope="module")
def async_llm(folder) -> LLM:
    return make_llm(folder, async_scheduling=True)


def greedy(n: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


TEXTS = ["hello world", "the graph runner", "café crème", "stop here. the"]


def test_text_prompts_equal_token_id_prompts(llm):
    ids = [llm.tokenizer.encode(t) for t in TEXTS]
    by_text, by_ids = llm.generate(TEXTS, greedy()), llm.generate(ids, greedy())
    assert [o.prompt_token_ids for o in by_text] == ids
    assert [o.token_ids for o in by_text] == [o.token_ids for o in by_ids]
    assert [o.text for o in by_text] == [o.text for o in by_ids]
    assert llm.generate(TEXTS[0], greedy())[0].token_ids == by_ids[0].token_ids  # one text: one prompt


def test_mixed_prompts_and_flat_lists(llm):
    ids = llm.tokenizer.encode(TEXTS[1])
    outs = llm.generate([TEXTS[1], ids], greedy(4))
    assert outs[0].token_ids == outs[1].token_ids
    with pytest.raises(TypeError, match="list of token-id lists"):
        llm.generate(ids, greedy())


@pytest.mark.parametrize("engine", ["llm", "async_llm"])
def test_text_is_the_decode_of_the_token_ids(engine, request):
    llm = request.getfixturevalue(engine)
    outs = llm.generate(TEXTS, SamplingParams(max_tokens=24, temperature=1.0, seed=5))
    for o in outs:
        assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
    # Streamed requests (followed step by step) read the same text.
    streamed: dict[str, str] = {}
    for d in llm.generate_stream(TEXTS, SamplingParams(max_tokens=24, temperature=1.0, seed=5)):
        streamed[d.req_id] = streamed.get(d.req_id, "") + d.text
    assert sorted(streamed.values()) == sorted(o.text for o in outs)


def test_multibyte_characters_split_over_tokens_decode_whole(llm):
    """Outputs made of single bytes of 'é', 'è', 'ü' and ascii: the incremental text waits for
    each character's last byte, and ends equal to the whole decode (invalid runs included)."""
    tok = llm.tokenizer
    byte_ids = sorted({i for ch in "éèü a" for i in tok.encode(ch)})
    assert any("\ufffd" in tok.decode([i]) for i in byte_ids)  # some are partial characters
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=3, allowed_token_ids=byte_ids)
    for o in llm.generate(TEXTS, params):
        assert o.text == tok.decode(o.token_ids, skip_special_tokens=True)
    for d in llm.generate_stream(TEXTS[:1], params):
        assert d.finished or not d.text.endswith("\ufffd")


def _expected_stop(tokenizer, token_ids: list[int], stop: str) -> tuple[list[int], str]:
    """The tokens up to the first one whose text holds `stop`, and that text cut before it."""
    for n in range(1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[:n], skip_special_tokens=True)
        if stop in text:
            return token_ids[:n], text[:text.index(stop)]
    raise AssertionError(f"{stop!r} not in the reference output")


@pytest.mark.parametrize("engine", ["llm", "async_llm"])
def test_stop_strings_truncate_and_finish(engine, request):
    llm = request.getfixturevalue(engine)
    tok = llm.tokenizer
    allowed = word_tokens(tok)
    base = greedy(16, allowed_token_ids=allowed)
    ref = llm.generate(TEXTS, base)
    cases = []
    for o in ref:
        pieces = [tok.decode([t]) for t in o.token_ids]
        cases.append(pieces[3][-1] + pieces[4][0])  # spans tokens 3 and 4
    cases[-1] = pieces[0][:2]  # within the very first token
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, allowed_token_ids=allowed, stop=[s])
              for s in cases]
    outs = llm.generate(TEXTS, params)
    for o, r, stop in zip(outs, ref, cases, strict=True):
        token_ids, text = _expected_stop(tok, r.token_ids, stop)
        assert (o.token_ids, o.text, o.finish_reason) == (token_ids, text, "stop")
    assert outs[-1].token_ids == ref[-1].token_ids[:1] and outs[-1].text == ""
    assert not llm.scheduler.has_unfinished_requests()
    assert llm.scheduler.block_allocator.num_free == llm.scheduler.num_blocks
    # The engine keeps serving: the next call's tokens are the reference's.
    assert [o.token_ids for o in llm.generate(TEXTS, base)] == [o.token_ids for o in ref]


def test_stop_strings_in_a_stream_never_show_the_stop_string(llm):
    tok = llm.tokenizer
    allowed = word_tokens(tok)
    ref = llm.generate(TEXTS[:1], greedy(16, allowed_token_ids=allowed))[0]
    pieces = [tok.decode([t]) for t in ref.token_ids]
    stop = pieces[5][-1] + pieces[6] + pieces[7][:1]  # three tokens long
    deltas = list(llm.generate_stream(TEXTS[:1], greedy(16, allowed_token_ids=allowed, stop=[stop])))
    token_ids, text = _expected_stop(tok, ref.token_ids, stop)
    assert "".join(d.text for d in deltas) == text
    assert [t for d in deltas for t in d.token_ids] == token_ids
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["stop"]


def test_stop_strings_wait_for_min_tokens(llm):
    """vLLM's rule: a stop string counts only once it ends in a token after the first min_tokens."""
    tok = llm.tokenizer
    allowed = word_tokens(tok)
    ref = llm.generate(TEXTS[:1], greedy(12, allowed_token_ids=allowed))[0]
    stop = tok.decode(ref.token_ids[:1])[0]  # found at the first token already
    out = llm.generate(TEXTS[:1], greedy(12, allowed_token_ids=allowed, stop=[stop], min_tokens=3))[0]
    expected = (ref.token_ids, tok.decode(ref.token_ids), "length")
    for n in range(4, len(ref.token_ids) + 1):
        before, text = tok.decode(ref.token_ids[:n - 1]), tok.decode(ref.token_ids[:n])
        at = text.find(stop, max(len(before) - len(stop) + 1, 0))
        if at >= 0:
            expected = (ref.token_ids[:n], text[:at], "stop")
            break
    assert (out.token_ids, out.text, out.finish_reason) == expected


def test_stop_strings_without_a_tokenizer_are_refused(folder):
    llm = make_llm(folder, skip_tokenizer_init=True)
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match=r"request '0': stop=\['x'\] needs a tokenizer"):
        llm.generate([[5, 6, 7]], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="prompt 0 is text .* needs a tokenizer"):
        llm.generate(["hello"])
    assert not llm.scheduler.has_unfinished_requests()
    out = llm.generate([[5, 6, 7]], greedy(3))[0]
    assert out.outputs[0].text == "" and len(out.token_ids) == 3  # no tokenizer: no text (vLLM: "")


def test_builtin_models_have_no_tokenizer():
    llm = LLM("builtin:tiny-llama", device="cpu", max_num_seqs=2, max_model_len=32, num_kv_blocks=16)
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="needs a tokenizer"):
        llm.generate([[1, 2]], SamplingParams(stop=["\n"]))


class _CharTokenizer:
    """Ids are code points; decode joins them (a stand-in to test the detokenizer alone)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_detokenizer_holds_back_a_possible_stop_string_while_live():
    detok = IncrementalDetokenizer(_CharTokenizer(), stop=("abc",))
    assert detok.add_tokens([ord(c) for c in "xyab"]) is None
    assert detok.take_delta(finished=False) == "xy"  # "ab" may begin "abc"
    assert detok.add_tokens([ord(c) for c in "cde"]) == 1  # the first of them completes it
    assert detok.text == "xy" and detok.take_delta(finished=True) == ""


def test_without_transformers_the_tokenizers_package_serves(folder, llm, monkeypatch):
    """The `text` extra alone (no transformers): tokenizer.json through `tokenizers`, same ids and text."""
    from graphrunner.engine.detokenizer import load_text_tokenizer

    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # import transformers -> ImportError
    tok = load_text_tokenizer(str(folder))
    assert type(tok).__name__ == "_TokenizersAdapter"
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == llm.tokenizer.encode(text) and tok.decode(ids) == llm.tokenizer.decode(ids)
    assert load_text_tokenizer("builtin:tiny-llama") is None
    assert load_text_tokenizer(str(folder / "missing")) is None
