"""SpeculativeConfig: vLLM's dict / JSON shape, and errors that name the value and the allowed set."""

from __future__ import annotations

import pytest

from graphrunner.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig


def test_vllm_shaped_configs_parse():
    ngram = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4})
    assert (ngram.method, ngram.num_speculative_tokens, ngram.prompt_lookup_max) == ("ngram", 4, 4)
    draft = SpeculativeConfig.from_dict(
        '{"method": "draft_model", "model": "builtin:llama-3.2-1b", "num_speculative_tokens": 2}')
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "builtin:llama-3.2-1b", 2)
    assert SpeculativeConfig.from_dict(None).num_speculative_tokens == 0


@pytest.mark.parametrize("config, needle", [
    ({"method": "medusa", "num_speculative_tokens": 2},
     r"method='medusa'; allowed: \('ngram', 'draft_model', 'eagle', 'eagle3'\)"),
    ({"method": "eagle", "num_speculative_tokens": 2}, r"method 'eagle' needs the head's `model`"),
    ({"method": "ngram", "num_speculative_tokens": -1}, r"num_speculative_tokens=-1 must be an int in \[0, "),
    ({"method": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1}, "must be an int in"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, r"num_speculative_tokens=2.5"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_min=3, prompt_lookup_max=2"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a draft `model`"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "fast"},
     r"rejection_sample_method='fast'; allowed"),
    ({"method": "ngram", "num_speculative_tokens": 2, "synthetic_acceptance_rate": 1.5}, r"must be in \[0, 1\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3},
     r"unknown speculative config keys \['lookahead'\]"),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a dict, got list"),
])
def test_bad_configs_name_the_value(config, needle):
    with pytest.raises(ValueError, match=needle):
        SpeculativeConfig.from_dict(config)


def test_draft_model_must_share_the_vocabulary():
    config = SpeculativeConfig(num_speculative_tokens=2, method="draft_model", model="builtin:tiny-llama")
    config.check_draft_vocab(32000, 32000)
    with pytest.raises(ValueError, match="vocab_size=151936, the target 32000"):
        config.check_draft_vocab(32000, 151936)
