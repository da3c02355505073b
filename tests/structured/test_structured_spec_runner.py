"""Structured outputs with speculative decoding in the runner: one grammar mask per sampled slot.

A verifying entry samples 1 + d positions (its d drafts and one more); position j must follow the
grammar state after drafts 0..j-1, so `SamplingStates.grammar_mask` is `[rows, 1 + k, W]` and the
sampler reads `grammar_mask[row, slot]`. Checked here without a grammar library:

- `write_grammar` places vLLM's layout (1 + drafts consecutive bitmask rows per listed request, in
  the order of the ids) into the slots, leaves every other slot allowing every token, and refuses a
  bad layout (naming the expected and given row counts) without writing anything;
- the sampler applies slot j's mask to slot j's logits, against a numpy reference;
- a whole step with real drafts: with one forced token per slot the entry emits exactly the forced
  tokens up to the first draft that differs, greedy and seeded-random, eager and CPU-emulated FULL
  graphs (real CUDA graphs under the gpu marker), an unconstrained request beside it untouched.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.config import CompilationConfig
from graphrunner.protocol import NewRequestData, SamplingParams, SchedulerOutput
from graphrunner.sample.sampler import Sampler
from graphrunner.state.features import SamplingFeatures
from graphrunner.state.sampling import SamplingStates
from graphrunner.structured_outputs import GrammarOutput, StructuredOutputsParams, bitmask_words
from tests.runner_driver import make_runner

VOCAB = 80  # three int32 words per mask row, the last one partly padding
ROWS = 8  # state rows of the sampler-level tests (the last one is the scratch row)
CHOICE = StructuredOutputsParams(choice=["yes", "no"])  # the runner never reads the grammar itself
GRAPHS = CompilationConfig(enforce_eager=False, compile_backend="eager", cudagraph_mode="FULL",
                           cudagraph_capture_sizes=[1, 2, 4, 8, 16])


def _pack(bits: np.ndarray) -> np.ndarray:
    """[..., V] bool -> [..., ceil(V/32)] int32 (bit v % 32 of word v // 32)."""
    words = bitmask_words(bits.shape[-1])
    padded = np.zeros((*bits.shape[:-1], words * 32), dtype=bool)
    padded[..., : bits.shape[-1]] = bits
    return np.packbits(padded, axis=-1, bitorder="little").view("<u4").view(np.int32)


def _unpack(words: np.ndarray, vocab: int) -> np.ndarray:
    """[..., W] int32 -> [..., V] bool."""
    return np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=-1, bitorder="little")[..., :vocab] > 0


def _states(slots: int, grammar_rows: list[int]) -> SamplingStates:
    states = SamplingStates(ROWS, torch.device("cpu"), vocab_size=VOCAB, grammar_slots=slots)
    for row in grammar_rows:
        states.add_request(row, f"r{row}", SamplingParams(temperature=0.0, structured_outputs=CHOICE), VOCAB)
    states.apply_staged_writes()
    return states


def _output(ids: list[str], mask: np.ndarray, pinned: bool) -> GrammarOutput:
    """The step's GrammarOutput; `pinned`: its bitmask is a torch tensor's memory, as the engine fills
    it (`GrammarOutput.pinned`, uploaded as is), else a plain array (copied into a host block)."""
    if not pinned:
        return GrammarOutput(ids, mask)
    host = torch.from_numpy(mask.copy())
    return GrammarOutput(ids, host.numpy(), pinned=host)


@st.composite
def _layouts(draw):
    """A step's entries (state row, grammar or not, drafts, listed or not), listing order, masks."""
    k = draw(st.integers(1, 4))
    n = draw(st.integers(1, ROWS - 1))
    rows = draw(st.permutations(range(ROWS - 1)))[:n]
    grammar = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    drafts = draw(st.lists(st.integers(0, k), min_size=n, max_size=n))
    listed = [i for i in range(n) if draw(st.booleans())]
    order = draw(st.permutations(listed))
    stranger = draw(st.booleans())  # an id not in the step: one row, unused
    num_rows = sum(1 + drafts[i] for i in order) + stranger
    seed = draw(st.integers(0, 2**31))
    return k, rows, grammar, drafts, order, stranger, num_rows, seed


