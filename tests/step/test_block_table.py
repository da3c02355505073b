"""BlockTables staging and validation, block-table gather and slot mapping: torch
reference vs plain-Python loops, Triton (interpreted on CPU) vs torch reference,
padding fully written; GPU tests at realistic sizes."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.kernels import HAS_TRITON
from graphrunner.kernels import input_prep as bt
from graphrunner.kernels.input_prep import compute_slot_mapping
from graphrunner.state.block_tables import BlockTables

SENTINEL = -7777
# Triton tests run compiled on CUDA tensors where a GPU exists, interpreted on CPU otherwise.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


# --------------------------------------------------------------------------- staging


@dataclass
class Op:
    kind: str  # "overwrite" | "append" | "clear" | "apply"
    row: int
    ids: list[int]


def ops_strategy(num_rows: int, max_blocks: int, num_kv_blocks: int):
    op = st.builds(
        Op,
        kind=st.sampled_from(["overwrite", "append", "clear", "apply"]),
        row=st.integers(0, num_rows - 1),
        ids=st.lists(st.integers(0, num_kv_blocks - 1), max_size=max_blocks),
    )
    return st.lists(op, max_size=25)


@settings(deadline=None)
@given(data=st.data(), num_rows=st.integers(1, 6), max_blocks=st.integers(1, 6), num_kv_blocks=st.integers(1, 40))
def test_staged_writes_visible_only_after_apply(data, num_rows, max_blocks, num_kv_blocks):
    tables = BlockTables(num_rows, max_blocks, 16, num_kv_blocks, "cpu")
    model: dict[int, list[int]] = {r: [] for r in range(num_rows)}  # staged truth
    applied = {r: [] for r in range(num_rows)}  # what the device must hold (prefixes)
    device_before = tables.table.clone()
    for op in data.draw(ops_strategy(num_rows, max_blocks, num_kv_blocks)):
        if op.kind == "apply":
            tables.apply_staged_writes()
            applied = {r: list(v) for r, v in model.items()}
            device_before = tables.table.clone()
            assert not tables.has_staged_writes
        elif op.kind == "clear":
            tables.clear_row(op.row)
            model[op.row] = []
        else:
            new = op.ids if op.kind == "overwrite" else model[op.row] + op.ids
            if len(new) > max_blocks:
                with pytest.raises(ValueError):
                    tables.append_block_ids(op.row, op.ids, overwrite=op.kind == "overwrite")
            else:
                tables.append_block_ids(op.row, op.ids, overwrite=op.kind == "overwrite")
                model[op.row] = list(new)
        # Host mirror tracks staged writes at once; the device table only on apply.
        for r in range(num_rows):
            assert tables.num_blocks[r] == len(model[r])
            assert tables.row_block_ids(r).tolist() == model[r]
        assert torch.equal(tables.table, device_before)
        for r in range(num_rows):
            assert tables.table[r, : len(applied[r])].tolist() == applied[r]
    tables.apply_staged_writes()
    for r in range(num_rows):
        assert tables.table[r, : len(model[r])].tolist() == model[r]


def _snapshot(tables: BlockTables):
    return tables.table.clone(), tables.table_np.copy(), tables.num_blocks.copy(), tables.has_staged_writes


@pytest.mark.parametrize(
    "row, ids, overwrite, pattern",
    [
        (0, [3, 40], False, r"block id 40 is out of range \[0, 40\)"),
        (0, [-1], True, r"block id -1 is out of range \[0, 40\)"),
        (1, [5, 6], False, r"row 1 would hold 5 blocks, more than max_num_blocks_per_req=4"),
        (2, [1, 2, 3, 4, 5], True, r"row 2 would hold 5 blocks, more than max_num_blocks_per_req=4"),
        (3, [1], True, r"row=3 is out of range \[0, 3\)"),
        (-1, [1], True, r"row=-1 is out of range \[0, 3\)"),
    ],
)
def test_invalid_writes_raise_and_change_nothing(row, ids, overwrite, pattern):
    tables = BlockTables(3, 4, 16, 40, "cpu")
    tables.append_block_ids(1, [7, 8, 9], overwrite=True)
    tables.apply_staged_writes()
    tables.append_block_ids(0, [1], overwrite=True)  # a pending staged write survives the error
    snap = _snapshot(tables)
    with pytest.raises(ValueError, match=pattern):
        tables.append_block_ids(row, ids, overwrite=overwrite)
    table, table_np, num_blocks, staged = snap
    assert torch.equal(tables.table, table)
    assert np.array_equal(tables.table_np, table_np)
    assert np.array_equal(tables.num_blocks, num_blocks)
    assert tables.has_staged_writes == staged
    tables.apply_staged_writes()
    assert tables.table[0, :1].tolist() == [1] and tables.table[1, :3].tolist() == [7, 8, 9]


def test_several_staged_writes_to_one_row_all_reach_the_device():
    tables = BlockTables(2, 8, 16, 50, "cpu")
    tables.append_block_ids(0, [1, 2], overwrite=True)
    tables.apply_staged_writes()
    tables.append_block_ids(0, [3, 4], overwrite=False)  # staged from column 2 ...
    tables.append_block_ids(0, [5], overwrite=False)  # ... and from column 4: both must upload
    tables.append_block_ids(1, [9, 8, 7], overwrite=True)
    tables.append_block_ids(1, [6], overwrite=True)  # overwrite wins over the earlier staging
    tables.append_block_ids(1, [5], overwrite=False)
    tables.apply_staged_writes()
    assert tables.table[0, :5].tolist() == [1, 2, 3, 4, 5]
    assert tables.table[1, :2].tolist() == [6, 5] and tables.num_blocks.tolist() == [5, 2]


def test_clear_row_and_constructor_validation():
    tables = BlockTables(2, 3, 16, 10, "cpu")
    tables.append_block_ids(0, [1, 2], overwrite=True)
    tables.clear_row(0)
    assert tables.num_blocks[0] == 0 and tables.row_block_ids(0).tolist() == []
    tables.append_block_ids(0, [4], overwrite=False)  # appending to a cleared row starts at column 0
    tables.apply_staged_writes()
    assert tables.table[0, :1].tolist() == [4]
    with pytest.raises(ValueError, match=r"row=2 is out of range \[0, 2\)"):
        tables.clear_row(2)
    with pytest.raises(ValueError, match="num_kv_blocks=0 must be positive"):
        BlockTables(2, 3, 16, 0, "cpu")


# --------------------------------------------------------------------------- gather and slot mapping


@dataclass
class Batch:
    block_size: int
    table: torch.Tensor  # [num_rows, M] int32: rows are slices of a permutation of physical blocks
    idx_mapping: list[int]  # [R_pad]; padded entries -> scratch row (the last)
    query_start_loc: list[int]  # [R_pad + 1]
    positions: list[int]  # [T_pad]; garbage past the real tokens


def make_batch(
    rng: random.Random,
    max_num_reqs: int,
    max_blocks: int,
    block_size: int,
    max_extra: int,
    max_chunk: int | None = None,
) -> Batch:
    num_rows = max_num_reqs + 1
    perm = rng.sample(range(num_rows * max_blocks + 7), num_rows * max_blocks)
    table = torch.tensor(perm, dtype=torch.int32).view(num_rows, max_blocks)
    num_real = rng.randint(0, max_num_reqs)
    num_reqs = rng.randint(max(num_real, 1), max_num_reqs)
    rows = rng.sample(range(max_num_reqs), num_real)
    capacity = max_blocks * block_size
    qsl, positions = [0], []
    for _ in rows:
        computed = rng.randint(0, capacity - 1)
        qlen = 1 if rng.random() < 0.5 else rng.randint(1, min(capacity - computed, max_chunk or capacity))
        positions += [computed + i for i in range(qlen)]
        qsl.append(qsl[-1] + qlen)
    qsl += [qsl[-1]] * (num_reqs - num_real)
    # Padded tokens carry garbage positions (even past the table): they must map to -1.
    positions += [rng.randint(0, 3 * capacity) for _ in range(rng.randint(0, max_extra))]
    return Batch(block_size, table, rows + [max_num_reqs] * (num_reqs - num_real), qsl, positions)


batches = st.builds(
    make_batch,
    rng=st.randoms(use_true_random=False),
    max_num_reqs=st.integers(1, 8),  # Triton grids stay <= 16 programs
    max_blocks=st.integers(1, 6),
    block_size=st.sampled_from([1, 2, 4, 16]),
    max_extra=st.integers(0, 9),
)


def loop_gather(b: Batch) -> list[list[int]]:
    rows = b.table.tolist()
    return [rows[r] for r in b.idx_mapping]


def loop_slot_mapping(b: Batch, block_table: list[list[int]]) -> list[int]:
    slots = [-1] * len(b.positions)
    for e in range(len(b.idx_mapping)):
        for t in range(b.query_start_loc[e], b.query_start_loc[e + 1]):
            p = b.positions[t]
            slots[t] = block_table[e][p // b.block_size] * b.block_size + p % b.block_size
    return slots


def run(impl: str, b: Batch, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Gather + slot mapping of one implementation into sentinel-filled buffer views."""
    table = b.table.to(device)
    idx = torch.tensor(b.idx_mapping, dtype=torch.int32, device=device)
    qsl = torch.tensor(b.query_start_loc, dtype=torch.int32, device=device)
    positions = torch.tensor(b.positions, dtype=torch.int64, device=device)
    R, M, T = len(b.idx_mapping), table.shape[1], len(b.positions)
    bt_buf = torch.full((R + 2, M), SENTINEL, dtype=torch.int32, device=device)
    slot_buf = torch.full((T + 3,), SENTINEL, dtype=torch.int64, device=device)
    getattr(bt, f"gather_block_table_{impl}")(table, idx, bt_buf[:R])
    getattr(bt, f"compute_slot_mapping_{impl}")(bt_buf[:R], qsl, positions, b.block_size, slot_buf[:T])
    assert (bt_buf[R:] == SENTINEL).all() and (slot_buf[T:] == SENTINEL).all()  # no out-of-bounds writes
    return bt_buf[:R], slot_buf[:T]


