"""The pre-norm boundary fused into the next projection (graphrunner/layers/norm_linear.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.kernels import HAS_TRITON
from graphrunner.layers.linear import ColumnLinear
from graphrunner.layers.norm import RMSNorm, add_rms_norm_torch
from graphrunner.layers.norm_linear import add_norm_linear, add_norm_project, norm_gemv_plan, norm_gemv_triton
from tests.cuda_graphs import capture_cuda_graph

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the interpreter on CPU)")
BLOCKS = [(1, 64, 4), (2, 32, 4), (4, 128, 2), (8, 64, 4), (2, 512, 4)]


def _inputs(n, k, seed, dtype, with_bias):
    g = torch.Generator().manual_seed(seed)
    x, res = torch.randn(1, k, generator=g).to(dtype), torch.randn(1, k, generator=g).to(dtype)
    nw = (1 + 0.5 * torch.randn(k, generator=g)).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    return x, res, nw, w, bias


@needs_triton
@given(n=st.integers(1, 40), k=st.integers(1, 300), seed=st.integers(0, 2**31), block=st.sampled_from(BLOCKS),
       with_bias=st.booleans(), eps=st.sampled_from([1e-6, 1e-5, 0.5]))
def test_fp32_equals_norm_then_linear(n, k, seed, block, with_bias, eps):
    x, res, nw, w, bias = _inputs(n, k, seed, torch.float32, with_bias)
    y, res_out = norm_gemv_triton(x, res, nw, eps, w, bias, block=block)
    normed, ref_res = add_rms_norm_torch(x, res, nw, eps)
    assert y.shape == (1, n) and res_out.shape == (1, k) and y.dtype == res_out.dtype == torch.float32
    assert torch.equal(res_out, ref_res)  # the sum, stored by program 0 only, over every K tile
    torch.testing.assert_close(y, F.linear(normed, w, bias), rtol=1e-5, atol=1e-5 * k ** 0.5)


def _check_identity_projection(k, seed, block, dtype, device="cpu"):
    """With W = I each output is one product, normed[j] * 1, so it must equal the torch
    path's normalized row bit for bit: the half-precision roundings are in the same places."""
    x, res, nw = (t.to(device) for t in _inputs(k, k, seed, dtype, False)[:3])
    y, res_out = norm_gemv_triton(x, res, nw, 1e-6, torch.eye(k, dtype=dtype, device=device), block=block)
    normed, ref_res = add_rms_norm_torch(x, res, nw, 1e-6)
    assert torch.equal(res_out, ref_res)
    assert torch.equal(y, normed)


@needs_triton
@given(k=st.integers(1, 96), seed=st.integers(0, 2**31), block=st.sampled_from([(4, 32, 4), (8, 64, 4), (2, 16, 4)]))
def test_the_normalized_row_is_rounded_like_rms_norm(k, seed, block):
    # fp16 only: the interpreter rounds fp32 -> bf16 differently from torch (bf16 runs on the GPU below).
    _check_identity_projection(k, seed, block, torch.float16)


@needs_triton
def test_rejects_what_it_cannot_serve():
    z = torch.zeros
    with pytest.raises(ValueError, match=r"must be \[1, K\]"):
        norm_gemv_triton(z(2, 8), z(2, 8), z(8), 1e-6, z(4, 8))
    with pytest.raises(ValueError, match=r"norm_weight \(4,\)"):
        norm_gemv_triton(z(1, 8), z(1, 8), z(4), 1e-6, z(4, 8))
    with pytest.raises(ValueError, match="unit stride"):
        norm_gemv_triton(z(1, 8), z(1, 8), z(8), 1e-6, z(8, 4).t())


def test_plan_gives_more_rows_than_the_plain_gemv():
    assert norm_gemv_plan(1152, 896) == (4, 1024, 4)
    assert norm_gemv_plan(28672, 4096) == (2, 2048, 4)


