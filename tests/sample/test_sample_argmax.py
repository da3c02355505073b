"""argmax_rows against torch.argmax, exactly (Triton under TRITON_INTERPRET=1 on CPU).

Rows mix what an argmax can get wrong: ties of the max (small-integer logits, bf16
rounding), NaN (torch picks the first), +inf, -inf, rows of only -inf (index 0) or
only NaN, -0.0 against 0.0. Blocks and chunk counts are forced small, so that several
chunks of several blocks run per row and the row's last block is partial.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.kernels import HAS_TRITON
from graphrunner.protocol import SamplingParams
from graphrunner.sample import argmax as argmax_module
from graphrunner.sample.argmax import argmax_rows, argmax_rows_triton, chunk_plan
from tests.sample.test_sampler import make_states, run_sampler

pytestmark = [
    pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable"),
    # The Triton interpreter converts 1-element arrays to ints (numpy >= 1.25 warns, per call).
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]

NAN, INF = float("nan"), float("inf")
KINDS = ("randn", "ties", "nan", "pos_inf", "neg_inf", "all_neg_inf", "all_nan", "signed_zeros")


def _logits(seed: int, kinds: list[str], vocab: int, device="cpu") -> torch.Tensor:  # [R, V] float32
    """One row per kind; the injections land at a few random positions (possibly in ties)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(len(kinds), vocab, generator=g, device=device)
    for r, kind in enumerate(kinds):
        hit = torch.rand(vocab, generator=g, device=device) < 3.0 / vocab  # ~3 positions (maybe none)
        if kind != "randn":
            x[r] = torch.randint(-2, 3, (vocab,), generator=g, device=device).float()  # many ties of the max
        if kind in ("nan", "pos_inf", "neg_inf"):
            x[r, hit] = {"nan": NAN, "pos_inf": INF, "neg_inf": -INF}[kind]
        elif kind in ("all_neg_inf", "all_nan"):
            x[r] = -INF if kind == "all_neg_inf" else NAN
        elif kind == "signed_zeros":
            x[r] = torch.where(hit, 0.0, -0.0) - (x[r] < 0).float()  # max is 0 (-0.0 or 0.0), first wins
    return x


@given(
    seed=st.integers(0, 2**31),
    kinds=st.lists(st.sampled_from(KINDS), min_size=0, max_size=5),
    vocab=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    block=st.sampled_from([16, 32, 64, None]),
    num_chunks=st.sampled_from([None, 1, 2, 3, 5]),
    pad=st.sampled_from([0, 3]),
    out_dtype=st.sampled_from([None, torch.int32, torch.int64]),
)
def test_matches_torch_argmax(seed, kinds, vocab, dtype, block, num_chunks, pad, out_dtype):
    wide = _logits(seed, kinds, vocab + pad).to(dtype)
    x = wide[:, :vocab]  # pad > 0: a row stride other than V
    out = None if out_dtype is None else torch.full((len(kinds),), -1, dtype=out_dtype)
    got = argmax_rows_triton(x, out=out, block=block, num_chunks=num_chunks)
    want = torch.argmax(x, dim=-1)
    assert got.dtype == (out_dtype or torch.int64) and (out is None or got is out)
    assert torch.equal(got.long(), want), (got.tolist(), want.tolist())


def test_edge_rows_across_chunk_boundaries():
    # V = 100 with block 16 and 3 chunks: chunks [0, 48), [48, 96), [96, 100) (partial block).
    assert chunk_plan(10, 100, 132, block=16, num_chunks=3).chunk == 48
    x = torch.randn(10, 100)
    x[0, [50, 97]] = 100.0  # tie of the max across chunks: the first
    x[1, 99] = 100.0  # max in the last, partial block
    x[2, 5], x[2, 70] = 100.0, NAN  # NaN after the max: the NaN
    x[3, [90, 60]] = NAN  # NaNs in two chunks: the first
    x[4, 10], x[4, 90] = INF, NAN  # NaN beats +inf
    x[5] = -INF  # all -inf: 0
    x[6] = -INF
    x[6, 99] = 3.0  # one finite value at the very end
    x[7] = 0.0
    x[7, :60] = -0.0  # -0.0 == 0.0: the first
    x[8] = NAN  # all NaN: the first
    x[9, [70, 20]] = INF  # +inf ties: the first
    want = [50, 99, 70, 60, 90, 0, 99, 0, 0, 20]
    assert torch.argmax(x, dim=-1).tolist() == want
    for block, num_chunks in [(16, 3), (16, 7), (32, 2), (64, 1), (None, None)]:
        assert argmax_rows_triton(x, block=block, num_chunks=num_chunks).tolist() == want, (block, num_chunks)