@settings(deadline=None)
@given(b=batches)
def test_torch_matches_loop_reference(b: Batch):
    block_table, slots = run("torch", b)
    expected_table = loop_gather(b)
    assert block_table.tolist() == expected_table
    assert slots.tolist() == loop_slot_mapping(b, expected_table)
    assert not (slots == SENTINEL).any()
    # Real slots are distinct (rows hold disjoint physical blocks) and padded ones are -1.
    real = slots[: b.query_start_loc[-1]]
    assert real.unique().numel() == real.numel() and (real >= 0).all()
    assert (slots[b.query_start_loc[-1] :] == -1).all()


@needs_triton
@settings(deadline=None)
@given(b=batches)
def test_triton_matches_torch(b: Batch):
    ref_table, ref_slots = run("torch", b, DEVICE)
    got_table, got_slots = run("triton", b, DEVICE)
    assert torch.equal(got_table, ref_table)
    assert torch.equal(got_slots, ref_slots)


def test_public_api_dispatch_and_validation():
    b = make_batch(random.Random(3), 4, 4, 4, 5)
    num_rows, M = b.table.shape
    tables = BlockTables(num_rows, M, b.block_size, num_rows * M + 7, "cpu")
    for r in range(num_rows):
        tables.append_block_ids(r, b.table[r].tolist(), overwrite=True)
    tables.apply_staged_writes()
    R, T = len(b.idx_mapping), len(b.positions)
    out = torch.empty(R, M, dtype=torch.int32)
    tables.gather(torch.tensor(b.idx_mapping, dtype=torch.int32), out)
    assert out.tolist() == loop_gather(b)
    slots = torch.empty(T, dtype=torch.int64)
    qsl = torch.tensor(b.query_start_loc, dtype=torch.int32)
    positions = torch.tensor(b.positions, dtype=torch.int64)
    compute_slot_mapping(out, qsl, positions, b.block_size, slots)
    assert slots.tolist() == loop_slot_mapping(b, out.tolist())
    with pytest.raises(ValueError, match=rf"out has shape \({R}, {M - 1}\), expected \({R}, {M}\)"):
        tables.gather(torch.tensor(b.idx_mapping, dtype=torch.int32), out[:, :-1])
    with pytest.raises(ValueError, match="positions has dtype torch.int32"):
        compute_slot_mapping(out, qsl, positions.int(), b.block_size, slots)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@settings(deadline=None)
