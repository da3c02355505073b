"""DCP kernels (graphrunner/kernels/dcp.py): the rank-local slot mapping and sequence lengths
of a KV cache sharded across D ranks in runs of I tokens, against brute-force loops written
from the module docstring, torch and Triton (interpreted on CPU); properties over all
ranks; the D = 1 case against the ordinary slot mapping; GPU at scale and in a CUDA graph."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.kernels import HAS_TRITON, dcp
from graphrunner.kernels import input_prep as bt
from graphrunner.kernels.dcp import dcp_local_capacity, dcp_local_seq_lens, dcp_slot_mapping
from tests.cuda_graphs import capture_cuda_graph

# Triton tests run compiled on CUDA tensors where a GPU exists, interpreted on CPU otherwise.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
IMPLS = ["torch", pytest.param("triton", marks=needs_triton)]
GUARD = 3  # junk elements past every output view, which no kernel may touch
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


# --------------------------------------------------------------------------- brute force, from the docstring


def owner(p: int, interleave: int, dcp_size: int) -> int:
    return (p // interleave) % dcp_size


def local_pos(p: int, interleave: int, dcp_size: int) -> int:
    return (p // (interleave * dcp_size)) * interleave + p % interleave


def loop_local_len(seq_len: int, interleave: int, dcp_size: int, rank: int) -> int:
    return sum(1 for p in range(seq_len) if owner(p, interleave, dcp_size) == rank)


@dataclass
class Case:
    block_size: int
    interleave: int
    dcp_size: int
    seq_lens: list[int]  # [R_pad]; 0 for padded entries
    query_start_loc: list[int]  # [R_pad + 1]
    positions: list[int]  # [T_pad]; garbage past the real tokens
    tables: list[torch.Tensor]  # per rank, [R_pad, M] int32: that rank's rows (junk on padded entries)

    @property
    def num_real_tokens(self) -> int:
        return self.query_start_loc[-1]


def make_case(
    rng: random.Random,
    num_reqs: int,
    num_tokens: int,
    block_size: int,
    interleave: int | None,  # None: the block size
    dcp_size: int,
    max_len: int,
) -> Case:
    """A ragged batch of exactly `num_reqs` entries and `num_tokens` tokens, padding included."""
    interleave = block_size if interleave is None else interleave
    num_real = rng.randint(0, num_reqs)
    seq_lens, qsl, positions = [], [0], []
    for _ in range(num_real):
        budget = num_tokens - len(positions)
        if budget == 0:
            break
        seq_len = rng.randint(1, max_len)
        qlen = min(budget, 1 if rng.random() < 0.5 else rng.randint(1, seq_len))  # decode, or a chunk
        positions += range(seq_len - qlen, seq_len)
        seq_lens.append(seq_len)
        qsl.append(qsl[-1] + qlen)
    num_pad = num_reqs - len(seq_lens)
    seq_lens += [0] * num_pad
    qsl += [qsl[-1]] * num_pad
    # Padded tokens carry garbage positions (negative, or far past any table): they map to -1.
    positions += [rng.randint(-3 * max_len, 3 * max_len) for _ in range(num_tokens - len(positions))]
    capacity = max(loop_local_len(max_len, interleave, dcp_size, r) for r in range(dcp_size))
    max_blocks = -(-capacity // block_size) + rng.randint(0, 1)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    tables = []
    for _ in range(dcp_size):  # each rank: disjoint physical blocks per entry, junk rows for padding
        perm = torch.randperm(num_reqs * max_blocks + 7, generator=gen)[: num_reqs * max_blocks]
        table = perm.to(torch.int32).view(num_reqs, max_blocks)
        table[num_real:] = torch.randint(-(2**30), 2**30, (num_reqs - num_real, max_blocks), generator=gen).int()
        tables.append(table)
    return Case(block_size, interleave, dcp_size, seq_lens, qsl, positions, tables)


def loop_slot_mapping(c: Case, rank: int) -> list[int]:
    table = c.tables[rank].tolist()
    slots = [-1] * len(c.positions)
    for e in range(len(c.seq_lens)):
        for t in range(c.query_start_loc[e], c.query_start_loc[e + 1]):
            p = c.positions[t]
            if owner(p, c.interleave, c.dcp_size) == rank:
                lp = local_pos(p, c.interleave, c.dcp_size)
                slots[t] = table[e][lp // c.block_size] * c.block_size + lp % c.block_size
    return slots


def cases(dcp_size: int | None = None):
    """Random batches; D drawn from 1..4 unless given."""
    return st.builds(
        make_case,
        rng=st.randoms(use_true_random=False),
        num_reqs=st.integers(1, 8),  # Triton grids stay <= 9 programs
        num_tokens=st.integers(0, 96),
        block_size=st.sampled_from([1, 4, 16]),
        interleave=st.sampled_from([1, 2, 8, 16, None]),
        dcp_size=st.integers(1, 4) if dcp_size is None else st.just(dcp_size),
        max_len=st.integers(1, 300),
    )


# --------------------------------------------------------------------------- running an implementation


def junk_like(n: int, dtype: torch.dtype, device, seed: int) -> torch.Tensor:
    """A stale buffer: random values, -1 and plausible slots among them."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-5, 10**6, (n,), generator=gen, dtype=dtype).to(device)


