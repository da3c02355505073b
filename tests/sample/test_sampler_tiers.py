"""tools/bench/sampler_tiers.py on the tiny model (CPU, interpreted kernels): a row keeping one
token is proved by the guess tier; flat random-weight rows whose top-p mass is spread over more
tokens than the guess tier's candidates are served by tier -1 (their draw, proven kept) or a later
tier, which is what the tool exists to show, by number and name."""

from __future__ import annotations

import re

import pytest

from graphrunner.kernels import HAS_TRITON
from graphrunner.sample.pivot_refine import TIER_FALLBACK, TIER_GUESS, TIER_PIVOTS, TIER_REFINE
from graphrunner.sample.pivot_reject import TIER_REJECT
from graphrunner_tools.bench import sampler_tiers


def _rows(out: str) -> list[tuple[float, int, int, str]]:
    found = re.findall(r"^\| \d+ \| (\S+) \| (\d+) \| (-?\d) (\w+) \|$", out, re.M)
    return [(float(p), int(n), int(t), name) for p, n, t, name in found]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
def test_tiers_of_the_tiny_models_rows(capsys):
    common = ["--model", "builtin:tiny-llama", "--device", "cpu", "--num-prompts", "2"]
    sampler_tiers.main([*common, "--top-k", "1", "--top-p", "1.0"])
    assert [(t, name) for _, _, t, name in _rows(capsys.readouterr().out)] == [(TIER_GUESS, "guess")] * 2
    # Tier -1 serves a flat row whose draw is kept (~95% of them at top-p 0.95); the others go on.
    sampler_tiers.main([*common, "--top-p", "0.95"])
    rows = _rows(capsys.readouterr().out)
    assert len(rows) == 2 and (TIER_REJECT, "reject") in [(t, name) for _, _, t, name in rows]
    from graphrunner.sample.pivot_select import GUESS_CAPACITY

    for _, holding, tier, name in rows:  # random weights: ~1,870 of 2,048 tokens hold 95% of the mass
        assert holding > GUESS_CAPACITY and (tier == TIER_REJECT or tier >= TIER_PIVOTS)
        assert name == sampler_tiers.TIER_NAMES[tier]
    assert sampler_tiers.TIER_NAMES[TIER_REFINE] == "refine" and sampler_tiers.TIER_NAMES[TIER_FALLBACK] == "fallback"