@given(layout=_layouts())
def test_write_grammar_fills_each_slot_and_the_sampler_applies_it(layout) -> None:
    k, rows, grammar, drafts, order, stranger, num_rows, seed = layout
    S, n = 1 + k, len(rows)
    rng = np.random.default_rng(seed)
    states = _states(S, [r for r, g in zip(rows, grammar, strict=True) if g])
    assert states.grammar_mask is not None and tuple(states.grammar_mask.shape) == (ROWS, S, bitmask_words(VOCAB))
    states.grammar_mask.fill_(7)  # stale content: every grammar row is rewritten whole
    req_ids = [f"r{r}" for r in rows]
    ids = [req_ids[i] for i in order] + (["stranger"] if stranger else [])
    bits = rng.random((num_rows, VOCAB)) < 0.3
    bits[:, 0] = True  # never an empty mask (an all -inf row has no reference argmax)
    states.write_grammar(np.array(rows), req_ids, _output(ids, _pack(bits), seed % 2 == 0), np.array(drafts))

    # The layout: request i's rows in order, its slots past 1 + drafts[i] (and unlisted rows) all allowed.
    expected = np.full((n, S, VOCAB), True)
    start = 0
    for i in order:
        expected[i, : 1 + drafts[i]] = bits[start : start + 1 + drafts[i]]
        start += 1 + drafts[i]
    got = _unpack(states.grammar_mask.numpy(), VOCAB)  # [rows, S, V]
    for i, (row, g) in enumerate(zip(rows, grammar, strict=True)):
        if g:
            assert (got[row] == expected[i]).all()
        else:
            assert (states.grammar_mask[row] == 7).all()  # not a grammar row: not written

    # The sampler: slot j of entry i reads grammar_mask[rows[i], j] (numpy reference), greedy reads slot 0.
    sampler = Sampler(states)
    logits = torch.from_numpy(rng.standard_normal((n * S, VOCAB)).astype(np.float32))
    idx = torch.tensor(rows, dtype=torch.int32).repeat_interleave(S)
    slots = torch.arange(S).repeat(n)
    features = SamplingFeatures(any_logit_bias=True)
    target = sampler.target_logits(logits, idx, torch.zeros(n * S, dtype=torch.int64), features, slots)
    keep = np.where(np.array(grammar)[:, None, None], expected, True).reshape(n * S, VOCAB)
    reference = np.where(keep, logits.numpy(), -np.inf)
    assert np.array_equal(target.numpy(), reference)
    out = torch.zeros(n, dtype=torch.int32)
    sampler(logits.view(n, S, VOCAB)[:, 0], idx.view(n, S)[:, 0], torch.zeros(n, dtype=torch.int64), features, out)
    assert out.tolist() == reference.reshape(n, S, VOCAB)[:, 0].argmax(-1).tolist()


@given(layout=_layouts())
def test_write_grammar_without_speculation_places_each_listed_row(layout) -> None:
    """num_drafts=None (one mask row per listed request, the runner's non-speculative path): each
    grammar row gets its own request's row of the bitmask, whatever the listing order."""
    _, rows, grammar, _, order, stranger, _, seed = layout
    states = _states(1, [r for r, g in zip(rows, grammar, strict=True) if g])
    assert states.grammar_mask is not None
    req_ids = [f"r{r}" for r in rows]
    ids = [req_ids[i] for i in order] + (["stranger"] if stranger else [])
    bits = np.random.default_rng(seed).random((len(ids), VOCAB)) < 0.5
    states.write_grammar(np.array(rows), req_ids, _output(ids, _pack(bits), seed % 2 == 0))
    got = _unpack(states.grammar_mask.numpy(), VOCAB)  # [rows, 1, V]
    position = {i: j for j, i in enumerate(order)}
    for i, (row, g) in enumerate(zip(rows, grammar, strict=True)):
        if g:
            want = bits[position[i]] if i in position else np.ones(VOCAB, dtype=bool)
            assert (got[row, 0] == want).all(), f"entry {i} (row {row})"


@pytest.mark.parametrize("pinned", [False, True], ids=["array", "pinned"])
def test_a_narrower_bitmask_forbids_the_padding_ids(pinned) -> None:
    """A grammar over fewer ids than the model's vocabulary (64 of 80: two words of three): the
    third word of each written slot is 0 (padding ids forbidden), the other slots allow everything."""
    states = _states(2, [1, 3])
    assert states.grammar_mask is not None
    mask = np.array([[5, -1], [6, 7], [8, 9]], dtype=np.int32)  # r1: 2 rows (1 draft), r3: 1 row
    states.write_grammar(np.array([3, 1]), ["r3", "r1"], _output(["r1", "r3"], mask, pinned), np.array([0, 1]))
    got = states.grammar_mask.numpy()
    assert got[1].tolist() == [[5, -1, 0], [6, 7, 0]]
    assert got[3].tolist() == [[8, 9, 0], [-1, -1, -1]]