def run_slot_mapping(impl: str, c: Case, rank: int, device=DEVICE, table: torch.Tensor | None = None) -> torch.Tensor:
    """One rank's slot mapping into a junk-filled buffer view; nothing past the view is written."""
    table = (c.tables[rank] if table is None else table).to(device)
    qsl = torch.tensor(c.query_start_loc, dtype=torch.int32, device=device)
    positions = torch.tensor(c.positions, dtype=torch.int64, device=device)
    T = len(c.positions)
    buf = junk_like(T + GUARD, torch.int64, device, seed=rank)
    guard = buf[T:].clone()
    fn = dcp_slot_mapping if impl == "public" else getattr(dcp, f"dcp_slot_mapping_{impl}")
    fn(table, qsl, positions, c.block_size, c.interleave, c.dcp_size, rank, buf[:T])
    assert torch.equal(buf[T:], guard)
    return buf[:T]


def run_local_seq_lens(impl: str, seq_lens: list[int], interleave: int, dcp_size: int, rank: int,
                       device=DEVICE) -> torch.Tensor:
    R = len(seq_lens)
    buf = junk_like(R + GUARD, torch.int32, device, seed=rank + 1)
    guard = buf[R:].clone()
    fn = dcp_local_seq_lens if impl == "public" else getattr(dcp, f"dcp_local_seq_lens_{impl}")
    fn(torch.tensor(seq_lens, dtype=torch.int32, device=device), interleave, dcp_size, rank, buf[:R])
    assert torch.equal(buf[R:], guard)
    return buf[:R]


# --------------------------------------------------------------------------- against the brute force


@pytest.mark.parametrize("impl", IMPLS)
@settings(deadline=None)
@given(c=cases())
def test_slot_mapping_matches_loop(impl, c: Case):
    device = DEVICE if impl == "triton" else "cpu"
    for rank in range(c.dcp_size):
        assert run_slot_mapping(impl, c, rank, device).tolist() == loop_slot_mapping(c, rank), rank


@pytest.mark.parametrize("impl", IMPLS)
@settings(deadline=None)
@given(c=cases())
def test_local_seq_lens_match_loop(impl, c: Case):
    device = DEVICE if impl == "triton" else "cpu"
    for rank in range(c.dcp_size):
        got = run_local_seq_lens(impl, c.seq_lens, c.interleave, c.dcp_size, rank, device)
        assert got.tolist() == [loop_local_len(n, c.interleave, c.dcp_size, rank) for n in c.seq_lens], rank


@needs_triton
@settings(deadline=None)
@given(c=cases())
def test_triton_matches_torch_bit_for_bit(c: Case):
    for rank in range(c.dcp_size):
        ref = run_slot_mapping("torch", c, rank, DEVICE)
        assert torch.equal(run_slot_mapping("triton", c, rank, DEVICE), ref)
        ref_lens = run_local_seq_lens("torch", c.seq_lens, c.interleave, c.dcp_size, rank, DEVICE)
        assert torch.equal(run_local_seq_lens("triton", c.seq_lens, c.interleave, c.dcp_size, rank, DEVICE), ref_lens)