@given(seed=st.integers(0, 2**30), max_num_reqs=st.sampled_from([1, 16, 128, 512]))
def test_gpu_triton_matches_torch_large(seed, max_num_reqs):
    # R_pad up to 512; max_model_len 4096 with 16-token blocks -> 256 blocks per request; T_pad <= 2048.
    max_chunk = 2048 // max_num_reqs - 1
    b = make_batch(random.Random(seed), max_num_reqs, 256, 16, 2048 - max_chunk * max_num_reqs, max_chunk=max_chunk)
    assert len(b.idx_mapping) <= 512 and len(b.positions) <= 2048
    ref_table, ref_slots = run("torch", b, "cuda")
    got_table, got_slots = run("triton", b, "cuda")
    assert torch.equal(got_table, ref_table)
    assert torch.equal(got_slots, ref_slots)


@pytest.mark.gpu
def test_gpu_staged_writes_pinned_upload():
    rng = random.Random(0)
    num_rows, M, num_kv = 513, 256, 100_000
    tables = BlockTables(num_rows, M, 16, num_kv, "cuda")
    for _ in range(5):  # several rounds of staged writes, each committed with pinned async uploads
        for r in rng.sample(range(num_rows), 64):
            ids = [rng.randrange(num_kv) for _ in range(rng.randint(0, M - tables.num_blocks[r]))]
            tables.append_block_ids(r, ids, overwrite=rng.random() < 0.3)
        tables.apply_staged_writes()
        table = tables.table.cpu().numpy()
        for r in range(num_rows):
            n = tables.num_blocks[r]
            assert np.array_equal(table[r, :n], tables.table_np[r, :n])


