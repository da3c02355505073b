"""The speculative-decoding rejection sampler (graphrunner/spec_decode/rejection.py).

- greedy rows emit exactly what plain greedy decoding would (brute-force reference);
- a random row with no drafts emits exactly the plain Sampler's token;
- the emitted tokens have the target distribution p, whatever the drafter (chi-square at
  significance 1e-3 over 20,000 independent rows, fixed seeds: deterministic), and the
  first draft's acceptance rate is sum_x min(p(x), q(x));
- outputs are deterministic and independent of the other rows; bad inputs raise.
"""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.protocol import SamplingParams
from graphrunner.sample.filters import apply_filters
from graphrunner.spec_decode import PAD_TOKEN_ID, rejection_sample
from tests.sample.test_sampler import make_states, run_sampler

# Upper 1e-3 quantiles of the chi-square distribution by degrees of freedom, from the
# standard tables (e.g. NIST/SEMATECH e-Handbook, table 1.3.6.7.4); tests/
# test_sampler_distributions.py checks its chi2_sf against the same values.
CHI2_CRIT_1E3 = {4: 18.467, 5: 20.515}
N_ROWS = 20_000
V = 6


def run(logits, drafts, num_draft, probs, temperature, seeds, positions, all_greedy=False):
    """Calls rejection_sample with fresh outputs (filled with junk to check every element is written)."""
    r, k1, _ = logits.shape
    out = torch.full((r, k1), 12345, dtype=torch.int32)
    acc = torch.full((r,), 12345, dtype=torch.int32)
    rejection_sample(logits, drafts, num_draft, probs, temperature, seeds, positions, out, acc, all_greedy=all_greedy)
    return out, acc


def greedy_reference(logits: np.ndarray, drafts: np.ndarray, num_draft: np.ndarray) -> list[list[int]]:
    """Plain greedy decoding, one row and one position at a time."""
    rows = []
    for r in range(logits.shape[0]):
        emitted = []
        for j in range(num_draft[r]):
            best = int(np.argmax(logits[r, j]))
            if best != drafts[r, j]:
                break
            emitted.append(best)
        emitted.append(int(np.argmax(logits[r, len(emitted)])))
        rows.append(emitted)
    return rows


def check_layout(out: torch.Tensor, acc: torch.Tensor, expected: list[list[int]]) -> None:
    for r, tokens in enumerate(expected):
        assert acc[r].item() == len(tokens) - 1
        assert out[r, : len(tokens)].tolist() == tokens
        assert (out[r, len(tokens):] == PAD_TOKEN_ID).all()


@given(seed=st.integers(0, 2**32 - 1), r=st.integers(1, 5), k=st.integers(0, 4), vocab=st.integers(2, 9),
       all_greedy=st.booleans(), with_probs=st.booleans())
def test_greedy_rows_match_plain_greedy_decoding(seed, r, k, vocab, all_greedy, with_probs):
    g = np.random.default_rng(seed)
    logits = g.integers(-3, 3, size=(r, k + 1, vocab)).astype(np.float32)  # small ints: many ties
    drafts = g.integers(0, vocab, size=(r, k))
    agree = g.random((r, k)) < 0.7  # mostly the argmax, so long accepted runs happen
    drafts = np.where(agree, logits[:, :k].argmax(-1), drafts)
    drafts[g.random((r, k)) < 0.1] = -1  # out-of-range ids are never accepted
    num_draft = g.integers(0, k + 1, size=r)
    probs = torch.softmax(torch.randn(r, k, vocab), -1) if with_probs else None
    out, acc = run(torch.from_numpy(logits), torch.from_numpy(drafts), torch.from_numpy(num_draft).int(), probs,
                   torch.zeros(r), torch.arange(r, dtype=torch.int64), torch.full((r,), 5), all_greedy=all_greedy)
    check_layout(out, acc, greedy_reference(logits, drafts, num_draft))