def test_wide_memory_plan_changes_only_short_rows():
    """H200 class (the sweep of those shapes there): qwen2.5-0.5b's q|k|v and gate|up get their winners; llama-3.2-1b's
    (K = 2048, fastest with the H100 plan there) and longer rows keep the H100 plan."""
    assert norm_gemv_plan(1152, 896, wide_memory=True) == (16, 1024, 8)
    assert norm_gemv_plan(9728, 896, wide_memory=True) == (8, 512, 4)
    for n, k in [(3072, 2048), (16384, 2048), (28672, 4096)]:
        assert norm_gemv_plan(n, k, wide_memory=True) == norm_gemv_plan(n, k)


def test_cpu_path_is_add_norm_then_the_projection():
    torch.manual_seed(0)
    norm = RMSNorm(16, 1e-6, dtype=torch.float32)
    norm.weight.data.normal_()
    proj = ColumnLinear(16, 24, bias=True, dtype=torch.float32)
    proj.weight.data.normal_()
    proj.bias.data.normal_()
    for rows in (1, 3):
        x, res = torch.randn(rows, 16), torch.randn(rows, 16)
        y, res_out = add_norm_project(norm, x, res, proj)
        normed, ref_res = norm.add_norm(x, res)
        assert torch.equal(y, proj(normed)) and torch.equal(res_out, ref_res)


def test_custom_op_under_compile_serves_every_row_count():
    nw, w, b = torch.randn(16), torch.randn(8, 16), torch.randn(8)
    compiled = torch.compile(lambda x, r: add_norm_linear(x, r, nw, 1e-6, w, b), backend="aot_eager",
                             dynamic=True, fullgraph=True)
    for rows in (1, 3, 1):
        x, r = torch.randn(rows, 16), torch.randn(rows, 16)
        y, res = compiled(x, r)
        normed, ref_res = add_rms_norm_torch(x, r, nw, 1e-6)
        torch.testing.assert_close(y, F.linear(normed, w, b), rtol=1e-5, atol=1e-5)
        assert torch.equal(res, ref_res)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,with_bias", [(1152, 896, True), (9728, 896, False), (3072, 2048, False),
                                           (28672, 4096, False)])
def test_gpu_bf16_matches_the_two_kernel_path_and_replays(n, k, with_bias):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from graphrunner.layers.decode_linear import gemv_triton
    from graphrunner.layers.norm import add_rms_norm_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    x, res = (torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    nw = 1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g) if with_bias else None

    def two_kernels():
        normed, r = add_rms_norm_triton(x, res, nw, 1e-6)
        return gemv_triton(normed, w, b), r, normed

    y, res_out = add_norm_linear(x, res, nw, 1e-6, w, b)
    ref_y, ref_res, normed = two_kernels()
    assert torch.equal(res_out, ref_res)
    fp32 = F.linear(normed.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(y.float(), fp32, rtol=8e-3, atol=1e-3)  # one rounding of an fp32 sum
    assert (y.float() - fp32).abs().max() <= 2 * (ref_y.float() - fp32).abs().max() + 1e-3
    outs = (torch.empty_like(y), torch.empty_like(res_out))
    graph = capture_cuda_graph(
        lambda: [o.copy_(t) for o, t in zip(outs, add_norm_linear(x, res, nw, 1e-6, w, b), strict=True)])
    x.copy_(torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g))  # same address, new row
    graph.replay()
    torch.cuda.synchronize()
    ref_y, ref_res, _ = two_kernels()
    torch.testing.assert_close(outs[0].float(), ref_y.float(), rtol=8e-3, atol=2e-3)
    assert torch.equal(outs[1], ref_res)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [896, 4096])
@pytest.mark.parametrize("wide", [False, True])
def test_gpu_bf16_normalized_row_is_rounded_like_rms_norm(k, wide):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _check_identity_projection(k, 0, norm_gemv_plan(k, k, wide_memory=wide), torch.bfloat16, "cuda")
