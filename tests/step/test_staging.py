"""StagedWrites: the one staging scheme of every per-row state tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.state.staging import StagedWrites


@given(st.lists(st.tuples(st.integers(0, 11), st.integers(-100, 100)), max_size=30),
       st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.lists(st.integers(0, 9), min_size=1, max_size=2)),
                max_size=6))
def test_commit_lands_every_write_last_one_wins(scalar_writes, row_writes):
    flat = torch.zeros(12, dtype=torch.int32)
    table = torch.zeros(4, 4, dtype=torch.int64)
    want_flat, want_table = flat.clone(), table.clone()
    staging = StagedWrites("cpu")
    for i, v in scalar_writes:
        staging.stage(flat, i, v)
        want_flat[i] = v
    for row, start, values in row_writes:
        staging.stage_row(table, row, np.asarray(values), start)
        want_table[row, start : start + len(values)] = torch.tensor(values)
    address = (flat.data_ptr(), table.data_ptr())
    assert torch.count_nonzero(flat) == 0 and torch.count_nonzero(table) == 0  # nothing before the commit
    staging.commit()
    assert torch.equal(flat, want_flat) and torch.equal(table, want_table)
    assert (flat.data_ptr(), table.data_ptr()) == address and len(staging) == 0


def test_a_failed_commit_leaves_nothing_behind():
    t = torch.zeros(4, dtype=torch.int64)
    staging = StagedWrites("cpu")
    staging.stage(t, 1, 2**70)  # does not fit int64: the commit raises
    with pytest.raises(OverflowError):
        staging.commit()
    staging.stage(t, 2, 5)  # the next step's writes land; the bad one is gone
    staging.commit()
    assert t.tolist() == [0, 0, 5, 0]


def test_discard_drops_staged_writes():
    t = torch.zeros(3, dtype=torch.float32)
    staging = StagedWrites("cpu")
    staging.stage(t, 0, 1.5)
    staging.discard()
    staging.commit()
    assert t.tolist() == [0.0, 0.0, 0.0]