@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 3))
def test_greedy_rows_unaffected_by_random_rows(seed, k):
    """In a mixed batch a greedy row still emits the greedy reference, ignoring draft_probs."""
    g = np.random.default_rng(seed)
    r, vocab = 6, 7
    logits = g.normal(size=(r, k + 1, vocab)).astype(np.float32)
    drafts = np.where(g.random((r, k)) < 0.6, logits[:, :k].argmax(-1), g.integers(0, vocab, size=(r, k)))
    num_draft = np.full(r, k)
    temperature = torch.tensor([0.0, 0.8, 0.0, 1.3, 0.0, 1.0])
    probs = torch.softmax(torch.from_numpy(g.normal(size=(r, k, vocab)).astype(np.float32)), -1)
    out, acc = run(torch.from_numpy(logits), torch.from_numpy(drafts), torch.from_numpy(num_draft).int(), probs,
                   temperature, torch.arange(r, dtype=torch.int64) * 977, torch.arange(r, dtype=torch.int64))
    ref = greedy_reference(logits, drafts, num_draft)
    greedy = [0, 2, 4]
    check_layout(out[greedy], acc[greedy], [ref[i] for i in greedy])
    assert ((acc >= 0) & (acc <= k)).all()
    assert ((out >= 0) & (out < vocab) | (out == PAD_TOKEN_ID)).all()


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 0.9)])
def test_no_drafts_gives_the_plain_samplers_token(top_k, top_p):
    """num_draft = 0: the one emitted token is the Sampler's, for the same logits, seed and position."""
    vocab, r, k = 50, 16, 3
    params = [SamplingParams(temperature=0.3 + 0.15 * i, seed=1000 + 7 * i, top_k=top_k, top_p=top_p) for i in range(r)]
    states = make_states(params, vocab)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(r, vocab, generator=g) * 2
    positions = torch.arange(r, dtype=torch.int64) * 3 + 11
    expected = run_sampler(states, x, list(range(r)), positions.tolist())
    rows = torch.arange(r)
    temperature, seeds = states.temperature[rows], states.seed[rows]
    # The caller's filter mask, computed as the sampler does (on x / T), applied to x.
    scaled = apply_filters(x / temperature[:, None], states.top_k[rows], states.top_p[rows], states.min_p[rows],
                           top_k > 0, top_p < 1.0, False)
    logits = torch.randn(r, k + 1, vocab, generator=g)
    logits[:, 0] = x.masked_fill(scaled == float("-inf"), float("-inf"))
    drafts = torch.randint(0, vocab, (r, k), generator=g)
    out, acc = run(logits, drafts, torch.zeros(r, dtype=torch.int32), None, temperature, seeds, positions)
    assert (acc == 0).all()
    assert out[:, 0].tolist() == expected.tolist()
    assert (out[:, 1:] == PAD_TOKEN_ID).all()


def chi_square(counts: np.ndarray, p: np.ndarray) -> float:
    """Pearson's statistic over the categories with p > 0 (those with p = 0 must be empty)."""
    n = counts.sum()
    assert counts[p == 0].sum() == 0, counts
    keep = p > 0
    expected = n * p[keep]
    return float(((counts[keep] - expected) ** 2 / expected).sum())


P0 = np.array([0.40, 0.25, 0.15, 0.10, 0.07, 0.03])  # target at verified position 0
P1 = np.array([0.05, 0.05, 0.10, 0.20, 0.25, 0.35])  # target at verified position 1
P2 = np.array([0.30, 0.00, 0.20, 0.10, 0.15, 0.25])  # bonus position; token 1 filtered out (-inf)
Q0 = np.array([0.02, 0.03, 0.05, 0.10, 0.30, 0.50])  # drafter: far from P0
Q1 = np.array([0.50, 0.30, 0.10, 0.05, 0.03, 0.02])  # drafter: far from P1
TEMP = 0.7


def distribution_case(drafter: str):
    """20,000 independent rows (seeds = arange) with k = 2 and the targets P0, P1, P2 at T = 0.7."""
    with np.errstate(divide="ignore"):
        target = np.log(np.stack([P0, P1, P2])) * TEMP  # softmax(target / T) = P
    logits = torch.from_numpy(target.astype(np.float32))[None].expand(N_ROWS, 3, V).contiguous()
    g = torch.Generator().manual_seed(1234)
    q = torch.from_numpy(np.stack([Q0, Q1]).astype(np.float32))  # [2, V]
    drafts = torch.stack([torch.multinomial(q[j], N_ROWS, replacement=True, generator=g) for j in range(2)], 1)
    probs = q[None].expand(N_ROWS, 2, V).contiguous() if drafter == "probs" else None
    if drafter == "fixed":  # a deterministic drafter (one-hot q): always proposes tokens 0, then 5
        drafts = torch.tensor([0, 5]).expand(N_ROWS, 2)
    temperature = torch.full((N_ROWS,), TEMP)
    seeds = torch.arange(N_ROWS, dtype=torch.int64)
    positions = torch.full((N_ROWS,), 40, dtype=torch.int64)
    out, acc = run(logits, drafts, torch.full((N_ROWS,), 2, dtype=torch.int32), probs, temperature, seeds, positions)
    return drafts.numpy(), out.numpy(), acc.numpy()