def test_pinned_must_be_the_bitmask_memory() -> None:
    host = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="pinned must be the tensor whose memory grammar_bitmask is"):
        GrammarOutput(["a", "b"], host.numpy().copy(), pinned=host)


@pytest.mark.parametrize("ids, rows, message", [
    (["r1", "r2"], 3, r"grammar_bitmask has 3 rows; expected 4: 1 \+ the scheduled draft slots of each of its 2"),
    (["r1", "r2"], 5, "grammar_bitmask has 5 rows; expected 4"),
    (["r1"], 2, "grammar_bitmask has 2 rows; expected 3"),
    (["r2", "r2"], 2, "lists request 'r2' twice"),
])
def test_write_grammar_refuses_a_bad_layout_and_writes_nothing(ids, rows, message) -> None:
    states = _states(3, [1, 2])
    assert states.grammar_mask is not None
    states.grammar_mask.fill_(7)
    mask = np.zeros((rows, bitmask_words(VOCAB)), dtype=np.int32)
    with pytest.raises(ValueError, match=message):  # r1 verifies 2 drafts (3 rows), r2 none (1 row)
        states.write_grammar(np.array([1, 2]), ["r1", "r2"], GrammarOutput(ids, mask), np.array([2, 0]))
    assert (states.grammar_mask == 7).all()
    with pytest.raises(ValueError, match="has 4 words per row; the vocabulary needs 3"):
        states.write_grammar(np.array([1]), ["r1"], GrammarOutput(["r1"], np.zeros((1, 4), dtype=np.int32)))
    with pytest.raises(ValueError, match="at least one row per request id"):
        GrammarOutput(["a", "b"], np.zeros((1, 3), dtype=np.int32))


# ------------------------------------------------------------------------------ whole steps


