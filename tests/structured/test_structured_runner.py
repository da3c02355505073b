"""Structured outputs in the runner: a step's grammar masks decide what its constrained rows can sample.

The runner gets the masks with `sample_tokens(grammar_output=...)` (vLLM's shape: request ids and
one packed int32 bitmask row each); a step with structured-output rows runs only then. Checked
against the rule itself: a constrained row samples a token its mask allows (greedy: the best
allowed token under the unconstrained logits' order, found independently from a run that
records the logits), unconstrained rows in the same batch are untouched, in eager mode and in
(CPU-emulated) FULL graphs where the all-features variant applies the mask. With speculative
decoding each verified slot has its own mask (tests/structured/test_structured_spec_runner.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.config import CompilationConfig
from graphrunner.protocol import SamplingParams
from graphrunner.structured_outputs import GrammarOutput, StructuredOutputsParams, bitmask_words
from tests.runner_driver import Driver, make_runner

GRAPHS = CompilationConfig(enforce_eager=False, compile_backend="eager", cudagraph_capture_sizes=[1, 2, 4])
SPLIT = dataclasses.replace(GRAPHS, structured_output_graphs=True)  # constrained decodes: forward, then sampling
CHOICE = StructuredOutputsParams(choice=["yes", "no"])  # the runner never reads the grammar itself


def _mask(vocab: int, allowed: list[int]) -> np.ndarray:
    bits = np.zeros(bitmask_words(vocab) * 32, dtype=bool)
    bits[allowed] = True
    return np.packbits(bits, bitorder="little").view("<u4").view(np.int32)[None, :]


class _Runners(dict):
    """The module's runners by kind, each built (and captured) once, when first asked for:
    every test leaves them without live requests."""

    def __missing__(self, kind: str):
        r = self[kind] = make_runner(compilation={"eager": None, "graphs": GRAPHS, "split": SPLIT}[kind])
        if kind != "eager":
            r.capture_model(progress=False)
        return r


@pytest.fixture(scope="module")
def runners() -> _Runners:
    return _Runners()


@pytest.fixture(scope="module", params=["eager", "graphs", "split"])
def runner(request, runners):
    return runners[request.param]


def _run(runner, allowed_per_step: list[list[int]], params: SamplingParams) -> tuple[list[int], list[int]]:
    """Request "c" (constrained by allowed_per_step) beside "u" (unconstrained, greedy)."""
    d = Driver(runner)
    d.add("c", [3, 1, 4, 1, 5], SamplingParams(**{**params.__dict__, "structured_outputs": CHOICE}))
    d.add("u", [2, 7, 1, 8], SamplingParams(temperature=0.0))
    V = runner.vocab_size
    for allowed in allowed_per_step:
        d.step(grammar=lambda so, allowed=allowed: GrammarOutput(["c"], _mask(V, allowed)))
    toks = d.reqs["c"].outputs, d.reqs["u"].outputs
    for rid in ("c", "u"):
        d.finish(rid)
    return toks


def _unconstrained(runner, steps: int) -> list[int]:
    d = Driver(runner)
    d.add("u", [2, 7, 1, 8], SamplingParams(temperature=0.0))
    for _ in range(steps):
        d.step()
    out = d.reqs["u"].outputs
    d.finish("u")
    return out


@given(allowed=st.lists(st.lists(st.integers(0, 2047), min_size=1, max_size=6, unique=True), min_size=1, max_size=4),
       temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 2**31))
def test_constrained_rows_sample_only_allowed_tokens(runner, allowed, temperature, seed) -> None:
    constrained, free = _run(runner, allowed, SamplingParams(temperature=temperature, seed=seed, max_tokens=8))
    assert all(tok in ok for tok, ok in zip(constrained, allowed, strict=True))
    assert free == _unconstrained(runner, len(allowed))  # the other row of the batch is untouched


def test_a_single_allowed_token_is_forced(runner) -> None:
    forced = [[11], [1999], [0], [7]]
    constrained, _ = _run(runner, forced, SamplingParams(temperature=0.8, seed=3))
    assert constrained == [11, 1999, 0, 7]


def test_missing_grammar_output_leaves_the_row_unconstrained(runners) -> None:
    runner = runners["eager"]
    d = Driver(runner)
    d.add("c", [2, 7, 1, 8], SamplingParams(temperature=0.0, structured_outputs=CHOICE))
    for _ in range(3):
        d.step()
    constrained = d.reqs["c"].outputs
    d.finish("c")
    assert constrained == _unconstrained(runner, 3)


def test_speculative_decodes_take_a_mask_per_draft_slot() -> None:
    """With speculation a decode takes 1 + its draft slots mask rows (placeholders count; per-slot
    masks: tests/structured/test_structured_spec_runner.py): a token forced in every slot is all it emits,
    however many drafts it accepts; a wrong row count is refused, naming both counts."""
    runner = make_runner(speculative={"method": "ngram", "num_speculative_tokens": 2})
    d = Driver(runner)
    d.add("c", [2, 7, 1, 8], SamplingParams(temperature=0.0, structured_outputs=CHOICE))
    V = runner.vocab_size

    def forced(so):
        rows = so.num_scheduled_tokens["c"] if so.scheduled_cached_reqs.req_ids else 1  # a decode: 1 + 2 slots
        return GrammarOutput(["c"], np.repeat(_mask(V, [11]), rows, axis=0))

    for _ in range(4):
        d.step(grammar=forced)
    assert d.reqs["c"].outputs == [11] * len(d.reqs["c"].outputs) and len(d.reqs["c"].outputs) > 4
    with pytest.raises(ValueError, match="grammar_bitmask has 1 rows; expected 3"):
        d.step(grammar=lambda so: GrammarOutput(["c"], _mask(V, [11])))


def _split_replays(runner, monkeypatch) -> list[str]:
    """Record which split graphs replay (their keys), by wrapping each graph's replay (until the test ends)."""
    seen: list[str] = []
    for graph in runner.graphs.split_graphs.values():
        def replay(graph=graph, inner=graph.replay):
            seen.append(graph.key)
            inner()
        monkeypatch.setattr(graph, "replay", replay)
    return seen


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_split_steps_give_the_whole_steps_tokens(runners, monkeypatch, temperature) -> None:
    """With structured_output_graphs a constrained decode replays its forward graph from
    execute_model and its sampling graph (masks applied in place) from sample_tokens; the
    tokens equal those of the whole-step graphs (the all-features variant), greedy and seeded."""
    whole, split = runners["graphs"], runners["split"]
    seen = _split_replays(split, monkeypatch)
    rng = np.random.default_rng(1)
    allowed = [rng.choice(2048, size=int(rng.integers(1, 300)), replace=False).tolist() for _ in range(6)]
    params = SamplingParams(temperature=temperature, seed=11, max_tokens=8)
    assert _run(split, allowed, params) == _run(whole, allowed, params)
    assert any("forward" in k for k in seen) and any("after masks" in k for k in seen), seen
    assert not any("after masks" in k for k in _split_replays(whole, monkeypatch))  # (the whole runner has none)