@pytest.mark.parametrize("drafter", ["probs", "onehot", "fixed"])
def test_emitted_tokens_have_the_target_distribution(drafter):
    drafts, out, acc = distribution_case(drafter)
    assert ((acc >= 0) & (acc <= 2)).all()
    first = np.bincount(out[:, 0], minlength=V)
    assert chi_square(first, P0) < CHI2_CRIT_1E3[V - 1]
    accepted = acc >= 1  # the first draft was accepted: the second token is a fresh draw from P1
    second = np.bincount(out[accepted, 1], minlength=V)
    assert chi_square(second, P1) < CHI2_CRIT_1E3[V - 1]
    both = acc == 2  # the bonus token, from P2 (token 1 filtered: never drawn)
    third = np.bincount(out[both, 2], minlength=V)
    assert both.sum() > 50 and chi_square(third, P2) < CHI2_CRIT_1E3[V - 2]
    assert (out[:, 0][acc >= 1] == drafts[acc >= 1, 0]).all()
    assert (out[np.arange(N_ROWS), acc] >= 0).all()
    assert (out[acc == 0, 1:] == PAD_TOKEN_ID).all() and (out[acc == 1, 2] == PAD_TOKEN_ID).all()

    # Acceptance rate of the first draft: sum_x min(p, q) for a drafter sampling from q
    # (for a one-hot q at a draft d drawn from Q0 it is E[p(d)]; fixed d = 0 gives p(0)).
    # Binomial standard error sqrt(a (1 - a) / n) <= 0.0036 at n = 20,000; tolerance 5 of them.
    expected = {"probs": np.minimum(P0, Q0).sum(), "onehot": (P0 * Q0).sum(), "fixed": P0[0]}[drafter]
    rate = accepted.mean()
    assert abs(rate - expected) < 5 * np.sqrt(expected * (1 - expected) / N_ROWS), (rate, expected)


def test_filtered_draft_is_always_rejected():
    """A draft at a -inf (filtered) target logit is never accepted, for any drafter."""
    r, k = 64, 2
    logits = torch.randn(r, k + 1, V)
    logits[:, 0, 3] = float("-inf")
    drafts = torch.full((r, k), 3)
    probs = torch.full((r, k, V), 1e-6)
    probs[:, :, 3] = 1.0
    for q in (None, probs):
        out, acc = run(logits, drafts, torch.full((r,), k, dtype=torch.int32), q, torch.full((r,), 1.5),
                       torch.arange(r, dtype=torch.int64), torch.zeros(r, dtype=torch.int64))
        assert (acc == 0).all() and (out[:, 0] != 3).all()


def random_batch(seed: int, r: int = 12, k: int = 3, vocab: int = 20):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(r, k + 1, vocab, generator=g)
    probs = torch.softmax(torch.randn(r, k, vocab, generator=g), -1)
    drafts = torch.multinomial(probs.view(-1, vocab), 1, generator=g).view(r, k)
    num_draft = torch.randint(0, k + 1, (r,), generator=g, dtype=torch.int32)
    temperature = torch.where(torch.rand(r, generator=g) < 0.3, 0.0, 0.5 + torch.rand(r, generator=g))
    seeds = torch.randint(0, 2**62, (r,), generator=g)
    positions = torch.randint(0, 1000, (r,), generator=g)
    return logits, drafts, num_draft, probs, temperature, seeds, positions


@given(seed=st.integers(0, 2**31), use_probs=st.booleans())
def test_deterministic_and_independent_of_other_rows(seed, use_probs):
    logits, drafts, num_draft, probs, temperature, seeds, positions = random_batch(seed)
    probs = probs if use_probs else None
    out, acc = run(logits, drafts, num_draft, probs, temperature, seeds, positions)
    out2, acc2 = run(logits, drafts, num_draft, probs, temperature, seeds, positions)
    assert torch.equal(out, out2) and torch.equal(acc, acc2)
    perm = torch.randperm(len(seeds), generator=torch.Generator().manual_seed(seed))[:5]  # a shuffled sub-batch

    def sub(t):
        return None if t is None else t[perm]

    out3, acc3 = run(logits[perm], drafts[perm], num_draft[perm], sub(probs), temperature[perm], seeds[perm],
                     positions[perm])
    assert torch.equal(out3, out[perm]) and torch.equal(acc3, acc[perm])
    assert ((acc >= 0) & (acc <= num_draft)).all()


def test_noise_follows_seed_and_position():
    """Changing a row's seed or its position changes its draws (the noise is keyed by both)."""
    r = 400
    logits = torch.zeros(r, 2, 50)  # uniform target: every draw depends only on the noise
    args = (torch.zeros(r, 1, dtype=torch.int64), torch.zeros(r, dtype=torch.int32), None, torch.ones(r))
    base, _ = run(logits, *args, torch.zeros(r, dtype=torch.int64), torch.arange(r, dtype=torch.int64))
    seeded, _ = run(logits, *args, torch.ones(r, dtype=torch.int64), torch.arange(r, dtype=torch.int64))
    moved, _ = run(logits, *args, torch.zeros(r, dtype=torch.int64), torch.arange(r, dtype=torch.int64) + 1)
    assert (base[:, 0] != seeded[:, 0]).float().mean() > 0.9
    assert torch.equal(moved[:-1, 0], base[1:, 0])  # same (seed, position) -> same token


