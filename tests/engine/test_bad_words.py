"""Bad words of several tokens (vLLM's rule): a word's last token is banned at a step where the
request's generated tokens end with the word's other tokens.

`WordBans` against a brute-force transcription of the rule (hypothesis); the words' tokenization
against vLLM's (with and without a leading space); whole generations (sync, async, speculative)
against a brute-force decode that bans, one token at a time, what the rule bans.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.engine.bad_words import WordBans, bad_words_token_ids, clear_bits
from graphrunner.protocol import SamplingParams

MAX_TOKENS = 10


def brute_banned(sequences: list[list[int]], past: list[int]) -> set[int]:
    """The rule, transcribed: every sequence whose prefix the past tokens end with bans its last token."""
    return {s[-1] for s in sequences if len(s) - 1 <= len(past) and past[len(past) - (len(s) - 1):] == s[:-1]}


@given(sequences=st.lists(st.lists(st.integers(0, 4), min_size=2, max_size=4), min_size=1, max_size=5),
       history=st.lists(st.lists(st.integers(0, 4), max_size=3), max_size=5),
       drafts=st.lists(st.integers(0, 4), max_size=4))
def test_word_bans_equal_the_rule(sequences, history, drafts):
    bans = WordBans(sequences)
    past: list[int] = []
    for step in history:  # steps emit one or several tokens (speculation)
        bans.accept(step)
        past += step
        assert bans.banned() == brute_banned(sequences, past)
    assert bans.banned(drafts) == brute_banned(sequences, past + drafts)
    valid = bans.valid_drafts(drafts)
    assert valid == drafts[:len(valid)]
    assert all(d not in brute_banned(sequences, past + drafts[:j]) for j, d in enumerate(valid))
    if len(valid) < len(drafts):
        assert drafts[len(valid)] in brute_banned(sequences, past + valid)


def test_clear_bits_forbids_exactly_the_tokens():
    import numpy as np

    row = np.full(3, -1, dtype=np.int32)
    clear_bits(row, {0, 31, 32, 95})
    allowed = {v for v in range(96) if (int(row.view(np.uint32)[v >> 5]) >> (v & 31)) & 1}
    assert allowed == set(range(96)) - {0, 31, 32, 95}


class _Tokenizer:
    """A tokenizer of fixed encodings, to pin vLLM's rule for the variant with a leading space."""

    CODES = {"ab": [1, 2], " ab": [3, 2],  # a new first token, same length: both banned
             "cd": [4], " cd": [5, 4],  # a different length: the spaced variant is not
             "ef": [6, 7], " ef": [6, 7]}  # the same first token: once

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return self.CODES[text]


def test_words_tokenize_as_vllm_does():
    assert bad_words_token_ids(["ab", "  cd", "ef"], _Tokenizer()) == [[1, 2], [3, 2], [4], [6, 7]]


# ---------------------------------------------------------------- whole generations
pytest.importorskip("graphrunner.runner")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from graphrunner import LLM  # noqa: E402
from tests.engine.test_engine_text import make_text_model  # noqa: E402

ENGINE_ARGS = dict(device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                   block_size=8, num_kv_blocks=128)
PROMPT = "hello world"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_text_model(tmp_path_factory.mktemp("bad_words_model"))


@pytest.fixture(scope="module")
def llm(folder) -> LLM:
    return LLM(str(folder), enable_prefix_caching=False, **ENGINE_ARGS)


def greedy(llm, prompt: list[int], **kw) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)
    return list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)


def brute_force_decode(llm, prompt: list[int], sequences: list[list[int]]) -> list[int]:
    """Greedy, one token per call over the whole text so far, banning (logit bias) what the rule bans."""
    out: list[int] = []
    for _ in range(MAX_TOKENS):
        banned = brute_banned(sequences, out)
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                logit_bias={t: -1e30 for t in banned} or None)
        out.append(llm.generate([prompt + out], params, use_tqdm=False)[0].outputs[0].token_ids[0])
    return out


@pytest.fixture(scope="module")
def case(llm) -> tuple[list[int], list[list[int]], list[int]]:
    """(prompt, words that the free greedy output contains, the brute-force decode banning them)."""
    prompt = llm.get_tokenizer().encode(PROMPT)
    free = greedy(llm, prompt)
    first = [free[0:2]]  # a word at the start of the output: its first token generated, its second banned
    once = brute_force_decode(llm, prompt, first)
    assert once[0] == free[0] and once[1] != free[1]
    sequences = [*first, once[4:7], [free[1], 7, 8]]  # and a word of three tokens, later on
    expected = brute_force_decode(llm, prompt, sequences)
    assert expected[:6] == once[:6] and expected[6] != once[6]
    return prompt, sequences, expected


def test_multi_token_words_equal_the_brute_force_decode(llm, case):
    prompt, sequences, expected = case
    assert greedy(llm, prompt, bad_words_token_ids=sequences) == expected
    assert not llm._structured.bans  # forgotten with their requests


def test_async_and_speculative_steps_ban_alike(folder, case):
    prompt, sequences, expected = case
    for kw in ({"async_scheduling": True},
               {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                       "prompt_lookup_max": 2}}):
        with LLM(str(folder), enable_prefix_caching=False, **ENGINE_ARGS, **kw) as other:
            assert greedy(other, prompt, bad_words_token_ids=sequences) == expected, kw


def test_text_bad_words_take_the_tokenized_sequences(llm):
    tok = llm.get_tokenizer()
    prompt = tok.encode(PROMPT)
    free = greedy(llm, prompt)
    word = tok.decode(free[1:3])
    sequences = bad_words_token_ids([word], tok)
    plural = [s for s in sequences if len(s) > 1]
    single = {s[0] for s in sequences if len(s) == 1}
    out = greedy(llm, prompt, bad_words=[word])
    assert out == brute_force_decode(llm, prompt, sequences)
    assert not single & set(out) and not any(brute_banned(plural, out[:i]) & {out[i]} for i in range(len(out)))
