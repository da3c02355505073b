"""tools/bench/sampler_tiers.py on the tiny model (CPU, interpreted kernels): a row keeping one
token is proved by the guess tier; flat random-weight rows whose top-p mass is spread over more
tokens than the guess tier's candidates go to a later tier, which is what the tool exists to show."""

from __future__ import annotations

import re

import pytest

from graphrunner.kernels import HAS_TRITON
from graphrunner_tools.bench import sampler_tiers


def _rows(out: str) -> list[tuple[float, int, int]]:
    return [(float(p), int(n), int(t)) for p, n, t in re.findall(r"^\| \d+ \| (\S+) \| (\d+) \| (\d) \|$", out, re.M)]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
def test_tiers_of_the_tiny_models_rows(capsys):
    common = ["--model", "builtin:tiny-llama", "--device", "cpu", "--num-prompts", "2"]
    sampler_tiers.main([*common, "--top-k", "1", "--top-p", "1.0"])
    assert [t for _, _, t in _rows(capsys.readouterr().out)] == [0, 0]
    sampler_tiers.main([*common, "--top-p", "0.95"])
    rows = _rows(capsys.readouterr().out)
    assert len(rows) == 2
    from graphrunner.sample.pivot_select import GUESS_CAPACITY

    for _, holding, tier in rows:  # random weights: ~1,870 of 2,048 tokens hold 95% of the mass
        assert holding > GUESS_CAPACITY and tier >= 1
