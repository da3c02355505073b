"""The decoder layer's fused kernels against their torch references.

- `rope_write_kv_triton`: rotary embedding of q and k fused with the KV-cache write,
  against `rope_write_kv_torch` (the torch rotation + `write_kv_torch`) and against the
  model's `RotaryEmbedding` (the Hugging Face formula);
- `add_rms_norm_triton` and the custom op `graphrunner::fused_add_rms_norm`, against
  `add_rms_norm_torch` (residual add in the activation dtype, then HF's RMSNorm).

CPU: Triton runs interpreted (TRITON_INTERPRET=1 from conftest) on tiny shapes in fp32,
where the kernels do the reference's arithmetic (tolerance 1e-5 for summation order).
GPU (`gpu` mark): bf16 natively, and replay inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.attention.torch_ref import rope_write_kv_torch, rotate_torch
from graphrunner.kernels import HAS_TRITON
from graphrunner.layers.norm import RMSNorm, add_rms_norm_torch
from graphrunner.layers.rotary import RotaryEmbedding

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
if HAS_TRITON:
    from graphrunner.attention.kv_write import rope_write_kv_triton
    from graphrunner.layers.norm import add_rms_norm_triton

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
SENTINEL = 7.0


def _rope_case(num_tokens, num_kv_heads, group, head_dim, block_size, num_blocks, dtype, device, seed, max_pos=64):
    """Strided q/k/v views of one fused qkv projection (as the model passes them), positions,
    a cos|sin table, a SENTINEL-filled cache and distinct slots with some -1."""
    g = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = qkv.to(device).split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q, k, v = (x.view(num_tokens, -1, head_dim) for x in (q, k, v))
    positions = torch.randint(0, max_pos, (num_tokens,), generator=g).to(device)
    rotary = RotaryEmbedding(head_dim, max_pos, 10000.0, device=device)
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), SENTINEL, dtype=dtype, device=device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.3] = -1  # padding / tokens another rank writes
    return q, k, v, positions, rotary, cache, slots.to(device)


def test_rotate_torch_matches_the_rotary_module():
    """fp32: the one-rounding rotation is HF's formula (RotaryEmbedding) exactly up to summation order."""
    q, k, _, positions, rotary, _, _ = _rope_case(9, 2, 3, 16, 4, 8, torch.float32, "cpu", 0)
    q_ref, k_ref = rotary(positions, q, k)
    torch.testing.assert_close(rotate_torch(positions, q, rotary.cos_sin_cache), q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rotate_torch(positions, k, rotary.cos_sin_cache), k_ref, atol=1e-6, rtol=1e-6)


@needs_triton
@given(
    num_tokens=st.integers(1, 6),
    num_kv_heads=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 2, 5]),
    head_dim=st.sampled_from([4, 8, 12]),
    block_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_rope_write_kv_triton_matches_torch(num_tokens, num_kv_heads, group, head_dim, block_size, seed):
    """Interpreted kernel == torch reference: the rotated q, and a cache where exactly the
    live slots hold the rotated k and the v (the others keep SENTINEL)."""
    num_blocks = -(-num_tokens // block_size) + 1
    q, k, v, positions, rotary, cache, slots = _rope_case(
        num_tokens, num_kv_heads, group, head_dim, block_size, num_blocks, torch.float32, "cpu", seed
    )
    ref_cache = cache.clone()
    q_ref = rope_write_kv_torch(q, k, v, positions, rotary.cos_sin_cache, ref_cache, slots)
    q_rot = rope_write_kv_triton(q, k, v, positions, rotary.cos_sin_cache, cache, slots)
    assert q_rot.is_contiguous() and q_rot.shape == q.shape
    torch.testing.assert_close(q_rot, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache, ref_cache, atol=1e-5, rtol=1e-5)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert (cache.flatten(1, 2)[:, untouched] == SENTINEL).all()


def test_rope_write_kv_rejects_bad_shapes():
    q, k, v, positions, rotary, cache, slots = _rope_case(4, 2, 2, 8, 4, 4, torch.float32, "cpu", 1)
    with pytest.raises(ValueError, match="positions has shape"):
        rope_write_kv_torch(q, k, v, positions[:3], rotary.cos_sin_cache, cache, slots)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rope_write_kv_torch(q, k, v, positions, rotary.cos_sin_cache.half(), cache, slots)


@needs_triton
@given(num_tokens=st.integers(1, 5), hidden=st.sampled_from([8, 24, 40]), seed=st.integers(0, 2**16))
def test_add_rms_norm_triton_matches_torch(num_tokens, hidden, seed):
    g = torch.Generator().manual_seed(seed)
    x, residual = torch.randn(2, num_tokens, hidden, generator=g)
    weight = torch.rand(hidden, generator=g) + 0.5
    out, res = add_rms_norm_triton(x, residual, weight, 1e-6)
    out_ref, res_ref = add_rms_norm_torch(x, residual, weight, 1e-6)
    torch.testing.assert_close(res, res_ref, atol=0, rtol=0)
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)


