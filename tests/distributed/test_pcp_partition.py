"""graphrunner.distributed.pcp: the prefill-context-parallel partition, pure numpy.

Every rank of a PCP group is simulated by building the partition once per rank; an
all-gather is the concatenation of the ranks' local rows in rank order. References here
are brute force (per token, in Python) and independent of the module's vectorized code.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.distributed.pcp import PAD, PCPPartition

# --------------------------------------------------------------------------------------------
# strategies and references


@st.composite
def batches(draw, max_entries: int = 8):
    """(query_lens, num_computed, is_decode) of one step: decodes of 1 + k tokens, prefill chunks of 0..60."""
    n_entries = draw(st.integers(0, max_entries))
    q, n, dec = [], [], []
    for _ in range(n_entries):
        is_dec = draw(st.booleans())
        q.append(draw(st.integers(1, 5)) if is_dec else draw(st.integers(0, 60)))
        n.append(draw(st.integers(1 if is_dec else 0, 200)))
        dec.append(is_dec)
    return np.array(q, dtype=np.int32), np.array(n, dtype=np.int64), np.array(dec, dtype=bool)


pcp_sizes = st.integers(1, 5)


def all_ranks(batch, pcp_size: int) -> list[PCPPartition]:
    q, n, dec = batch
    return [PCPPartition.build(q, n, dec, pcp_size=pcp_size, pcp_rank=r) for r in range(pcp_size)]


def global_positions(q, n) -> np.ndarray:
    return np.array([n[i] + j for i in range(len(q)) for j in range(q[i])], dtype=np.int64)


def brute_force_rank(q, n, dec, pcp_size: int, rank: int) -> list[tuple[int, int]]:
    """(global index or PAD, position) per local token of `rank`, straight from the rules."""
    out, base = [], 0
    for i in range(len(q)):
        qi = int(q[i])
        if dec[i] or pcp_size == 1:
            out += [(base + j, int(n[i]) + j) for j in range(qi)]
        else:
            c = -(-qi // (2 * pcp_size))
            chunk_ids = [rank, 2 * pcp_size - 1 - rank]
            for j in [k * c + o for k in chunk_ids for o in range(c)]:
                out.append((base + j, int(n[i]) + j) if j < qi else (PAD, 0))
        base += qi
    return out


def chunk_bound(qi: int, ni: int, pcp_size: int) -> int:
    """K_i: the work of a prefill's last chunk were it all real (keys = position + 1)."""
    c = -(-qi // (2 * pcp_size))
    lp = 2 * pcp_size * c
    return sum(ni + j + 1 for j in range(lp - c, lp))


# --------------------------------------------------------------------------------------------
# properties


@given(batches(), pcp_sizes, st.integers(0, 7))
def test_partition_then_restore_is_the_identity(batch, pcp_size, extra):
    q, n, _ = batch
    parts = all_ranks(batch, pcp_size)
    t_local = parts[0].num_local_tokens
    for stride in (None, t_local + extra):  # extra: graph padding rows after each rank's tokens
        s = t_local if stride is None else stride
        gathered_idx = np.full((pcp_size, s), 10**9, dtype=np.int64)  # junk in graph padding rows
        gathered_pos = np.full((pcp_size, s), 10**9, dtype=np.int64)
        for p in parts:
            gathered_idx[p.pcp_rank, :t_local] = p.global_index
            gathered_pos[p.pcp_rank, :t_local] = p.positions
        restore = parts[0].restore_index(stride)
        for p in parts[1:]:  # every rank derives the same restore indices
            np.testing.assert_array_equal(p.restore_index(stride), restore)
        np.testing.assert_array_equal(gathered_idx.reshape(-1)[restore], np.arange(int(q.sum())))
        np.testing.assert_array_equal(gathered_pos.reshape(-1)[restore], global_positions(q, n))


@given(batches(), pcp_sizes, st.integers(0, 7))
def test_restore_is_the_argsort_of_gathered_indices_with_dropped_rows_last(batch, pcp_size, extra):
    parts = all_ranks(batch, pcp_size)
    stride = parts[0].num_local_tokens + extra
    gathered = parts[0].gathered_global_index(stride)
    write = parts[0].gathered_kv_write_mask(stride)
    key = np.where(write, gathered, parts[0].num_tokens + np.arange(len(gathered)))
    restore = parts[0].restore_index(stride)
    np.testing.assert_array_equal(restore, np.argsort(key, kind="stable")[: parts[0].num_tokens])
    # The write mask selects exactly the restored rows: each global token is written once.
    np.testing.assert_array_equal(np.flatnonzero(write), np.sort(restore))
    assert (gathered[write] >= 0).all()


@given(batches(), pcp_sizes)
def test_local_layout_matches_the_rules_token_by_token(batch, pcp_size):
    q, n, dec = batch
    for p in all_ranks(batch, pcp_size):
        expected = brute_force_rank(q, n, dec, pcp_size, p.pcp_rank)
        got = list(zip(p.global_index.tolist(), p.positions.tolist(), strict=True))
        assert got == expected
        np.testing.assert_array_equal(np.diff(p.local_query_start_loc), p.local_query_lens)
        np.testing.assert_array_equal(np.repeat(np.arange(len(q)), p.local_query_lens), p.local_entry)
        assert p.global_index.dtype == np.int64 and p.positions.dtype == np.int64
        assert p.local_query_start_loc.dtype == np.int32 and p.local_query_lens.dtype == np.int32


@given(batches(), pcp_sizes)
def test_prefill_tokens_land_on_one_rank_and_decode_tokens_on_every_rank(batch, pcp_size):
    q, _, dec = batch
    counts = np.zeros(int(q.sum()), dtype=np.int64)
    for p in all_ranks(batch, pcp_size):
        np.add.at(counts, p.global_index[p.is_real], 1)
    token_is_decode = np.repeat(dec, q)
    np.testing.assert_array_equal(counts[~token_is_decode], 1)
    np.testing.assert_array_equal(counts[token_is_decode], pcp_size)


@given(batches(), pcp_sizes)
def test_every_rank_holds_the_same_number_of_tokens(batch, pcp_size):
    q, _, dec = batch
    parts = all_ranks(batch, pcp_size)
    t_local = parts[0].num_local_tokens
    for p in parts:
        assert p.num_local_tokens == t_local
        np.testing.assert_array_equal(p.tokens_per_rank, t_local)
        np.testing.assert_array_equal(p.real_tokens_per_rank, [x.is_real.sum() for x in parts])
        np.testing.assert_array_equal(p.padding_per_rank, [(~x.is_real).sum() for x in parts])
    # Padding totals Lp - q per prefill, fewer than 2P tokens each.
    total_pad = sum(int((~x.is_real).sum()) for x in parts)
    assert total_pad == int((parts[0].padded_lens - q).sum())
    assert ((parts[0].padded_lens - q) < max(2 * pcp_size, 1)).all()
    assert int(parts[0].real_tokens_per_rank.sum()) == int(q[~dec].sum()) + pcp_size * int(q[dec].sum())


@given(batches(), pcp_sizes)
def test_causal_work_differs_between_ranks_by_at_most_one_chunk_per_prefill(batch, pcp_size):
    q, n, dec = batch
    parts = all_ranks(batch, pcp_size)
    work = np.zeros((len(q), pcp_size), dtype=np.int64)  # [entry, rank], brute force
    for p in parts:
        for t in np.flatnonzero(p.is_real & ~p.local_is_decode):
            work[p.local_entry[t], p.pcp_rank] += p.positions[t] + 1
    np.testing.assert_array_equal(parts[0].prefill_work_per_rank, work.sum(axis=0))
    bounds = [0 if dec[i] or pcp_size == 1 else chunk_bound(int(q[i]), int(n[i]), pcp_size) for i in range(len(q))]
    for i in range(len(q)):  # per entry: at most that entry's last chunk
        assert work[i].max() - work[i].min() <= bounds[i], (i, work[i], bounds[i])
        if not dec[i] and q[i] % (2 * pcp_size) == 0:  # unpadded: exact balance
            assert work[i].max() == work[i].min()
    total = work.sum(axis=0)
    assert total.max() - total.min() <= sum(bounds) == parts[0].work_imbalance_bound


@given(batches(), pcp_sizes)
def test_padding_is_position_zero_masked_out_and_reads_its_own_entry(batch, pcp_size):
    q, _, _ = batch
    for p in all_ranks(batch, pcp_size):
        pad = p.global_index == PAD
        np.testing.assert_array_equal(p.is_real, ~pad)  # the mask never marks padding real
        assert (p.positions[pad] == 0).all()
        assert not p.local_is_decode[pad].any()  # decodes are never padded
        first = p.global_query_start_loc[p.local_entry]
        np.testing.assert_array_equal(p.gather_index[pad], first[pad])
        np.testing.assert_array_equal(p.gather_index[~pad], p.global_index[~pad])
        # Every gather stays inside the token's own entry, and every padded entry has a first token.
        entry_end = p.global_query_start_loc[p.local_entry + 1]
        assert ((p.gather_index >= first) & (p.gather_index < entry_end)).all()
        # The slot-mapping rule: padding gets -1 whatever the real slots are.
        slots = np.arange(int(q.sum()), dtype=np.int64) + 1000
        local_slots = np.where(p.is_real, slots[p.gather_index] if len(slots) else 0, -1)
        assert (local_slots[pad] == -1).all() and (local_slots[~pad] >= 1000).all()


@given(batches(), pcp_sizes)
def test_segments_are_contiguous_runs_of_real_tokens_then_padding(batch, pcp_size):
    _, n, dec = batch
    for p in all_ranks(batch, pcp_size):
        starts, reals, seqs = p.segment_start_loc, p.segment_real_lens, p.segment_seq_lens
        assert starts[0] == 0 and starts[-1] == p.num_local_tokens and (np.diff(starts) >= 0).all()
        per_entry = np.bincount(p.segment_entry, minlength=len(dec))
        np.testing.assert_array_equal(per_entry, np.where(dec | (pcp_size == 1), 1, 2))
        for s in range(len(reals)):
            rows = np.arange(starts[s], starts[s + 1])
            real = p.is_real[rows]
            assert real[: reals[s]].all() and not real[reals[s]:].any()
            if reals[s]:
                expected = np.arange(seqs[s] - reals[s], seqs[s])
                np.testing.assert_array_equal(p.positions[rows[: reals[s]]], expected)
                assert seqs[s] - reals[s] >= n[p.segment_entry[s]]
            else:
                assert seqs[s] == 0


@given(batches(), st.integers(2, 5))
def test_attention_segments_place_every_real_row_at_its_position(batch, pcp_size):
    """The kernel's convention: a run of L rows with seq_len S puts row i at position S - L + i and
    lets it see keys 0..S-L+i. Real rows must land on their own position; padding rows see nothing."""
    for p in all_ranks(batch, pcp_size):
        entry, start_loc, seq_lens, whole = p.attention_segments()
        assert start_loc[0] == 0 and start_loc[-1] == p.num_local_tokens and (np.diff(start_loc) > 0).all()
        covered = np.zeros(p.num_local_tokens, dtype=int)
        for a in range(len(entry)):
            rows = np.arange(start_loc[a], start_loc[a + 1])
            covered[rows] += 1
            assert (p.local_entry[rows] == entry[a]).all()
            if seq_lens[a] == 0:
                assert not p.is_real[rows].any() and not whole[a]
                continue
            assert p.is_real[rows].all()
            np.testing.assert_array_equal(p.positions[rows], seq_lens[a] - len(rows) + np.arange(len(rows)))
            assert whole[a] == bool(p.local_is_decode[rows[0]])
        assert (covered == 1).all()


@given(batches())
def test_pcp_size_one_is_the_identity_partition(batch):
    q, n, _ = batch
    p = PCPPartition.build(*batch, pcp_size=1, pcp_rank=0)
    t = int(q.sum())
    np.testing.assert_array_equal(p.global_index, np.arange(t))
    np.testing.assert_array_equal(p.positions, global_positions(q, n))
    np.testing.assert_array_equal(p.local_query_start_loc, p.global_query_start_loc)
    np.testing.assert_array_equal(p.restore_index(), np.arange(t))
    assert p.is_real.all() and p.padding_per_rank.tolist() == [0]
    assert p.work_imbalance_bound == 0


# --------------------------------------------------------------------------------------------
# hand-worked examples


def test_five_token_prefill_on_two_ranks():
    # Padded to 8, four chunks of 2: [0 1] [2 3] [4 5] [6 7]; 5, 6, 7 are padding.
    # Rank 0 takes chunks 0 and 3, rank 1 chunks 1 and 2.
    batch = (np.array([5]), np.array([0]), np.array([False]))
    r0, r1 = all_ranks(batch, 2)
    assert r0.global_index.tolist() == [0, 1, PAD, PAD]
    assert r1.global_index.tolist() == [2, 3, 4, PAD]
    assert r0.positions.tolist() == [0, 1, 0, 0] and r1.positions.tolist() == [2, 3, 4, 0]
    assert r0.is_real.tolist() == [True, True, False, False]
    assert r1.is_real.tolist() == [True, True, True, False]
    assert r0.gather_index.tolist() == [0, 1, 0, 0]
    assert r0.padded_lens.tolist() == [8] and r0.chunk_lens.tolist() == [2]
    assert r0.local_query_start_loc.tolist() == [0, 4]
    assert r0.tokens_per_rank.tolist() == [4, 4] and r0.padding_per_rank.tolist() == [2, 1]
    assert r0.gathered_global_index().tolist() == [0, 1, PAD, PAD, 2, 3, 4, PAD]
    assert r0.restore_index().tolist() == [0, 1, 4, 5, 6]
    assert r0.restore_index(stride=6).tolist() == [0, 1, 6, 7, 8]
    # Work (position + 1): rank 0 {1, 2} = 3, rank 1 {3, 4, 5} = 12; bound K = 2 * 8 - 1 = 15.
    assert r0.prefill_work_per_rank.tolist() == [3, 12] and r0.work_imbalance_bound == 15
    assert r0.segment_start_loc.tolist() == [0, 2, 4]
    assert r0.segment_real_lens.tolist() == [2, 0] and r0.segment_seq_lens.tolist() == [2, 0]
    assert r1.segment_real_lens.tolist() == [2, 1] and r1.segment_seq_lens.tolist() == [4, 5]


def test_the_work_bound_is_tight():
    # q = 6 on two ranks: chunks of 2, rank 0's tail chunk [6 7] is all padding.
    # Rank 0: positions {0, 1} -> 1 + 2 = 3; rank 1: {2, 3, 4, 5} -> 18; K = 2 * 8 - 1 = 15 = 18 - 3.
    p = PCPPartition.build(np.array([6]), np.array([0]), np.array([False]), pcp_size=2, pcp_rank=0)
    assert p.prefill_work_per_rank.tolist() == [3, 18] and p.work_imbalance_bound == 15


def test_four_ranks_pair_each_chunk_with_its_mirror():
    batch = (np.array([8]), np.array([0]), np.array([False]))
    got = [p.global_index.tolist() for p in all_ranks(batch, 4)]
    assert got == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert all_ranks(batch, 4)[0].prefill_work_per_rank.tolist() == [9, 9, 9, 9]


def test_decode_then_chunked_prefill_on_two_ranks():
    # Entry 0: decode (q = 1, 10 computed) -> global token 0, on both ranks.
    # Entry 1: prefill chunk of 4 after 3 computed -> global 1..4, chunks of 1: rank 0 j in {0, 3}.
    batch = (np.array([1, 4]), np.array([10, 3]), np.array([True, False]))
    r0, r1 = all_ranks(batch, 2)
    assert r0.global_index.tolist() == [0, 1, 4] and r1.global_index.tolist() == [0, 2, 3]
    assert r0.positions.tolist() == [10, 3, 6] and r1.positions.tolist() == [10, 4, 5]
    assert r0.local_query_start_loc.tolist() == [0, 1, 3]
    assert r0.gathered_kv_write_mask().tolist() == [True, True, True, False, True, True]
    assert r0.restore_index().tolist() == [0, 1, 4, 5, 2]
    assert r1.segment_entry.tolist() == [0, 1, 1] and r1.segment_seq_lens.tolist() == [11, 5, 6]


def test_speculative_decode_is_duplicated_whole():
    batch = (np.array([3]), np.array([7]), np.array([True]))  # 1 + 2 drafts
    for p in all_ranks(batch, 3):
        assert p.global_index.tolist() == [0, 1, 2] and p.positions.tolist() == [7, 8, 9]
    assert all_ranks(batch, 3)[0].restore_index(stride=4).tolist() == [0, 1, 2]


def test_empty_step():
    p = PCPPartition.build(np.array([], dtype=np.int32), np.array([], dtype=np.int64),
                           np.array([], dtype=bool), pcp_size=2, pcp_rank=1)
    assert p.num_tokens == 0 and p.num_local_tokens == 0
    assert p.restore_index().tolist() == [] and p.local_query_start_loc.tolist() == [0]


# --------------------------------------------------------------------------------------------
# validation


GOOD = (np.array([4, 1]), np.array([0, 5]), np.array([False, True]))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"pcp_size": 0, "pcp_rank": 0}, r"pcp_size = 0 must be an integer >= 1"),
    ({"pcp_size": 2, "pcp_rank": 2}, r"pcp_rank = 2 must be an integer in \[0, pcp_size = 2\)"),
    ({"pcp_size": 2, "pcp_rank": -1}, r"pcp_rank = -1"),
    ({"pcp_size": True, "pcp_rank": 0}, r"pcp_size = True"),
])
def test_rejects_bad_group(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PCPPartition.build(*GOOD, **kwargs)


@pytest.mark.parametrize(("batch", "message"), [
    ((np.array([4, -1]), GOOD[1], GOOD[2]), r"query_lens\[1\] = -1 is negative \(must be >= 0\)"),
    ((GOOD[0], np.array([-3, 5]), GOOD[2]), r"num_computed\[0\] = -3 is negative"),
    ((GOOD[0], np.array([0]), GOOD[2]), r"got lengths 2, 1 and 2"),
    ((GOOD[0], GOOD[1], np.array([False])), r"got lengths 2, 2 and 1"),
    ((GOOD[0], GOOD[1], np.array([0, 1])), r"is_decode must be boolean, got dtype int"),
    ((np.array([4.0, 1.0]), GOOD[1], GOOD[2]), r"query_lens must hold integers, got dtype float64"),
    ((np.array([[4, 1]]), GOOD[1], GOOD[2]), r"query_lens must be 1-D, got shape \(1, 2\)"),
])
def test_rejects_bad_batch(batch, message):
    with pytest.raises(ValueError, match=message):
        PCPPartition.build(*batch, pcp_size=2, pcp_rank=0)


def test_rejects_a_stride_below_the_local_token_count():
    p = PCPPartition.build(*GOOD, pcp_size=2, pcp_rank=0)
    with pytest.raises(ValueError, match=r"stride = 2 is below the local token count 3"):
        p.restore_index(stride=2)
