"""The head-major KV cache the runner allocates: the logical [2, blocks, block_size, heads, dim]
tensor, each head's tokens of a block contiguous in memory.

Every kernel takes the cache's strides, so on a head-major cache it must give bit for bit what it
gives on the same values stored contiguously (token-major, how the other kernel tests build their
caches): the KV write (torch and Triton), the attention (Triton, with and without the rotary + KV
write folded in; the torch reference).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.attention.torch_ref import paged_attention_torch, write_kv_torch
from graphrunner.kernels import HAS_TRITON
from graphrunner.kv_shape import KVCacheShape
from tests.model.test_attention import heads, make_batch, request_lists
from tests.model.test_attention_rope import _both_paths
from tests.runner_driver import make_runner

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values as `cache` [2, nb, bs, Hkv, D], stored [2, nb, Hkv, bs, D] (a permuted view)."""
    return cache.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)


def test_allocate_hands_out_the_logical_shape_stored_head_major():
    shape = KVCacheShape(num_layers=2, block_size=4, num_kv_heads=3, head_dim=8, dtype=torch.float32)
    caches = shape.allocate(5, torch.device("cpu"))
    assert len(caches) == 2
    layer_elems = 2 * 5 * 4 * 3 * 8
    assert caches[0].untyped_storage().nbytes() == 2 * layer_elems * 4  # one allocation, no padding
    for i, cache in enumerate(caches):
        assert cache.shape == (2, 5, 4, 3, 8) and not cache.any()
        assert cache.storage_offset() == i * layer_elems  # the layers one after the other
        assert cache.stride() == (5 * 96, 96, 8, 32, 1)  # a head's tokens adjacent, then the next head's
    assert shape.block_bytes == 2 * 2 * 4 * 3 * 8 * 4


def test_the_runner_caches_are_head_major():
    runner = make_runner()
    for cache in runner.buffers.kv_caches:
        assert cache.stride()[2:] == (cache.shape[4], cache.shape[2] * cache.shape[4], 1)


@settings(deadline=None)
@given(reqs=request_lists(max_reqs=3, max_ctx=20, max_qlen=6, max_tokens=12), hk=heads,
       block_size=st.sampled_from([1, 4, 16]), pad_tokens=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_torch_write_and_reference_attention_agree_across_layouts(reqs, hk, block_size, pad_tokens, seed):
    batch = make_batch(reqs, num_heads=hk[0], num_kv_heads=hk[1], head_dim=8, block_size=block_size,
                       pad_tokens=pad_tokens, seed=seed)
    md = batch.metadata
    outs = []
    for cache in (batch.kv_cache.clone(), head_major(batch.kv_cache)):
        write_kv_torch(batch.k, batch.v, cache, md.slot_mapping[: md.num_tokens])
        outs.append((cache, paged_attention_torch(batch.q, cache, md, 0.3, torch.empty_like(batch.q))))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the interpreter on CPU)")
@settings(deadline=None)
@given(reqs=request_lists(max_reqs=3, max_ctx=20, max_qlen=6, max_tokens=12), hk=heads,
       block_size=st.sampled_from([1, 4, 16]), splits=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_triton_attention_with_and_without_rope_agrees_across_layouts(reqs, hk, block_size, splits, seed):
    """Both launches of test_attention_rope (rope_write_kv + attention, and the fused one) on a token-major
    cache and on the same cache stored head-major: the same caches and outputs, bit for bit."""
    batch = make_batch(reqs, num_heads=hk[0], num_kv_heads=hk[1], head_dim=16, block_size=block_size, seed=seed)
    token_major = _both_paths(batch, splits, seed)
    batch.kv_cache = head_major(batch.kv_cache)
    head_major_results = _both_paths(batch, splits, seed)
    for (out_a, cache_a), (out_b, cache_b) in zip(token_major, head_major_results, strict=True):
        assert cache_b.stride() == batch.kv_cache.stride()  # clone() kept the head-major order
        assert torch.equal(cache_a, cache_b)
        assert torch.equal(out_a, out_b)


@pytest.mark.gpu
@pytest.mark.parametrize("hk,head_dim", [((14, 2), 64), ((32, 8), 128)])
@pytest.mark.parametrize("reqs", [[(1023, 1)], [(900, 1)] * 256, [(40, 1), (0, 37), (500, 1), (740, 40)]])
def test_gpu_bf16_attention_agrees_across_layouts(hk, head_dim, reqs):
    """Compiled kernels, bf16, the model's head shapes: both launches give the same caches and outputs
    bit for bit on a token-major cache and on the same cache stored head-major (same kernel, same
    summation order, other addresses)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from graphrunner.attention.kv_write import rope_write_kv_triton

    batch = make_batch(reqs, num_heads=hk[0], num_kv_heads=hk[1], head_dim=head_dim, block_size=16,
                       dtype=torch.bfloat16, device="cuda", seed=5)
    for splits in (None, 4):
        token_major = _both_paths(batch, splits, 5, rope_write_kv_triton)
        stored = batch.kv_cache
        batch.kv_cache = head_major(stored)
        head_major_results = _both_paths(batch, splits, 5, rope_write_kv_triton)
        batch.kv_cache = stored
        for (out_a, cache_a), (out_b, cache_b) in zip(token_major, head_major_results, strict=True):
            assert not cache_b.is_contiguous()
            assert torch.equal(cache_a, cache_b)
            assert torch.equal(out_a, out_b)