@given(settings_of=st.lists(st.sampled_from(["grammar", "bias", "random", "allowed", "plain"]), min_size=1,
                           max_size=8), pick=st.lists(st.integers(0, 7), min_size=1, max_size=8))
def test_the_step_gate_reuses_the_batch_features(settings_of, pick) -> None:
    """`masked_features(rows, batch features)` (the runner's per-step check, no recomputed features):
    None without a grammar row, else exactly `features_after_masks(rows)`."""
    from graphrunner.state.sampling import SamplingStates

    states = SamplingStates(9, torch.device("cpu"), vocab_size=64)
    for row, kind in enumerate(settings_of):
        params = {"grammar": dict(structured_outputs=CHOICE), "bias": dict(logit_bias={3: 1.0}),
                  "random": dict(temperature=0.7, top_k=5), "allowed": dict(allowed_token_ids=[1, 2]),
                  "plain": {}}[kind]
        states.add_request(row, f"r{row}", SamplingParams(**params), 64)
    rows = np.array([p % len(settings_of) for p in pick], dtype=np.int32)
    want = states.features_after_masks(rows) if states.grammar_np[rows].any() else None
    assert states.masked_features(rows, states.features(rows)) == want


def test_grammar_output_shape_is_checked() -> None:
    with pytest.raises(ValueError, match="one row per request id"):
        GrammarOutput(["a", "b"], np.zeros((1, 4), dtype=np.int32))
    with pytest.raises(ValueError, match="int32"):
        GrammarOutput(["a"], np.zeros((1, 4), dtype=np.int64))
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a+", choice=["a"])
    assert torch.tensor(_mask(64, [0, 33])).tolist() == [[1, 2]]


@pytest.mark.gpu
def test_grammar_masks_in_full_cuda_graphs() -> None:
    """On a GPU the all-features FULL graph applies the uploaded masks (real graph replays)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    runner = make_runner(device="cuda", compilation=CompilationConfig(cudagraph_capture_sizes=[1, 2, 4]))
    runner.capture_model(progress=False)
    forced = [[11], [1999], [0], [7], [42]]
    constrained, free = _run(runner, forced, SamplingParams(temperature=0.8, seed=3))
    assert constrained == [11, 1999, 0, 7, 42]
    assert runner.last_descriptor is not None and runner.last_descriptor.is_full  # decode steps replayed graphs
    assert free == _unconstrained(runner, len(forced))


@pytest.mark.gpu
def test_split_steps_in_cuda_graphs_match_whole_steps(monkeypatch) -> None:
    """Real CUDA graphs: the split forward / sampling graphs give the whole-step graphs' tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    runners = [make_runner(device="cuda", compilation=CompilationConfig(cudagraph_capture_sizes=[1, 2, 4],
                                                                       structured_output_graphs=split))
               for split in (False, True)]
    for r in runners:
        r.capture_model(progress=False)
    seen = _split_replays(runners[1], monkeypatch)
    rng = np.random.default_rng(2)
    allowed = [rng.choice(2048, size=int(rng.integers(1, 500)), replace=False).tolist() for _ in range(6)]
    for temperature in (0.0, 0.8):
        params = SamplingParams(temperature=temperature, seed=5, max_tokens=8)
        assert _run(runners[1], allowed, params) == _run(runners[0], allowed, params)
    assert any("after masks" in k for k in seen)