class _Steps:
    """Hand-made SchedulerOutputs: a prefill, then decodes with the drafts the test names."""

    def __init__(self, runner) -> None:
        self.runner, self.computed, self.known, self.outputs = runner, {}, {}, {}
        self.blocks = 0

    def admit(self, rid: str, prompt: list[int], params: SamplingParams) -> NewRequestData:
        n = -(-self.runner.max_model_len // self.runner.limits.block_size)
        blocks, self.blocks = list(range(self.blocks, self.blocks + n)), self.blocks + n
        self.computed[rid], self.known[rid], self.outputs[rid] = 0, len(prompt), []
        return NewRequestData(rid, prompt, params, blocks, 0)

    def step(self, new: list[NewRequestData], drafts: dict[str, list[int]], grammar=None) -> dict[str, list[int]]:
        """Every live request: a new one's prompt; a decode 1 + its drafts (placeholders: k of them)."""
        so = SchedulerOutput(scheduled_new_reqs=new, scheduled_spec_decode_tokens=dict(drafts))
        fresh = {n.req_id for n in new}
        q = self.runner.uniform_decode_query_len
        for rid in self.computed:
            if rid not in fresh:
                so.scheduled_cached_reqs.req_ids.append(rid)
                so.scheduled_cached_reqs.new_block_ids.append(None)
                so.scheduled_cached_reqs.num_computed_tokens.append(self.computed[rid])
            # Whole prefills only: every request admitted earlier decodes.
            decode = 1 + len(drafts[rid]) if rid in drafts else q
            so.num_scheduled_tokens[rid] = self.known[rid] if rid in fresh else decode
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        self.runner.execute_model(so)
        out = self.runner.sample_tokens(grammar_output=grammar(so) if grammar is not None else None)
        emitted = dict(zip(out.req_ids, out.sampled_token_ids, strict=True))
        for rid, toks in emitted.items():
            self.computed[rid] += len(toks) if rid not in fresh else so.num_scheduled_tokens[rid]
            self.known[rid] += len(toks)
            self.outputs[rid] += toks
        return emitted

    def finish(self) -> None:
        self.runner.execute_model(SchedulerOutput(finished_req_ids=set(self.computed)))
        self.runner.sample_tokens()


def _forced(tokens: list[int], vocab: int) -> np.ndarray:
    """One mask row per token, allowing only that token."""
    bits = np.zeros((len(tokens), vocab), dtype=bool)
    bits[np.arange(len(tokens)), tokens] = True
    return _pack(bits)


def _build(mode: str, device: str = "cpu"):
    runner = make_runner(speculative={"method": "ngram", "num_speculative_tokens": 3}, device=device,
                         compilation=GRAPHS if mode == "graphs" else None)
    if mode == "graphs":
        runner.capture_model(progress=False)
    return runner


@pytest.fixture(scope="module", params=["eager", "graphs"])
def spec_runner(request):
    return request.param, _build(request.param)


def _forced_run(runner, forced: list[list[int]], mismatch: list[int], temperature: float):
    """Request "c" verifies drafts equal to each step's forced tokens but for one at `mismatch`
    (3 = none); "u" (greedy, unconstrained, placeholder drafts) runs beside it."""
    d = _Steps(runner)
    V = runner.vocab_size
    c = d.admit("c", [3, 1, 4, 1, 5], SamplingParams(temperature=temperature, seed=11, structured_outputs=CHOICE))
    u = d.admit("u", [2, 7, 1, 8], SamplingParams(temperature=0.0))
    d.step([c, u], {}, lambda so: GrammarOutput(["c"], _forced([forced[0][0]], V)))
    expected = [forced[0][0]]
    for toks, bad in zip(forced[1:], mismatch, strict=False):
        drafts = [t if j != bad else (t + 1) % V for j, t in enumerate(toks[:3])]
        got = d.step([], {"c": drafts}, lambda so, toks=toks: GrammarOutput(["c"], _forced(toks, V)))
        assert got["c"] == toks[: min(bad, 3) + 1]  # the forced tokens up to the first wrong draft
        expected += got["c"]
    outputs = d.outputs
    d.finish()
    return expected, outputs["c"], outputs["u"]


def _unconstrained(runner, steps: int) -> list[int]:
    d = _Steps(runner)
    u = d.admit("u", [2, 7, 1, 8], SamplingParams(temperature=0.0))
    d.step([u], {})
    for _ in range(steps):
        d.step([], {})
    out = d.outputs["u"]
    d.finish()
    return out


@given(forced=st.lists(st.lists(st.integers(0, 2047), min_size=4, max_size=4), min_size=2, max_size=4),
       mismatch=st.lists(st.integers(0, 3), min_size=3, max_size=3), temperature=st.sampled_from([0.0, 1.0]))
def test_each_verified_slot_samples_under_its_own_mask(spec_runner, forced, mismatch, temperature) -> None:
    mode, runner = spec_runner
    expected, constrained, free = _forced_run(runner, forced, mismatch, temperature)
    assert constrained == expected
    assert runner.last_descriptor is not None and runner.last_descriptor.is_full == (mode == "graphs")
    # "u" verified its own (placeholder) drafts beside "c": its tokens are those of "u" alone.
    assert free == _unconstrained(runner, len(forced) - 1)


def test_a_bad_grammar_output_keeps_the_step_deferred() -> None:
    runner = _build("eager")
    d = _Steps(runner)
    c = d.admit("c", [3, 1, 4], SamplingParams(temperature=0.0, structured_outputs=CHOICE))
    d.step([c], {}, lambda so: GrammarOutput(["c"], _forced([5], runner.vocab_size)))
    so = SchedulerOutput(num_scheduled_tokens={"c": 3}, total_num_scheduled_tokens=3,
                         scheduled_spec_decode_tokens={"c": [6, 9]})
    so.scheduled_cached_reqs.req_ids.append("c")
    so.scheduled_cached_reqs.new_block_ids.append(None)
    so.scheduled_cached_reqs.num_computed_tokens.append(3)
    runner.execute_model(so)
    with pytest.raises(ValueError, match="grammar_bitmask has 1 rows; expected 3"):
        runner.sample_tokens(grammar_output=GrammarOutput(["c"], _forced([6], runner.vocab_size)))
    out = runner.sample_tokens(grammar_output=GrammarOutput(["c"], _forced([6, 9, 4], runner.vocab_size)))
    assert out.sampled_token_ids == [[6, 9, 4]]  # the retry runs the step: both drafts accepted


@pytest.mark.gpu
def test_per_slot_masks_in_full_cuda_graphs() -> None:
    """Real CUDA graphs replay the verifying step with the uploaded per-slot masks."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    runner = _build("graphs", "cuda")
    forced = [[11, 12, 13, 14], [1999, 0, 7, 42], [5, 6, 7, 8], [100, 200, 300, 400]]
    for temperature in (0.0, 1.0):
        expected, constrained, _ = _forced_run(runner, forced, [3, 1, 0], temperature)
        assert constrained == expected
        assert runner.last_descriptor is not None and runner.last_descriptor.is_full
