"""Sampling distributions vs numpy references: chi-square goodness of fit, fixed seeds.

Each case draws N tokens from one seeded request at N distinct positions (the noise is
keyed by (seed, position), so positions give independent draws) and tests the counts
against the reference distribution at significance 1e-3: a case fails only if
p < 1e-3. Seeds are fixed, so the outcome is deterministic. Tokens outside the kept set
must never be drawn.
"""

import math

import numpy as np
import pytest
import torch

from graphrunner.protocol import SamplingParams
from tests.sample.test_sampler import make_states, run_sampler

ALPHA = 1e-3
N = 6000
LOGITS = np.array([2.0, 1.6, 1.1, 0.9, 0.3, 0.0, -0.4, -0.9, -1.3, -2.0, -2.6, -3.5], dtype=np.float32)


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square(dof): the regularized upper incomplete gamma Q(dof/2, x/2)."""
    a, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    log_prefix = a * math.log(z) - z - math.lgamma(a)
    if z < a + 1:  # series for P, then Q = 1 - P
        term = total = 1.0 / a
        n = a
        for _ in range(1000):
            n += 1
            term *= z / n
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(log_prefix))
    # Continued fraction for Q (Lentz).
    tiny = 1e-300
    b = z + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(log_prefix) * h


def test_chi2_sf_matches_known_values():
    # Critical values at alpha = 0.001 (tables): dof 1 -> 10.828, 5 -> 20.515, 10 -> 29.588.
    for x, dof in ((10.828, 1), (20.515, 5), (29.588, 10)):
        assert abs(chi2_sf(x, dof) - 1e-3) < 2e-5, (x, dof, chi2_sf(x, dof))
    assert abs(chi2_sf(2.0, 2) - math.exp(-1.0)) < 1e-12


def reference_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Independent float64 reference: temperature, min-p, top-k, top-p by sorting."""
    x = logits.astype(np.float64) / p.temperature
    keep = np.ones(len(x), dtype=bool)
    if p.min_p > 0:
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        keep &= probs >= p.min_p * probs.max()
    order = np.argsort(-x, kind="stable")
    if 0 < p.top_k < len(x):
        keep_k = np.zeros(len(x), dtype=bool)
        keep_k[order[: p.top_k]] = True
        keep &= keep_k
    if p.top_p < 1:
        probs = np.where(keep, np.exp(x - x.max()), 0.0)
        probs /= probs.sum()
        sorted_probs = probs[order]
        before = np.cumsum(sorted_probs) - sorted_probs
        # The test is only meaningful away from the boundary: no float rounding can flip it.
        assert np.min(np.abs(before[sorted_probs > 0] - p.top_p)) > 1e-4, "case too close to the top-p boundary"
        keep_p = np.zeros(len(x), dtype=bool)
        keep_p[order[before < p.top_p]] = True
        keep &= keep_p
    probs = np.where(keep, np.exp(x - x.max()), 0.0)
    return probs / probs.sum()


def draw(params: SamplingParams, logits: np.ndarray, n: int = N, start: int = 0) -> np.ndarray:
    vocab = len(logits)
    states = make_states([params], vocab)
    batch = torch.from_numpy(logits).repeat(n, 1)  # [n, V]: one row, n positions
    out = run_sampler(states, batch, [0] * n, list(range(start, start + n)))
    return out.numpy()


def assert_fits(tokens: np.ndarray, probs: np.ndarray) -> None:
    counts = np.bincount(tokens, minlength=len(probs))
    outside = counts[probs == 0].sum()
    assert outside == 0, f"{outside} draws of filtered-out tokens: counts={counts}, probs={probs}"
    kept = probs > 0
    expected = probs[kept] * len(tokens)
    observed = counts[kept].astype(np.float64)
    # Pool categories with small expectations so the chi-square approximation holds.
    small = expected < 5
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    dof = len(expected) - 1
    if dof == 0:
        return
    stat = float(((observed - expected) ** 2 / expected).sum())
    pvalue = chi2_sf(stat, dof)
    assert pvalue > ALPHA, f"chi2={stat:.2f} dof={dof} p={pvalue:.2e}: counts={counts}, expected={probs * len(tokens)}"


CASES = {
    "temperature_1": SamplingParams(temperature=1.0, seed=1),
    "temperature_0.6": SamplingParams(temperature=0.6, seed=2),
    "temperature_1.7": SamplingParams(temperature=1.7, seed=3),
    "top_k_4": SamplingParams(temperature=1.0, top_k=4, seed=4),
    "top_p_0.8": SamplingParams(temperature=1.0, top_p=0.8, seed=5),
    "min_p_0.1": SamplingParams(temperature=1.0, min_p=0.1, seed=6),
    "k_p": SamplingParams(temperature=0.8, top_k=6, top_p=0.9, seed=7),
    "k_p_min_p": SamplingParams(temperature=1.3, top_k=8, top_p=0.85, min_p=0.05, seed=8),
    "p_min_p": SamplingParams(temperature=1.1, top_p=0.7, min_p=0.2, seed=9),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_distribution_matches_reference(name):
    params = CASES[name]
    assert_fits(draw(params, LOGITS), reference_probs(LOGITS, params))


def test_other_seeds_and_positions_give_the_same_distribution():
    # A different seed and a far-off position window: still the same law.
    params = SamplingParams(temperature=0.9, top_k=7, seed=123456789)
    assert_fits(draw(params, LOGITS, n=4000, start=10**6), reference_probs(LOGITS, params))


def test_distribution_with_penalties_and_bias():
    # The processors shift the logits deterministically; the draws follow softmax of the result.
    # n requests that differ only in seed, at the same position and history (the output
    # count must not change, so the noise varies by seed rather than by position).
    vocab, n = len(LOGITS), 4000
    history = [0, 1, 2, 2, 5]  # prompt [0, 1], outputs [2, 2, 5]
    many = [SamplingParams(temperature=1.0, seed=s, repetition_penalty=1.5, frequency_penalty=0.3,
                           presence_penalty=0.2, logit_bias={5: 1.0, 0: -1.0}) for s in range(n)]
    states = make_states(many, vocab, histories=[history] * n, prompt_lens=[2] * n)
    out = run_sampler(states, torch.from_numpy(LOGITS).repeat(n, 1), list(range(n)), [len(history)] * n)
    x = LOGITS.astype(np.float64).copy()
    x[5] += 1.0
    x[0] -= 1.0
    for t in set(history):
        x[t] = x[t] / 1.5 if x[t] > 0 else x[t] * 1.5
    for t, c in ((2, 2), (5, 1)):
        x[t] -= 0.3 * c + 0.2
    probs = np.exp(x - x.max())
    assert_fits(out.numpy(), probs / probs.sum())