@settings(deadline=None)
@given(data=st.data(), num_rows=st.integers(1, 8), max_blocks=st.integers(1, 6), num_kv_blocks=st.integers(1, 40))
def test_appending_to_many_rows_equals_appending_row_by_row(data, num_rows, max_blocks, num_kv_blocks):
    """`append_to_rows` (a block-boundary step's appends in one numpy pass) leaves the host mirror, the
    holder counts and the committed device table as `append_block_ids` row by row does, and refuses
    what it refuses (out-of-range ids, rows past their limit, a repeated row) before staging anything."""
    valid = st.integers(0, num_kv_blocks - 1)
    start = data.draw(st.lists(st.lists(valid, max_size=max_blocks // 2), min_size=num_rows, max_size=num_rows))
    rows = data.draw(st.lists(st.integers(0, num_rows - 1), max_size=num_rows, unique=True))
    blocks = [data.draw(st.lists(valid, max_size=max_blocks - len(start[r]))) for r in rows]
    fault = data.draw(st.sampled_from(["none", "none", "none", "id", "row", "repeat", "full"]))
    if fault == "id" and blocks:
        blocks[0] = [*blocks[0], data.draw(st.sampled_from([-1, num_kv_blocks]))]
    elif fault == "row":
        rows, blocks = [*rows, num_rows], [*blocks, [0]]
    elif fault == "repeat" and rows:
        rows, blocks = [*rows, rows[0]], [*blocks, [0]]
    elif fault == "full" and rows:
        blocks[0] = [0] * (max_blocks - len(start[rows[0]]) + 1)
    one, many = (BlockTables(num_rows, max_blocks, 16, num_kv_blocks, "cpu") for _ in range(2))
    for tables in (one, many):
        for r, b in enumerate(start):
            tables.append_block_ids(r, b, overwrite=True)
        tables.apply_staged_writes()
    try:
        for r, b in zip(rows, blocks, strict=True):  # validate all first, as append_to_rows does
            one._check_row(r)
            assert all(0 <= x < num_kv_blocks for x in b) or not b, "id"
            assert len(start[r]) + sum(len(bb) for rr, bb in zip(rows, blocks, strict=True) if rr == r) <= max_blocks
        assert len(set(rows)) == len(rows), "repeated row"
    except (ValueError, AssertionError):
        with pytest.raises(ValueError):
            many.append_to_rows(rows, blocks)
        assert not many.has_staged_writes
        return
    for r, b in zip(rows, blocks, strict=True):
        if b:
            one.append_block_ids(r, b, overwrite=False)
    many.append_to_rows(rows, blocks)
    for tables in (one, many):
        tables.apply_staged_writes()
    assert np.array_equal(one.num_blocks, many.num_blocks) and np.array_equal(one.holders, many.holders)
    for r in range(num_rows):
        n = int(one.num_blocks[r])
        assert np.array_equal(one.table_np[r, :n], many.table_np[r, :n])
        assert torch.equal(one.table[r, :n], many.table[r, :n]) and torch.equal(one.num_blocks_dev, many.num_blocks_dev)