# --------------------------------------------------------------------------- properties over all ranks


@settings(deadline=None)
@given(c=cases())
def test_every_real_token_has_exactly_one_slot_and_ranks_never_collide(c: Case):
    slots = torch.stack([run_slot_mapping("public", c, r).cpu() for r in range(c.dcp_size)])  # [D, T]
    real = c.num_real_tokens
    assert ((slots[:, :real] >= 0).sum(0) == 1).all()  # exactly one owner per real token ...
    assert ((slots[:, :real] >= 0) | (slots[:, :real] == -1)).all()  # ... and -1 on the other ranks
    assert (slots[:, real:] == -1).all()  # padded tokens: -1 on every rank
    for r in range(c.dcp_size):  # a rank's blocks are disjoint across entries: its slots are distinct
        mine = slots[r][slots[r] >= 0]
        assert mine.unique().numel() == mine.numel()
    lens = torch.stack([run_local_seq_lens("public", c.seq_lens, c.interleave, c.dcp_size, r).cpu()
                        for r in range(c.dcp_size)])
    assert lens.sum(0).tolist() == c.seq_lens


@settings(deadline=None)
@given(seq_len=st.integers(1, 400), interleave=st.sampled_from([1, 2, 3, 8, 16]), dcp_size=st.integers(1, 4))
def test_local_positions_are_dense_and_fit_the_capacity(seq_len, interleave, dcp_size):
    """All positions of one request, block size 1 and an identity table, so slot == local position:
    each rank's slots are exactly 0 .. local_len - 1, and the capacity is the largest local_len."""
    cap = dcp_local_capacity(seq_len, interleave, dcp_size)
    c = Case(1, interleave, dcp_size, [seq_len], [0, seq_len], list(range(seq_len)),
             [torch.arange(cap, dtype=torch.int32).view(1, cap)] * dcp_size)
    lens = []
    for rank in range(dcp_size):
        slots = run_slot_mapping("public", c, rank)
        (local_len,) = run_local_seq_lens("public", [seq_len], interleave, dcp_size, rank).tolist()
        assert sorted(slots[slots >= 0].tolist()) == list(range(local_len))
        lens.append(local_len)
    assert cap == max(lens) == lens[0]