@needs_triton
def test_fused_add_rms_norm_op_is_sound():
    """Schema and fake kernel of the custom op (the Triton kernel, interpreted on CPU)."""
    import graphrunner.layers.norm as norm

    x, residual, weight = torch.randn(3, 16), torch.randn(3, 16), torch.rand(16)
    torch.library.opcheck(norm.fused_add_rms_norm, (x, residual, weight, 1e-5, 0),
                          test_utils=("test_schema", "test_faketensor"))


def test_cpu_norm_takes_the_torch_reference():
    """A norm built on the CPU is not fused (decided at construction) and adds, then normalizes, in torch."""
    norm = RMSNorm(16, 1e-6, dtype=torch.float32)
    assert not norm.fused and norm.pdl_rows == 0
    norm.weight.data.normal_()
    x, residual = torch.randn(3, 16), torch.randn(3, 16)
    out, res = norm.add_norm(x, residual)
    assert torch.equal(res, x + residual)
    torch.testing.assert_close(out, add_rms_norm_torch(x, residual, norm.weight, 1e-6)[0], atol=0, rtol=0)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,group", [(64, 7), (128, 4), (64, 1)])
def test_rope_write_kv_native_bf16(head_dim, group):
    """bf16 on CUDA: equal to the reference up to one bf16 rounding; graph replay equals eager."""
    q, k, v, positions, rotary, cache, slots = _rope_case(
        37, 2, group, head_dim, 16, 8, torch.bfloat16, "cuda", 3, max_pos=4096
    )
    ref_cache = cache.clone()
    q_ref = rope_write_kv_torch(q, k, v, positions, rotary.cos_sin_cache, ref_cache, slots)
    q_rot = rope_write_kv_triton(q, k, v, positions, rotary.cos_sin_cache, cache, slots)
    torch.testing.assert_close(q_rot, q_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(cache, ref_cache, atol=2e-2, rtol=2e-2)
    graph_cache = torch.full_like(cache, SENTINEL)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_graph = rope_write_kv_triton(q, k, v, positions, rotary.cos_sin_cache, graph_cache, slots)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(q_graph, q_rot) and torch.equal(graph_cache, cache)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [896, 2048, 4096])
def test_add_rms_norm_native_bf16(hidden):
    g = torch.Generator().manual_seed(hidden)
    x, residual = torch.randn(2, 19, hidden, generator=g).to("cuda", torch.bfloat16)
    weight = (torch.rand(hidden, generator=g) + 0.5).to("cuda", torch.bfloat16)
    out, res = torch.ops.graphrunner.fused_add_rms_norm(x, residual, weight, 1e-6)
    out_ref, res_ref = add_rms_norm_torch(x, residual, weight, 1e-6)
    assert torch.equal(res, res_ref)
    torch.testing.assert_close(out, out_ref, atol=2e-2, rtol=2e-2)
