"""Attention over a DCP-sharded KV cache: per-rank partial attention merged = attention over the whole cache.

Each rank of a simulated DCP group holds its interleaved share of every sequence (the layout
of graphrunner.kernels.dcp) in its own paged cache with its own block table; the paged
kernels attend with `dcp=(size, rank, interleave)` and global `seq_lens`, masking keys by
global position; `merge_attention_states` of the ranks' (output, LSE) must equal the plain
kernel over the unsharded cache, for decodes, verification-sized queries and prefill chunks
(queries that see no key on a rank included). The reference is the torch backend over the
whole cache; the Triton kernel runs interpreted on CPU (conftest) and natively on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.attention import AttentionMetadata
from graphrunner.attention.merge import merge_attention_states_torch
from graphrunner.attention.torch_ref import paged_attention_torch
from graphrunner.kernels import HAS_TRITON

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def _metadata(qsl, seq_lens, block_table, device) -> AttentionMetadata:
    n = qsl[-1]
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_table.to(device), slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
        num_reqs=len(seq_lens), num_tokens=n, max_query_len=max(b - a for a, b in zip(qsl, qsl[1:], strict=False)),
        max_seq_len=max(seq_lens),
    )


def _caches(keys, values, seq_lens, size: int, interleave: int, block_size: int, device):
    """One (cache, block_table) per rank holding that rank's share of each sequence, in local order."""
    out = []
    for rank in range(size):
        owned = [[p for p in range(s) if (p // interleave) % size == rank] for s in seq_lens]
        blocks_per_req = [max(1, -(-len(o) // block_size)) for o in owned]
        cols = max(blocks_per_req)
        cache = torch.zeros(2, sum(blocks_per_req) + 1, block_size, KV_HEADS, HEAD_DIM, device=device)
        table = torch.zeros(len(seq_lens), cols, dtype=torch.int32)
        next_block = 1  # block 0 stays empty: a wrong read shows
        for b, positions in enumerate(owned):
            for j in range(blocks_per_req[b]):
                table[b, j] = next_block + j
            for local, p in enumerate(positions):
                blk, off = int(table[b, local // block_size]), local % block_size
                cache[0, blk, off] = keys[b][p]
                cache[1, blk, off] = values[b][p]
            next_block += blocks_per_req[b]
        out.append((cache, table))
    return out


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 3))
    seq_lens = [draw(st.integers(1, 40)) for _ in range(n)]
    query_lens = [draw(st.integers(1, s)) for s in seq_lens]
    return seq_lens, query_lens, draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 4])), draw(st.integers(0, 99))


def _fp8(cache: torch.Tensor, kv_scale: torch.Tensor | None) -> torch.Tensor:
    """The cache quantized as an fp8 KV write stores it (unchanged without scales)."""
    if kv_scale is None:
        return cache
    from graphrunner.attention.torch_ref import quantize_kv_torch

    kv_scale = kv_scale.to(cache.device)
    return torch.stack([quantize_kv_torch(cache[0], kv_scale[0]), quantize_kv_torch(cache[1], kv_scale[1])])


def _check(workload, attend, device, kv_scale: torch.Tensor | None = None) -> None:
    """`kv_scale`: every cache, the reference's too, is fp8 over these scales, and `attend` gets them."""
    seq_lens, query_lens, size, interleave, seed = workload
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(s, KV_HEADS, HEAD_DIM, generator=gen) for s in seq_lens]
    values = [torch.randn(s, KV_HEADS, HEAD_DIM, generator=gen) for s in seq_lens]
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    q = torch.randn(qsl[-1], HEADS, HEAD_DIM, generator=gen).to(device)
    scale = HEAD_DIM**-0.5
    # The reference: every key on one rank (D = 1 is the plain kernel).
    (full_cache, full_table), = _caches(keys, values, seq_lens, 1, 1, 8, "cpu")
    expected = torch.empty_like(q)
    scales = kv_scale.to(device) if kv_scale is not None else None
    paged_attention_torch(q, _fp8(full_cache.to(device), kv_scale), _metadata(qsl, seq_lens, full_table, device),
                          scale, expected, kv_scale=scales)
    outs, lses = [], []
    for rank, (cache, table) in enumerate(_caches(keys, values, seq_lens, size, interleave, 8, device)):
        out, lse = torch.empty_like(q), torch.empty(qsl[-1], HEADS, device=device)
        layout = (size, rank, interleave)
        if kv_scale is None:
            attend(q, cache, _metadata(qsl, seq_lens, table, device), scale, out, lse, layout)
        else:
            attend(q, _fp8(cache, kv_scale), _metadata(qsl, seq_lens, table, device), scale, out, lse, layout, scales)
        outs.append(out)
        lses.append(lse)
    merged = torch.empty_like(q)
    merge_attention_states_torch(torch.stack(outs), torch.stack(lses), merged)
    torch.testing.assert_close(merged, expected, atol=2e-5, rtol=2e-5)


@given(workloads())
def test_torch_reference_sharded_and_merged_equals_whole_cache(workload) -> None:
    _check(workload, lambda *a: paged_attention_torch(*a[:6], dcp=a[6]), "cpu")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@given(workloads())
def test_triton_kernel_sharded_and_merged_equals_whole_cache(workload) -> None:
    from graphrunner.attention.triton_attn import paged_attention_triton

    _check(workload, lambda *a: paged_attention_triton(*a[:6], dcp=a[6]), "cpu")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@given(workloads(), st.sampled_from([(1.0, 1.0), (0.3, 0.05)]))
def test_fp8_cache_sharded_and_merged_equals_whole_cache(workload, scales) -> None:
    """fp8 KV under DCP: each rank dequantizes its share with the layer's scales; merged, that is the
    torch reference over the whole fp8 cache (torch and Triton ranks alike)."""
    from graphrunner.attention.triton_attn import paged_attention_triton

    kv_scale = torch.tensor(scales)
    _check(workload, lambda *a: paged_attention_torch(*a[:6], dcp=a[6], kv_scale=a[7]), "cpu", kv_scale)
    _check(workload, lambda *a: paged_attention_triton(*a[:6], dcp=a[6], kv_scale=a[7]), "cpu", kv_scale)


@pytest.mark.gpu
@given(workloads())
def test_triton_kernel_dcp_on_gpu(workload) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from graphrunner.attention.triton_attn import paged_attention_triton

    _check(workload, lambda *a: paged_attention_triton(*a[:6], dcp=a[6]), "cuda")
