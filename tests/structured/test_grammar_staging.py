"""The grammar masks' upload (graphrunner.state.grammar_staging, state/grammar_masks.py): one copy, at most one
fill and one scatter, and the same `grammar_mask` as the per-row rule.

- Over several steps on one `SamplingStates` (its staging slots reused, grown), every layout writes what
  the per-row reference says (each grammar entry: its listed bitmask rows in its first slots, zero
  words past a narrower bitmask, every other slot of it all ones; entries without a grammar, padded
  entries on the scratch row included, untouched), whether the engine filled the staging's block
  (`grammar_block`, uploaded without a host copy), a foreign torch tensor or a plain array.
- Which path a layout takes: consecutive destinations in the rows' own order are copied in place
  (no index, no fill, no scatter), anything else makes one upload; a step's block is a reused slot.
- Blocks: valid until the block after next; a grown staging still uploads a block of the old slots.
- GPU (marker gpu): the same layouts on CUDA, through the driver and through torch, with the device
  kept busy so that the host runs ahead of the copies that read the reused slots.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.protocol import SamplingParams
from graphrunner.state.grammar_staging import GrammarStaging
from graphrunner.state.sampling import SamplingStates
from graphrunner.structured_outputs import GrammarOutput, StructuredOutputsParams, bitmask_words

VOCAB = 100  # four int32 words per mask row, the last one partly padding
WORDS = bitmask_words(VOCAB)
ROWS = 10  # state rows; the last one is the scratch row that padded entries point at
SCRATCH = ROWS - 1
CHOICE = StructuredOutputsParams(choice=["yes"])  # the runner never reads the grammar itself
STALE = 7  # what every mask word holds before a step


def _states(slots: int, grammar_rows: list[int], device: str = "cpu") -> SamplingStates:
    states = SamplingStates(ROWS, torch.device(device), vocab_size=VOCAB, grammar_slots=slots)
    for row in grammar_rows:
        states.add_request(row, f"r{row}", SamplingParams(temperature=0.0, structured_outputs=CHOICE), VOCAB)
    states.apply_staged_writes()
    return states


@st.composite
def _step(draw, slots: int):
    """One step: entries (state row, drafts), listing order, strangers, padded entries, bitmask width."""
    n = draw(st.integers(1, SCRATCH))
    rows = draw(st.sampled_from(["consecutive", "permuted"]))
    state_rows = list(range(n)) if rows == "consecutive" else draw(st.permutations(range(SCRATCH)))[:n]
    drafts = draw(st.lists(st.integers(0, slots - 1), min_size=n, max_size=n))
    if draw(st.booleans()):  # the engine's step: every entry listed, in batch order
        return dict(rows=state_rows, drafts=drafts, order=list(range(n)), strangers=0, pads=draw(st.integers(0, 1)),
                    narrow=False, source="block", seed=draw(st.integers(0, 2**31)))
    listed = [i for i in range(n) if draw(st.booleans())] if draw(st.booleans()) else list(range(n))
    order = draw(st.permutations(listed)) if draw(st.booleans()) else listed
    return dict(rows=state_rows, drafts=drafts, order=order, strangers=draw(st.sampled_from([0, 0, 1, 2])),
                pads=draw(st.integers(0, 2)), narrow=draw(st.booleans()), source=draw(st.sampled_from(
                    ["block", "tensor", "array"])), seed=draw(st.integers(0, 2**31)))


def _write(states: SamplingStates, step: dict) -> np.ndarray:
    """Run the step's write_grammar; returns the bitmask it uploaded ([M, w] int32)."""
    rng = np.random.default_rng(step["seed"])
    rows, drafts = step["rows"], step["drafts"]
    req_ids = [f"r{r}" for r in rows] + [f"pad{i}" for i in range(step["pads"])]  # padded: the scratch row
    ids = [req_ids[i] for i in step["order"]] + [f"stranger{i}" for i in range(step["strangers"])]
    num = sum(1 + drafts[i] for i in step["order"]) + step["strangers"]
    width = WORDS - 1 if step["narrow"] else WORDS
    mask = rng.integers(-(2**31), 2**31, size=(num, width), dtype=np.int64).astype(np.int32)
    if step["source"] == "block" and not step["narrow"]:
        block = states.grammar_block(num, WORDS)
        block.numpy()[:] = mask
        grammar = GrammarOutput(ids, block.numpy(), pinned=block)
    elif step["source"] == "tensor":
        host = torch.from_numpy(mask.copy())
        grammar = GrammarOutput(ids, host.numpy(), pinned=host)
    else:
        grammar = GrammarOutput(ids, mask.copy())
    all_rows = np.array(rows + [SCRATCH] * step["pads"])
    num_drafts = np.array(drafts + [0] * step["pads"])
    states.write_grammar(all_rows, req_ids, grammar, num_drafts if states.grammar_slots > 1 else None)
    return mask


def _reference(before: np.ndarray, step: dict, mask: np.ndarray, grammar_rows: set[int]) -> np.ndarray:
    """The per-row rule, one entry at a time: grammar_mask [rows, S, W] after the step."""
    want = before.copy()
    start, first = 0, {}
    for i in step["order"]:
        first[i] = start
        start += 1 + step["drafts"][i]
    for i, row in enumerate(step["rows"]):
        if row not in grammar_rows:
            continue
        want[row] = -1
        if i in first:
            for j in range(1 + step["drafts"][i]):
                want[row, j] = 0
                want[row, j, : mask.shape[1]] = mask[first[i] + j]
    return want


@settings(max_examples=40, deadline=None)
@given(slots=st.integers(1, 3), data=st.data(),
       grammar=st.one_of(st.just([True] * SCRATCH), st.lists(st.booleans(), min_size=SCRATCH, max_size=SCRATCH)))
