"""The LoRA kernels (graphrunner.layers.lora.kernels) against an independent per-row reference.

- `lora_reference` (the torch path and the kernels' specification) against a plain per-token loop.
- `lora_shrink_expand` (Triton; interpreted on a CPU) against `lora_reference` over ranks, slots,
  slices and row mixes, with the slot metadata built by `LoraBuffers.upload` (rows grouped by slot,
  padding rows in no slot): rows without an adapter keep the base output bit for bit.
- GPU (`gpu` mark): bf16 and fp16 natively at Llama-3.1-8B shapes, and a CUDA graph captured once
  and replayed over new adapter mixes equals eager.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.kernels import HAS_TRITON
from graphrunner.layers.lora.kernels import lora_k_splits, lora_reference, lora_shrink_expand
from graphrunner.layers.lora.weights import LoraBuffers

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def _naive(x, out, a, b, token_slot, slices):
    """Per token row, per slice: out += (x A^T) B^T in fp64 (the definition, no masking, no grouping)."""
    res = out.double().clone()
    R = a.shape[2]
    for t, s in enumerate(token_slot.tolist()):
        if s < 0:
            continue
        for i, (off, size) in enumerate(slices):
            h = x[t].double() @ a[s, i].double().t()
            res[t, off:off + size] += h[:R] @ b[s, off:off + size].double().t()
    return res


def _case(num_tokens, num_slots, slice_sizes, rank, in_features, ranks, seed, dtype=torch.float32, device="cpu"):
    """x, out, A, B (slot s of rank ranks[s] zero-padded to `rank`), the slices."""
    g = torch.Generator().manual_seed(seed)
    slices, off = [], 0
    for size in slice_sizes:
        slices.append((off, size))
        off += size
    x = torch.randn(num_tokens, in_features, generator=g)
    out = torch.randn(num_tokens, off, generator=g)
    a = torch.zeros(num_slots, len(slices), rank, in_features)
    b = torch.zeros(num_slots, off, rank)
    for s, r in enumerate(ranks):
        a[s, :, :r] = torch.randn(len(slices), r, in_features, generator=g) / in_features**0.5
        b[s, :, :r] = torch.randn(off, r, generator=g) / r**0.5
    return [t.to(device=device, dtype=dtype) for t in (x, out, a, b)], slices


cases = st.fixed_dictionaries({
    "reqs": st.lists(st.tuples(st.integers(1, 9), st.integers(-1, 3)), min_size=1, max_size=10),  # (tokens, slot)
    "pad": st.integers(0, 5),
    "num_slots": st.integers(1, 4),
    "slice_sizes": st.lists(st.sampled_from([8, 16, 24, 40]), min_size=1, max_size=3),
    "rank": st.sampled_from([8, 16]),
    "in_features": st.sampled_from([16, 40, 64, 1100, 4200]),  # the shrink splits 1100 in 3 at decode, 4200 in 2 above
    "seed": st.integers(0, 2**16),
})


def _metadata(reqs, pad, num_slots):
    lens = np.array([n for n, _ in reqs], dtype=np.int32)
    slots = np.array([min(s, num_slots - 1) for _, s in reqs], dtype=np.int32)
    T = int(lens.sum()) + pad
    buffers = LoraBuffers(num_slots, T + 4, torch.device("cpu"))
    buffers.upload(slots, lens, T)
    return buffers, T


@given(cases)
def test_reference_matches_the_definition(case):
    buffers, T = _metadata(case["reqs"], case["pad"], case["num_slots"])
    g = np.random.default_rng(case["seed"])
    ranks = [int(g.integers(1, case["rank"] + 1)) for _ in range(case["num_slots"])]
    (x, out, a, b), slices = _case(T, case["num_slots"], case["slice_sizes"], case["rank"], case["in_features"],
                                   ranks, case["seed"])
    token_slot = buffers.token_slot[:T]
    expected = _naive(x, out, a, b, token_slot, slices)
    got = out.clone()
    lora_reference(x, got, a, b, token_slot, slices)
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)
    base = token_slot < 0
    assert torch.equal(got[base], out[base])


@needs_triton
@given(cases)
def test_kernels_match_the_reference(case):
    buffers, T = _metadata(case["reqs"], case["pad"], case["num_slots"])
    g = np.random.default_rng(case["seed"])
    ranks = [int(g.integers(1, case["rank"] + 1)) for _ in range(case["num_slots"])]
    (x, out, a, b), slices = _case(T, case["num_slots"], case["slice_sizes"], case["rank"], case["in_features"],
                                   ranks, case["seed"])
    expected = out.clone()
    lora_reference(x, expected, a, b, buffers.token_slot[:T], slices)
    got = out.clone()
    table = torch.tensor(slices, dtype=torch.int32)
    lora_shrink_expand(x, got, a, b, buffers.sorted_tokens[:T], buffers.starts, table, max(s for _, s in slices))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    base = buffers.token_slot[:T] < 0
    assert torch.equal(got[base], out[base])  # rows without an adapter: untouched


@needs_triton
@given(cases)
def test_projection_with_adapters_matches_the_reference_at_every_row_count(case):
    """`graphrunner::lora_linear`, the op a projection with adapters runs under the one-row GEMV: one
    row reads every slot's A in the GEMV's launch and expands its own slot's h; several rows run the
    GEMM, the shrink and the expand. Both equal x W^T plus the reference's adapters."""
    import graphrunner.layers.lora.weights  # noqa: F401  (registers the op)

    for reqs in ([(1, case["reqs"][0][1])], case["reqs"]):  # one row, then the drawn mix
        buffers, T = _metadata(reqs, 0 if len(reqs) == 1 else case["pad"], case["num_slots"])
        g = np.random.default_rng(case["seed"])
        ranks = [int(g.integers(1, case["rank"] + 1)) for _ in range(case["num_slots"])]
        (x, _, a, b), slices = _case(T, case["num_slots"], case["slice_sizes"], case["rank"], case["in_features"],
                                     ranks, case["seed"])
        g = torch.Generator().manual_seed(case["seed"])
        weight = torch.randn(b.shape[1], x.shape[1], generator=g)
        bias = torch.randn(b.shape[1], generator=g) if case["seed"] % 2 else None  # added to W's rows only
        expected = x @ weight.t() + (0 if bias is None else bias)
        lora_reference(x, expected, a, b, buffers.token_slot[:T], slices)
        got = torch.ops.graphrunner.lora_linear(x, weight, bias, a, b, buffers.sorted_tokens, buffers.starts,
                                                torch.tensor(slices, dtype=torch.int32),
                                                max(size for _, size in slices), (4, 64, 4), 0)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@needs_triton