@pytest.mark.parametrize("mode", ["last_program", "over_capacity"])
def test_combine_paths_agree_and_leave_the_counters_at_zero(monkeypatch, mode):
    """The last-arriving program combines in the launch (no second kernel); a batch over the
    counters' capacity falls back to the combine kernel; one-chunk rows never need it."""
    if mode == "over_capacity":
        monkeypatch.setattr(argmax_module, "_COUNTER_CAPACITY", 4)
    monkeypatch.setattr(argmax_module, "_COUNTERS", {})
    kernels = []
    real = argmax_module.combine_partials
    monkeypatch.setattr(argmax_module, "combine_partials", lambda *a: kernels.append(1) or real(*a))
    x = _logits(5, list(KINDS) * 2, 150)  # [16, 150]
    want = torch.argmax(x, dim=-1)
    for block, num_chunks in [(16, 3), (16, 10), (32, 2), (64, 1), (None, None)]:
        kernels.clear()
        out = torch.full((x.shape[0],), -1, dtype=torch.int32)
        assert torch.equal(argmax_rows_triton(x, out=out, block=block, num_chunks=num_chunks).long(), want)
        chunks = chunk_plan(x.shape[0], 150, 2, block=block, num_chunks=num_chunks).num_chunks
        assert kernels == ([1] if chunks > 1 and mode != "last_program" else []), (block, num_chunks)
        counters = argmax_module._COUNTERS.get(x.device)
        assert (counters is None) == (mode != "last_program") and (counters is None or not counters.any())


@given(
    rows=st.integers(1, 4096),
    vocab=st.integers(1, 300_000),
    num_sms=st.integers(1, 200),
    block=st.sampled_from([None, 16, 1024]),
    num_chunks=st.sampled_from([None, 1, 4, 5000]),
)
def test_chunk_plan_covers_the_row_with_whole_nonempty_chunks(rows, vocab, num_sms, block, num_chunks):
    plan = chunk_plan(rows, vocab, num_sms, block=block, num_chunks=num_chunks)
    assert plan.chunk % plan.block == 0 and plan.block & (plan.block - 1) == 0
    assert (plan.num_chunks - 1) * plan.chunk < vocab <= plan.num_chunks * plan.chunk  # none empty, all covered
    assert 1 <= plan.num_chunks <= argmax_module.MAX_CHUNKS
    if num_chunks is None and plan.num_chunks > 1:
        assert plan.chunk >= argmax_module._MIN_CHUNK


def test_chunk_plan_at_the_issue_shape():
    # H100 / H200 (132 SMs), 151,936 fp32 logits: >= 2 programs per SM at every batch size; one wave
    # keeps R x C within the resident programs (4 per SM) wherever a row has more than one chunk.
    assert chunk_plan(256, 151936, 132) == argmax_module.ChunkPlan(block=2048, chunk=51200, num_chunks=3)
    assert chunk_plan(256, 151936, 132, one_wave=True) == argmax_module.ChunkPlan(2048, 77824, 2)
    assert chunk_plan(64, 151936, 132, one_wave=True).num_chunks == 8
    for rows in (1, 8, 64, 100, 256, 600):
        plan = chunk_plan(rows, 151936, 132, one_wave=True)
        assert rows * plan.num_chunks >= 2 * 132 or plan.chunk < 2 * argmax_module._MIN_CHUNK, (rows, plan)
        assert plan.num_chunks == 1 or rows * plan.num_chunks <= 4 * 132, (rows, plan)