def test_each_step_writes_the_per_row_result(slots, grammar, data) -> None:
    grammar_rows = {r for r, g in enumerate(grammar) if g}
    states = _states(slots, sorted(grammar_rows))
    assert states.grammar_mask is not None
    states.grammar_mask.fill_(STALE)
    for _ in range(data.draw(st.integers(1, 4))):  # the staging's slots are reused (and grown) across steps
        step = data.draw(_step(slots))
        before = states.grammar_mask.numpy().copy()
        mask = _write(states, step)
        assert np.array_equal(states.grammar_mask.numpy(), _reference(before, step, mask, grammar_rows)), step


class _Calls:
    """Counts the staging's uploads (copy + scatter) and in-place copies."""

    def __init__(self, staging: GrammarStaging) -> None:
        self.upload = self.send_rows = 0
        for name in ("upload", "send_rows"):
            inner = getattr(staging, name)

            def wrapped(*args, name=name, inner=inner):
                setattr(self, name, getattr(self, name) + 1)
                return inner(*args)

            setattr(staging, name, wrapped)


def test_consecutive_rows_are_copied_in_place_and_anything_else_uploads_once() -> None:
    states = _states(1, list(range(SCRATCH)))
    assert states.grammar_staging is not None
    calls = _Calls(states.grammar_staging)
    base = dict(drafts=[0] * 4, strangers=0, pads=0, narrow=False, source="block", seed=1)
    _write(states, {**base, "rows": [2, 3, 4, 5], "order": [0, 1, 2, 3]})  # the engine's usual step
    assert (calls.send_rows, calls.upload) == (1, 0)
    _write(states, {**base, "rows": [2, 3, 5, 4], "order": [0, 1, 2, 3]})  # rows reused out of order
    _write(states, {**base, "rows": [2, 3, 4, 5], "order": [0, 1, 2]})  # one entry unlisted: its fill
    _write(states, {**base, "rows": [2, 3, 4, 5], "order": [0, 1, 2, 3], "strangers": 1})  # a row to skip
    assert (calls.send_rows, calls.upload) == (1, 3)
    spec = _states(2, list(range(SCRATCH)))
    assert spec.grammar_staging is not None
    calls = _Calls(spec.grammar_staging)
    _write(spec, {**base, "rows": [0, 1], "drafts": [1, 1], "order": [0, 1]})  # every slot written, in order
    _write(spec, {**base, "rows": [0, 1], "drafts": [1, 0], "order": [0, 1]})  # a slot past the drafts: fill
    assert (calls.send_rows, calls.upload) == (1, 1)


def test_blocks_are_reused_slots_valid_until_the_block_after_next() -> None:
    staging = GrammarStaging("cpu", WORDS)
    first, second, third = (staging.block(3, WORDS) for _ in range(3))
    assert first.data_ptr() != second.data_ptr() and third.data_ptr() == first.data_ptr()  # two slots in turn
    assert staging.block(3, WORDS + 1).shape == (3, WORDS + 1)  # another width: a block of its own
    # A block of the slots before they grew is still uploaded whole (copied into the grown slots).
    old = staging.block(2, WORDS)
    old.numpy()[:] = [[1, 2, 3, 4], [5, 6, 7, 8]]
    grown = staging.rows * 2
    staging.block(grown, WORDS)
    index, rows = staging.upload(old.numpy(), old, np.arange(3, dtype=np.int64))
    assert staging.rows == grown and index.tolist() == [0, 1, 2] and rows.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]


@pytest.mark.gpu
@pytest.mark.parametrize("driver", [True, False], ids=["driver", "torch"])
def test_cuda_steps_match_the_cpu_while_the_host_runs_ahead(driver) -> None:
    """Each step's masks on CUDA equal the same step on a CPU, with the device busy before every
    upload (the host fills and hands out slots while earlier copies are still queued)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rng = np.random.default_rng(0)
    cpu, cuda = _states(2, list(range(0, SCRATCH, 2))), _states(2, list(range(0, SCRATCH, 2)), "cuda")
    assert cuda.grammar_staging is not None and cpu.grammar_mask is not None and cuda.grammar_mask is not None
    cuda.grammar_block(1, WORDS)  # allocates the slots (and finds the driver)
    if driver and cuda.grammar_staging._driver is None:
        pytest.skip("the CUDA driver fast path is off (GRAPHRUNNER_CUDA_DRIVER=0)")
    if not driver:
        cuda.grammar_staging._driver = None  # torch's copy_ and Event.record
    snapshots = []
    for i in range(12):
        n = int(rng.integers(1, SCRATCH))
        rows = list(range(n)) if i % 3 == 0 else rng.permutation(SCRATCH)[:n].tolist()
        step = dict(rows=rows, drafts=rng.integers(0, 2, size=n).tolist(), order=rng.permutation(n).tolist()
                    if i % 2 else list(range(n)), strangers=i % 2, pads=1, narrow=i % 5 == 4, source="block",
                    seed=i)
        torch.cuda._sleep(2_000_000)  # the host runs ahead of the copies
        _write(cpu, step)
        _write(cuda, step)
        snapshots.append((cpu.grammar_mask.clone(), cuda.grammar_mask.clone()))
    torch.cuda.synchronize()
    for i, (want, got) in enumerate(snapshots):
        assert torch.equal(got.cpu(), want), f"step {i}"


def test_an_upload_before_any_block_allocates_the_slots() -> None:
    staging = GrammarStaging("cpu", WORDS)
    index, rows = staging.upload(None, None, np.zeros(0, dtype=np.int64))
    assert staging.rows > 0 and index.shape == (0,) and rows.shape == (0, WORDS)