def test_kernels_match_the_reference_at_prefill_size():
    """Above 512 tokens: 64-row blocks, a slot over several of them, an empty slot between two full
    ones, base rows between adapters' rows, K split in 2."""
    reqs = [(300, 2), (40, -1), (150, 0), (129, 2), (20, -1)]
    buffers, T = _metadata(reqs, 7, 4)
    (x, out, a, b), slices = _case(T, 4, [24, 40], 16, 4200, [16, 4, 9, 16], 5)
    assert lora_k_splits(T, 4200) == 2
    expected = out.clone()
    lora_reference(x, expected, a, b, buffers.token_slot[:T], slices)
    got = out.clone()
    lora_shrink_expand(x, got, a, b, buffers.sorted_tokens[:T], buffers.starts, torch.tensor(slices, dtype=torch.int32),
                       40)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_decode_splits_k_finely_and_prefill_only_a_wide_k():
    assert lora_k_splits(1, 2048) == 4 and lora_k_splits(64, 4096) == 8 and lora_k_splits(16, 300) == 1
    assert lora_k_splits(65, 14336) == 4 and lora_k_splits(2048, 4096) == 1 and lora_k_splits(1, 14336) == 8


def test_upload_groups_rows_by_slot():
    buffers = LoraBuffers(3, 16, torch.device("cpu"))
    # requests: 2 tokens slot 1, 3 tokens none, 1 token slot 0, 2 tokens slot 1; 2 padding rows
    buffers.upload(np.array([1, -1, 0, 1], dtype=np.int32), np.array([2, 3, 1, 2], dtype=np.int32), 10)
    assert buffers.token_slot[:10].tolist() == [1, 1, -1, -1, -1, 0, 1, 1, -1, -1]
    starts = buffers.starts.tolist()
    assert starts == [3, 4, 8, 8]
    rows = buffers.sorted_tokens[:8].tolist()
    assert sorted(rows[:3]) == [2, 3, 4] and rows[3:4] == [5] and rows[4:8] == [0, 1, 6, 7]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 16, 64, 256, 1024])
@pytest.mark.parametrize("projection", ["qkv", "down"])
def test_kernels_native_dtypes_gpu(dtype, num_tokens, projection):
    """Llama-3.1-8B's q|k|v (4096 -> 4096 + 1024 + 1024) or down (14336 -> 4096, K split above 64 tokens
    too) at rank 16, 8 slots, a row mix with base rows."""
    in_features, sizes = (4096, [4096, 1024, 1024]) if projection == "qkv" else (14336, [4096])
    g = np.random.default_rng(num_tokens)
    slots = g.integers(-1, 8, size=num_tokens).astype(np.int32)
    buffers = LoraBuffers(8, 1024, torch.device("cuda"))
    buffers.upload(slots, np.ones(num_tokens, dtype=np.int32), num_tokens)
    (x, out, a, b), slices = _case(num_tokens, 8, sizes, 16, in_features, [16] * 8, num_tokens, dtype=dtype,
                                   device="cuda")
    expected = out.clone()
    lora_reference(x, expected, a, b, buffers.token_slot[:num_tokens], slices)
    got = out.clone()
    table = torch.tensor(slices, dtype=torch.int32, device="cuda")
    lora_shrink_expand(x, got, a, b, buffers.sorted_tokens[:num_tokens], buffers.starts, table, 4096)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    base = torch.from_numpy(slots).cuda() < 0
    assert torch.equal(got[base], out[base])


@pytest.mark.gpu
def test_graph_replay_over_new_mixes_gpu():
    """Captured once at T=64 with no adapter rows; replayed with new slot mixes, it equals eager."""
    T = 64
    buffers = LoraBuffers(4, T, torch.device("cuda"))
    (x, out, a, b), slices = _case(T, 4, [256, 128], 16, 512, [16, 8, 4, 2], 0, dtype=torch.bfloat16, device="cuda")
    table = torch.tensor(slices, dtype=torch.int32, device="cuda")
    work = out.clone()
    buffers.clear(T)

    def step():
        work.copy_(out)
        lora_shrink_expand(x, work, a, b, buffers.sorted_tokens[:T], buffers.starts, table, 256)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    g = np.random.default_rng(1)
    for _ in range(5):
        slots = g.integers(-1, 4, size=8).astype(np.int32)
        lens = g.multinomial(T - 8, [1 / 8] * 8).astype(np.int32) + 1
        buffers.upload(slots, lens, T)
        graph.replay()
        expected = out.clone()
        lora_shrink_expand(x, expected, a, b, buffers.sorted_tokens[:T], buffers.starts, table, 256)
        torch.testing.assert_close(work, expected, atol=0, rtol=0)