def _good_args(r=3, k=2, vocab=5):
    return dict(
        target_logits=torch.zeros(r, k + 1, vocab), draft_token_ids=torch.zeros(r, k, dtype=torch.int64),
        num_draft=torch.zeros(r, dtype=torch.int32), draft_probs=torch.zeros(r, k, vocab),
        temperature=torch.zeros(r), seeds=torch.zeros(r, dtype=torch.int64),
        positions=torch.zeros(r, dtype=torch.int64),
        out_tokens=torch.zeros(r, k + 1, dtype=torch.int32), out_num_accepted=torch.zeros(r, dtype=torch.int32),
    )


@pytest.mark.parametrize("name,bad,message", [
    ("target_logits", torch.zeros(3, 3), r"target_logits has shape \[3, 3\]"),
    ("target_logits", torch.zeros(3, 3, 5, dtype=torch.float16), r"target_logits .* dtype float16"),
    ("draft_token_ids", torch.zeros(3, 3, dtype=torch.int64), r"draft_token_ids has shape \[3, 3\] .* \[3, 2\]"),
    ("draft_token_ids", torch.zeros(3, 2), r"draft_token_ids .* dtype float32, expected .* int32 or int64"),
    ("num_draft", torch.zeros(3, dtype=torch.int64), r"num_draft .* dtype int64, expected shape \[3\] .* int32"),
    ("draft_probs", torch.zeros(3, 2, 4), r"draft_probs has shape \[3, 2, 4\] .* \[3, 2, 5\]"),
    ("temperature", torch.zeros(4), r"temperature has shape \[4\] .* \[3\]"),
    ("seeds", torch.zeros(3, dtype=torch.int32), r"seeds .* int32, expected .* int64"),
    ("positions", torch.zeros(3, 1, dtype=torch.int64), r"positions has shape \[3, 1\]"),
    ("out_tokens", torch.zeros(3, 3, dtype=torch.int64), r"out_tokens .* int64, expected shape \[3, 3\] .* int32"),
    ("out_num_accepted", torch.zeros(2, dtype=torch.int32), r"out_num_accepted has shape \[2\] .* \[3\]"),
])
def test_bad_inputs_raise(name, bad, message):
    args = _good_args()
    args[name] = bad
    with pytest.raises(ValueError, match=message):
        rejection_sample(**args, all_greedy=False)


def test_good_args_pass():
    args = _good_args()
    rejection_sample(**args, all_greedy=True)
    assert args["out_tokens"][:, 1:].eq(PAD_TOKEN_ID).all() and args["out_num_accepted"].eq(0).all()


@given(seed=st.integers(0, 2**31), k=st.integers(1, 4))
def test_one_hot_drafts_emit_the_plain_samplers_tokens(seed, k):
    """Without a draft distribution every emitted token is the plain Sampler's token at its
    position (greedy and seeded random rows alike), whatever the drafts: speculation never
    changes a seeded request's output."""
    vocab, r = 30, 8
    g = torch.Generator().manual_seed(seed)
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.4 + 0.2 * i, seed=seed + i) for i in range(r)]
    states = make_states(params, vocab)
    logits = torch.randn(r, k + 1, vocab, generator=g) * 1.5
    positions = torch.randint(0, 500, (r,), generator=g)
    rows = list(range(r))
    plain = torch.stack([run_sampler(states, logits[:, j], rows, (positions + j).tolist()) for j in range(k + 1)], 1)
    # Drafts: the plain token where a coin says so (so runs get accepted), else a random id.
    guess = torch.randint(0, vocab, (r, k), generator=g)
    drafts = torch.where(torch.rand(r, k, generator=g) < 0.7, plain[:, :k].long(), guess)
    num_draft = torch.randint(0, k + 1, (r,), generator=g, dtype=torch.int32)
    t = torch.arange(r)
    out, acc = run(logits, drafts, num_draft, None, states.temperature[t], states.seed[t], positions)
    for i in range(r):
        a = int(acc[i])
        assert a <= int(num_draft[i])
        assert out[i, : a + 1].tolist() == plain[i, : a + 1].tolist()
        assert out[i, :a].tolist() == drafts[i, :a].tolist()  # accepted drafts are the drafts
        if a < int(num_draft[i]):
            assert int(drafts[i, a]) != int(plain[i, a])  # stopped at the first mismatch
