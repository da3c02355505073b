"""The rotary embedding and the KV write folded into the attention launch (`RopeKV`).

Against the two-kernel path it replaces: `rope_write_kv` (torch reference on CPU, the Triton
kernel on a GPU) followed by the plain attention launch. Any batch: the decode grid lets each
program write the keys it reads, so multi-tile prefills and split-KV are covered too.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.attention.torch_ref import rope_write_kv_torch
from graphrunner.kernels import HAS_TRITON
from graphrunner.layers.rotary import RotaryEmbedding
from tests.model.test_attention import SENTINEL, heads, make_batch, request_lists

pytestmark = [pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the interpreter on CPU)"),
              pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")]
if HAS_TRITON:
    from graphrunner.attention.triton_attn import RopeKV, paged_attention_triton

MAX_POS = 64


def _positions(batch, seed: int) -> torch.Tensor:
    """Each real token's position in its sequence; padded tokens anywhere in the table."""
    pos = []
    for ctx, qlen in batch.reqs:
        pos += range(ctx, ctx + qlen)
    g = torch.Generator().manual_seed(seed)
    pad = torch.randint(0, MAX_POS, (batch.q.shape[0] - len(pos),), generator=g).tolist()
    return torch.tensor(pos + pad, dtype=torch.int64, device=batch.q.device)


def _both_paths(batch, splits, seed, rope_write_kv=rope_write_kv_torch, **kwargs):
    """(out, cache) of the two-kernel path, then of the fused launch, from the same inputs."""
    head_dim = batch.q.shape[2]
    positions = _positions(batch, seed)
    table_len = max(MAX_POS, int(positions.max()) + 1)  # every position has its row
    cos_sin = RotaryEmbedding(head_dim, table_len, 10000.0, device=batch.q.device).cos_sin_cache
    md = batch.metadata
    slots = md.slot_mapping[: md.num_tokens]
    ref_cache = batch.kv_cache.clone()
    q_rot = rope_write_kv(batch.q, batch.k, batch.v, positions, cos_sin, ref_cache, slots)
    ref = paged_attention_triton(q_rot, ref_cache, md, 0.3, torch.full_like(batch.q, float("nan")),
                                 num_kv_splits=splits, **kwargs)
    cache = batch.kv_cache.clone()
    got = paged_attention_triton(batch.q, cache, md, 0.3, torch.full_like(batch.q, float("nan")),
                                 num_kv_splits=splits, rope_kv=RopeKV(batch.k, batch.v, positions, cos_sin, slots),
                                 **kwargs)
    return (ref, ref_cache), (got, cache)


@settings(deadline=None)
@given(
    # Prefill chunks up to 20 tokens: several tiles per request at G_PAD 4 (4 tokens a tile).
    reqs=request_lists(max_reqs=4, max_ctx=24, max_qlen=20, max_tokens=32),
    hk=heads,
    block_size=st.sampled_from([1, 4, 16]),
    pad_reqs=st.integers(0, 1),
    pad_tokens=st.integers(0, 2),
    splits=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**16),
)
def test_fused_launch_equals_rope_write_then_attend(reqs, hk, block_size, pad_reqs, pad_tokens, splits, seed):
    """fp32, interpreted: the same cache bit for bit (rotated new keys and values at their slots,
    SENTINEL elsewhere) and the same attention up to the split partition's summation order."""
    num_heads, num_kv_heads = hk
    batch = make_batch(reqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16, block_size=block_size,
                       pad_reqs=pad_reqs, pad_tokens=pad_tokens, dtype=torch.float32, seed=seed)
    (ref, ref_cache), (got, cache) = _both_paths(batch, splits, seed)
    assert torch.equal(cache, ref_cache)
    assert (cache == SENTINEL).sum() == (ref_cache == SENTINEL).sum()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_refuses_what_it_cannot_serve():
    batch = make_batch([(3, 1)], num_heads=2, num_kv_heads=1, head_dim=16, block_size=4, device="cpu")
    rope = RopeKV(batch.k, batch.v, torch.zeros(1, dtype=torch.int64), torch.zeros(MAX_POS, 16),
                  batch.metadata.slot_mapping)
    out = torch.empty_like(batch.q)
    with pytest.raises(ValueError, match="decode grid"):
        paged_attention_triton(batch.q, batch.kv_cache, batch.metadata, 0.3, out, rope_kv=rope, decode_grid=False)
    with pytest.raises(ValueError, match="DCP"):
        paged_attention_triton(batch.q, batch.kv_cache, batch.metadata, 0.3, out, rope_kv=rope, dcp=(2, 0, 1))
    bad = RopeKV(batch.k, batch.v, rope.positions, torch.zeros(MAX_POS, 16, dtype=torch.float64), rope.slot_mapping)
    with pytest.raises(ValueError, match="cos_sin"):
        paged_attention_triton(batch.q, batch.kv_cache, batch.metadata, 0.3, out, rope_kv=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("hk,head_dim", [((14, 2), 64), ((32, 8), 128)])
@pytest.mark.parametrize("reqs", [[(1023, 1)], [(300 + 7 * i, 1) for i in range(8)],
                                  [(900, 1)] * 256, [(40, 1), (0, 37), (500, 1), (740, 40), (17, 5)]])
def test_gpu_bf16_fused_launch_equals_the_two_kernels(hk, head_dim, reqs):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from graphrunner.attention.kv_write import rope_write_kv_triton

    num_heads, num_kv_heads = hk
    batch = make_batch(reqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
                       dtype=torch.bfloat16, device="cuda", seed=3)
    for splits in (None, 4):
        (ref, ref_cache), (got, cache) = _both_paths(batch, splits, 3, rope_write_kv_triton)
        # One rounding of the same fp32 rotation: equal up to the compiler's fused multiply-adds.
        torch.testing.assert_close(cache.float(), ref_cache.float(), rtol=8e-3, atol=1e-2)
        assert (cache == ref_cache).float().mean() > 0.99
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