@settings(deadline=None)
@given(seq_len=st.integers(0, 5000), interleave=st.sampled_from([1, 2, 8, 16, 64]), dcp_size=st.integers(1, 8))
def test_capacity_ceil_rule(seq_len, interleave, dcp_size):
    cap = dcp_local_capacity(seq_len, interleave, dcp_size)
    span = interleave * dcp_size
    ceil_d = -(-seq_len // dcp_size)
    assert cap == max(loop_local_len(seq_len, interleave, dcp_size, r) for r in range(dcp_size))
    assert cap * dcp_size >= seq_len and ceil_d <= cap <= -(-seq_len // span) * interleave
    assert cap - ceil_d < interleave
    if interleave == 1:
        assert cap == ceil_d
    if dcp_size == 1:
        assert cap == seq_len


@pytest.mark.parametrize("impl", IMPLS)
@settings(deadline=None)
@given(c=cases(dcp_size=1))
def test_dcp_size_one_is_the_ordinary_slot_mapping(impl, c: Case):
    device = DEVICE if impl == "triton" else "cpu"
    T = len(c.positions)
    ref = torch.empty(T, dtype=torch.int64, device=device)
    getattr(bt, f"compute_slot_mapping_{impl}")(
        c.tables[0].to(device),
        torch.tensor(c.query_start_loc, dtype=torch.int32, device=device),
        torch.tensor(c.positions, dtype=torch.int64, device=device),
        c.block_size,
        ref,
    )
    assert torch.equal(run_slot_mapping(impl, c, 0, device), ref)
    lens = run_local_seq_lens(impl, c.seq_lens, c.interleave, 1, 0, device)
    assert lens.tolist() == c.seq_lens


def test_docstring_example():
    # D = 2, I = 2, block size 1, identity tables: the slot is the local position.
    c = Case(1, 2, 2, [9], [0, 9], list(range(9)), [torch.arange(5, dtype=torch.int32).view(1, 5)] * 2)
    assert run_slot_mapping("public", c, 0).tolist() == [0, 1, -1, -1, 2, 3, -1, -1, 4]
    assert run_slot_mapping("public", c, 1).tolist() == [-1, -1, 0, 1, -1, -1, 2, 3, -1]
    assert [run_local_seq_lens("public", [9], 2, 2, r).item() for r in (0, 1)] == [5, 4]


def test_public_api_validation():
    c = make_case(random.Random(5), 3, 12, 4, 2, 2, 40)
    table, T = c.tables[0], len(c.positions)
    qsl = torch.tensor(c.query_start_loc, dtype=torch.int32)
    positions = torch.tensor(c.positions, dtype=torch.int64)
    out = torch.empty(T, dtype=torch.int64)
    seq_lens = torch.tensor(c.seq_lens, dtype=torch.int32)
    lens_out = torch.empty(3, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"dcp_rank=2 is out of range \[0, 2\)"):
        dcp_slot_mapping(table, qsl, positions, 4, 2, 2, 2, out)
    with pytest.raises(ValueError, match=r"dcp_rank=-1 is out of range \[0, 3\)"):
        dcp_local_seq_lens(seq_lens, 2, 3, -1, lens_out)
    with pytest.raises(ValueError, match=r"interleave=0 \(cp_kv_cache_interleave_size\) must be positive"):
        dcp_slot_mapping(table, qsl, positions, 4, 0, 2, 0, out)
    with pytest.raises(ValueError, match="dcp_size=0 must be positive"):
        dcp_local_seq_lens(seq_lens, 2, 0, 0, lens_out)
    with pytest.raises(ValueError, match="block_size=0 must be positive"):
        dcp_slot_mapping(table, qsl, positions, 0, 2, 2, 0, out)
    with pytest.raises(ValueError, match="positions has dtype torch.int32"):
        dcp_slot_mapping(table, qsl, positions.int(), 4, 2, 2, 0, out)
    with pytest.raises(ValueError, match=rf"positions has shape \({T},\), expected \({T - 1},\)"):
        dcp_slot_mapping(table, qsl, positions, 4, 2, 2, 0, out[:-1])
    with pytest.raises(ValueError, match=r"query_start_loc has shape \(3,\), expected \(4,\)"):
        dcp_slot_mapping(table, qsl[:-1], positions, 4, 2, 2, 0, out)
    with pytest.raises(ValueError, match=r"out has shape \(2,\), expected \(3,\)"):
        dcp_local_seq_lens(seq_lens, 2, 2, 0, lens_out[:2])
    with pytest.raises(ValueError, match="seq_lens has dtype torch.int64"):
        dcp_local_seq_lens(seq_lens.long(), 2, 2, 0, lens_out)
    with pytest.raises(ValueError, match=r"num_tokens=-1 must be non-negative"):
        dcp_local_capacity(-1, 2, 2)
    with pytest.raises(ValueError, match="interleave=0"):
        dcp_local_capacity(10, 0, 2)
    # Valid calls dispatch (torch on CPU) and match the loops.
    dcp_slot_mapping(table, qsl, positions, 4, 2, 2, 0, out)
    assert out.tolist() == loop_slot_mapping(c, 0)
    dcp_local_seq_lens(seq_lens, 2, 2, 1, lens_out)
    assert lens_out.tolist() == [loop_local_len(n, 2, 2, 1) for n in c.seq_lens]


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@settings(deadline=None)
@given(
    seed=st.integers(0, 2**30),
    num_reqs=st.sampled_from([1, 16, 128, 512]),
    num_tokens=st.sampled_from([512, 2048, 8192]),
    block_size=st.sampled_from([16, 64]),
    interleave=st.sampled_from([1, 16, None]),
    dcp_size=st.integers(1, 8),
)
def test_gpu_triton_matches_torch_large(seed, num_reqs, num_tokens, block_size, interleave, dcp_size):
    # max_model_len 32k: per-rank tables of up to 2048 columns, R_pad up to 512, T_pad up to 8192.
    c = make_case(random.Random(seed), num_reqs, num_tokens, block_size, interleave, dcp_size, 32768)
    for rank in sorted({0, dcp_size - 1, dcp_size // 2}):
        ref = run_slot_mapping("torch", c, rank, "cuda")
        got = run_slot_mapping("triton", c, rank, "cuda")
        assert torch.equal(got, ref), rank
        assert (got[c.num_real_tokens:] == -1).all()
        ref_lens = run_local_seq_lens("torch", c.seq_lens, c.interleave, dcp_size, rank, "cuda")
        got_lens = run_local_seq_lens("triton", c.seq_lens, c.interleave, dcp_size, rank, "cuda")
        assert torch.equal(got_lens, ref_lens), rank


@pytest.mark.gpu
@pytest.mark.parametrize("block_size, interleave, dcp_size", [(16, 16, 2), (16, 1, 3), (4, 8, 4)])
def test_gpu_cuda_graph_capture_and_replay(block_size, interleave, dcp_size):
    """Capture both kernels of every rank once over static buffers; replay after rewriting the
    inputs in place; the outputs (junk before each replay) match eager torch on fresh copies."""
    dev = torch.device("cuda")
    R_pad, T_pad, max_len = 64, 1024, 4096
    rng = random.Random(0)
    first = make_case(rng, R_pad, T_pad, block_size, interleave, dcp_size, max_len)
    M = -(-dcp_local_capacity(max_len, interleave, dcp_size) // block_size) + 1  # make_case's widest table
    qsl_buf = torch.zeros(R_pad + 1, dtype=torch.int32, device=dev)
    pos_buf = torch.zeros(T_pad, dtype=torch.int64, device=dev)
    seq_lens_buf = torch.zeros(R_pad, dtype=torch.int32, device=dev)
    table_bufs = [torch.zeros(R_pad, M, dtype=torch.int32, device=dev) for _ in range(dcp_size)]
    slot_outs = [torch.empty(T_pad, dtype=torch.int64, device=dev) for _ in range(dcp_size)]
    lens_outs = [torch.empty(R_pad, dtype=torch.int32, device=dev) for _ in range(dcp_size)]

    def upload(c: Case) -> None:
        qsl_buf.copy_(torch.tensor(c.query_start_loc, dtype=torch.int32))
        pos_buf.copy_(torch.tensor(c.positions, dtype=torch.int64))
        seq_lens_buf.copy_(torch.tensor(c.seq_lens, dtype=torch.int32))
        for r in range(dcp_size):
            table_bufs[r][:, : c.tables[r].shape[1]].copy_(c.tables[r])

    def step() -> None:
        for r in range(dcp_size):
            dcp_slot_mapping(table_bufs[r], qsl_buf, pos_buf, block_size, interleave, dcp_size, r, slot_outs[r])
            dcp_local_seq_lens(seq_lens_buf, interleave, dcp_size, r, lens_outs[r])

    upload(first)
    graph = capture_cuda_graph(step)  # warmed up (the Triton kernels compiled) on a side stream first

    for _ in range(6):
        c = make_case(rng, R_pad, T_pad, block_size, interleave, dcp_size, max_len)
        upload(c)
        for o in (*slot_outs, *lens_outs):
            o.fill_(-7777)
        graph.replay()
        torch.cuda.synchronize()
        for r in range(dcp_size):
            ref = torch.empty(T_pad, dtype=torch.int64, device=dev)
            dcp.dcp_slot_mapping_torch(table_bufs[r].clone(), qsl_buf.clone(), pos_buf.clone(), block_size,
                                       interleave, dcp_size, r, ref)
            assert torch.equal(slot_outs[r], ref), r
            ref_lens = torch.empty(R_pad, dtype=torch.int32, device=dev)
            dcp.dcp_local_seq_lens_torch(seq_lens_buf.clone(), interleave, dcp_size, r, ref_lens)
            assert torch.equal(lens_outs[r], ref_lens), r
        assert ((torch.stack(slot_outs)[:, : c.num_real_tokens] >= 0).sum(0) == 1).all()
        assert (torch.stack(lens_outs).sum(0).cpu() == torch.tensor(c.seq_lens, dtype=torch.int32)).all()