def test_partial_kernel_warps_at_the_issue_shape():
    # 16 warps where each program streams a long chunk (256 and 64 rows), 8 where chunks are two blocks
    # (one row: 37 chunks), never more warps than a block has 4-element slices (small test blocks).
    plan_of = lambda rows: chunk_plan(rows, 151936, 132, one_wave=True)  # noqa: E731
    assert argmax_module.partial_num_warps(plan_of(256)) == 16
    assert argmax_module.partial_num_warps(plan_of(64)) == 16
    assert argmax_module.partial_num_warps(plan_of(1)) == 8
    assert argmax_module.partial_num_warps(chunk_plan(2, 5000, 2, block=64, num_chunks=1)) == 1
    for rows, vocab, block in ((3, 300, 16), (5, 40000, 256), (256, 151936, 2048)):
        plan = chunk_plan(rows, vocab, 132, block=block, one_wave=True)
        assert 1 <= argmax_module.partial_num_warps(plan) <= max(1, block // (32 * 4)), (rows, vocab, block)


def test_empty_batch_and_bad_arguments():
    assert argmax_rows_triton(torch.empty(0, 7)).shape == (0,)
    assert argmax_rows_triton(torch.empty(0, 7), out=torch.empty(0, dtype=torch.int32)).dtype == torch.int32
    assert argmax_rows(torch.empty(0, 7)).shape == (0,)
    with pytest.raises(ValueError, match="expected"):
        argmax_rows_triton(torch.empty(3, 0))
    with pytest.raises(ValueError, match="dtype"):
        argmax_rows_triton(torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="unit stride"):
        argmax_rows_triton(torch.randn(8, 3).t())
    with pytest.raises(ValueError, match="power of two"):
        argmax_rows_triton(torch.randn(3, 8), block=24)
    with pytest.raises(ValueError, match="dtype"):
        argmax_rows_triton(torch.randn(3, 8), out=torch.empty(3, dtype=torch.float32))
    with pytest.raises(ValueError, match="contiguous"):
        argmax_rows_triton(torch.randn(3, 8), out=torch.empty(6, dtype=torch.int64)[::2])


def test_dispatch_is_torch_argmax_off_cuda():
    x = _logits(1, list(KINDS), 50)
    want = torch.argmax(x, dim=-1)
    assert torch.equal(argmax_rows(x), want)  # CPU: torch.argmax itself
    out = torch.full((2 * len(KINDS),), -1, dtype=torch.int32)[::2]  # a strided out is written in place
    assert argmax_rows(x, out=out) is out and torch.equal(out.long(), want)
    assert torch.equal(argmax_rows(x.double()), want)


def test_sampler_greedy_rows_go_through_argmax_rows(monkeypatch):
    calls = []

    def spy(x, **kwargs):
        calls.append(tuple(x.shape))
        return argmax_rows(x, **kwargs)

    monkeypatch.setattr("graphrunner.sample.sampler.argmax_rows", spy)
    vocab = 40
    logits = _logits(2, ["ties", "nan", "all_neg_inf"], vocab)
    greedy = make_states([SamplingParams(temperature=0.0)] * 3, vocab)
    out = run_sampler(greedy, logits, [0, 1, 2], [5] * 3)  # the greedy-only pipeline
    assert calls == [(3, vocab)] and torch.equal(out.long(), torch.argmax(logits, dim=-1))
    mixed = make_states([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)] * 2, vocab)
    out = run_sampler(mixed, logits[[0, 0, 1, 2]], [0, 1, 2, 3], [5] * 4)  # greedy rows of a random batch
    assert calls[1:] == [(4, vocab)] and out[[0, 2]].tolist() == torch.argmax(logits[[0, 1]], dim=-1).tolist()


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("capacity", ["in_launch", "over_capacity"])
def test_gpu_matches_torch_at_scale_and_replays_in_a_cuda_graph(monkeypatch, capacity):
    if capacity == "over_capacity":  # the second combine kernel
        monkeypatch.setattr(argmax_module, "_COUNTER_CAPACITY", 16)
    monkeypatch.setattr(argmax_module, "_COUNTERS", {})
    rows, vocab = 256, 151936
    kinds = [KINDS[r % len(KINDS)] if r % 3 == 0 else "randn" for r in range(rows)]
    x = _logits(0, kinds, vocab, device="cuda") * 3
    x[1::7, 1000:] = x[1::7, :1].clone()  # long runs tied with an early value: first index across chunks
    assert argmax_module.use_triton(x)
    for n in (1, 7, 64, rows):
        assert torch.equal(argmax_rows(x[:n]), torch.argmax(x[:n], dim=-1)), n
    assert torch.equal(argmax_rows(x.bfloat16()), torch.argmax(x.bfloat16(), dim=-1))
    assert torch.equal(argmax_rows_triton(x, num_chunks=1), torch.argmax(x, dim=-1))  # one launch, no partials

    out = torch.empty(rows, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile before capture
        argmax_rows(x, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        argmax_rows(x, out=out)
    for seed in (1, 2):
        x.copy_(_logits(seed, kinds[::-1], vocab, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.long(), torch.argmax(x, dim=-1)), seed
    counters = argmax_module._COUNTERS.get(x.device)
    assert counters is not None and not counters.any()  # the last programs combined and reset them

