"""layers/decode_linear: the one-launch GEMV of a single token row against F.linear (an independent
reference: torch's own GEMM), under the Triton interpreter on CPU (hypothesis over N, K, block
shapes, bias, the masked and the even-K paths) and natively on GPU in bf16 (decode projection
shapes, in a CUDA graph replay); the dispatch (`linear`) and the custom op under torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.kernels import HAS_TRITON
from graphrunner.layers.decode_linear import (
    decode_linear,
    gemv_plan,
    gemv_triton,
    linear,
    wide_memory_part,
)
from graphrunner.layers.swiglu import _swiglu_linear_op, silu_mul_triton, swiglu, swiglu_linear
from tests.cuda_graphs import capture_cuda_graph

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the interpreter on CPU)")


@needs_triton
@given(n=st.integers(1, 40), k=st.integers(1, 300), seed=st.integers(0, 2**31),
       block=st.sampled_from([(1, 64, 4), (2, 64, 4), (2, 128, 2), (4, 32, 4)]), with_bias=st.booleans())
def test_gemv_equals_f_linear(n, k, seed, block, with_bias):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(1, k, generator=g), torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    got = gemv_triton(x, w, bias, block=block)
    assert got.shape == (1, n) and got.dtype == x.dtype
    torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-5 * k ** 0.5)


@needs_triton
def test_gemv_rejects_what_it_cannot_serve():
    with pytest.raises(ValueError, match=r"must be \[1, K\]"):
        gemv_triton(torch.zeros(2, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="unit stride"):
        gemv_triton(torch.zeros(1, 8), torch.zeros(8, 4).t())


@needs_triton
@given(n=st.integers(1, 24), k=st.integers(1, 200), seed=st.integers(0, 2**31),
       block=st.sampled_from([(1, 64, 4), (2, 32, 4), (4, 16, 2)]), half=st.booleans())
def test_swiglu_gemv_equals_silu_mul_then_f_linear(n, k, seed, block, half):
    """x = [gate | up]: the product with silu(gate) * up, rounded once to x's dtype as stored unfused
    (fp16 rows: the rounding is visible; fp32: exact up to the sum's order)."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float16 if half else torch.float32
    gate_up, w = (torch.randn(1, 2 * k, generator=g) * 3).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    got = gemv_triton(gate_up, w, bias, block=block, swiglu=True)
    gate, up = gate_up.float().chunk(2, dim=-1)
    x = (F.silu(gate) * up).to(dtype).float()  # the stored SiLU·mul, one rounding
    want = F.linear(x, w.float(), bias.float())
    assert got.shape == (1, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=1e-3 if half else 1e-5, atol=(1e-3 if half else 1e-5) * k)
    with pytest.raises(ValueError, match=r"\[1, 2K\]"):
        gemv_triton(gate_up[:, :-1], w, swiglu=True)


def test_swiglu_linear_keeps_the_unfused_path_off_cuda_and_for_many_rows():
    gate_up, w = torch.randn(3, 32), torch.randn(8, 16)
    want = F.linear(F.silu(gate_up[:, :16]) * gate_up[:, 16:], w)
    assert torch.equal(swiglu(gate_up), F.silu(gate_up[:, :16]) * gate_up[:, 16:])
    assert torch.equal(swiglu_linear(gate_up, w), want)
    assert torch.equal(swiglu_linear(gate_up[:1], w), F.linear(swiglu(gate_up[:1]), w))  # one row on CPU: F.linear


@needs_triton
def test_swiglu_custom_op_under_compile_serves_every_row_count():
    """One compiled graph, dynamic rows (the step's unbacked token count): the op chooses at run time."""
    w = torch.randn(8, 16)
    compiled = torch.compile(lambda gu: _swiglu_linear_op(gu, w), backend="aot_eager", dynamic=True, fullgraph=True)
    for rows in (1, 3, 1):
        gu = torch.randn(rows, 32)
        want = F.linear((F.silu(gu[:, :16]) * gu[:, 16:]), w)
        torch.testing.assert_close(compiled(gu), want, rtol=1e-5, atol=1e-5)


@needs_triton
@given(rows=st.integers(0, 5), i=st.integers(1, 2100), seed=st.integers(0, 2**31), half=st.booleans())
def test_silu_mul_kernel_rounds_once(rows, i, seed, half):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float16 if half else torch.float32
    gate_up = (torch.randn(rows, 2 * i, generator=g) * 4).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = (F.silu(gate) * up).to(dtype)  # fp32 math, one rounding
    got = silu_mul_triton(gate_up)
    assert got.shape == (rows, i) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3 if half else 1e-6, atol=1e-6)


def test_plan_follows_the_row_length():
    assert gemv_plan(4096, 14336) == (1, 2048, 4)
    assert gemv_plan(2048, 8192) == (1, 2048, 8)
    assert gemv_plan(1152, 896) == (2, 1024, 4)


def test_wide_memory_plan_changes_only_the_shapes_measured_there():
    """H200 class: the shapes swept there (llama-3.1-8b, qwen2.5-0.5b and llama-3.2-1b) get their winners
    or a measured near-winner; the H100 plan is unchanged; rows of a length not swept there (K = 1536,
    3072) keep the H100 plan; a CPU device is never wide."""
    wide = {(6144, 4096): (4, 2048, 8), (4096, 4096): (8, 1024, 4), (28672, 4096): (4, 2048, 8),
            (4096, 14336): (4, 2048, 4), (128256, 4096): (4, 2048, 8),  # llama-3.1-8b
            (896, 896): (4, 1024, 4), (151936, 896): (4, 1024, 4), (896, 4864): (8, 2048, 8),  # qwen2.5-0.5b
            (2048, 2048): (2, 2048, 4), (2048, 8192): (8, 2048, 8), (128256, 2048): (4, 1024, 4)}  # llama-3.2-1b
    for (n, k), block in wide.items():
        assert gemv_plan(n, k, wide_memory=True) == block
        assert gemv_plan(n, k) == gemv_plan(n, k, wide_memory=False) != block
    for n, k in [(1536, 1536), (8960, 1536), (3072, 3072), (5120, 3072)]:
        assert gemv_plan(n, k, wide_memory=True) == gemv_plan(n, k)
    assert not wide_memory_part(torch.device("cpu"))


def test_cpu_dispatch_is_f_linear():
    x, w, b = torch.randn(1, 16), torch.randn(8, 16), torch.randn(8)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))  # CPU tensors never take the GEMV
    x3 = torch.randn(3, 16)
    assert torch.equal(linear(x3, w), F.linear(x3, w))


@needs_triton
def test_custom_op_under_compile_serves_every_row_count():
    w, b = torch.randn(8, 16), torch.randn(8)
    compiled = torch.compile(lambda x: decode_linear(x, w, b), backend="aot_eager", dynamic=True, fullgraph=True)
    for rows in (1, 3, 1):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(compiled(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,with_bias", [(1152, 896, True), (4096, 4864, False), (3072, 2048, False),
                                           (8192, 4096, False)])
def test_gpu_bf16_gemv_matches_f_linear_and_replays(n, k, with_bias):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g) if with_bias else None
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())  # fp32 reference
    got = linear(x, w, b)
    assert got.dtype == torch.bfloat16
    # One bf16 rounding of an fp32 sum: within bf16's half ulp of the fp32 result, like cuBLAS's.
    torch.testing.assert_close(got.float(), ref, rtol=8e-3, atol=1e-3)
    cublas_err = (F.linear(x, w, b).float() - ref).abs().max()
    assert (got.float() - ref).abs().max() <= 2 * cublas_err + 1e-3
    out = torch.empty_like(got)
    graph = capture_cuda_graph(lambda: out.copy_(linear(x, w, b)))
    x.copy_(torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g))  # same address, new row
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float(), None if b is None else b.float()),
                               rtol=8e-3, atol=1e-3)


@needs_triton
@given(n=st.integers(1, 40), k=st.integers(1, 200), seed=st.integers(0, 2**31))
def test_gemv_writes_the_fp32_sum_when_asked(n, k, seed):
    """out_dtype=float32 (the LM head): the fp32 accumulator itself, not its rounding to x's dtype."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(1, k, generator=g).half(), torch.randn(n, k, generator=g).half()
    got = gemv_triton(x, w, block=(2, 64, 4), out_dtype=torch.float32)
    assert got.dtype == torch.float32 and got.shape == (1, n)
    ref = F.linear(x.float(), w.float())  # exact products of fp16 values, summed in fp32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * k ** 0.5)
    half = gemv_triton(x, w, block=(2, 64, 4))
    assert half.dtype == torch.float16
    torch.testing.assert_close(half, got.half(), rtol=0, atol=0)  # the same sum, rounded once


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(896, 4864), (2048, 8192), (4096, 14336)])
def test_gpu_bf16_swiglu_gemv_matches_the_unfused_pair_and_replays(n, k):
    """The down projections of qwen2.5-0.5b, llama-3.2-1b and llama-3.1-8b at batch 1."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(2)
    gate_up = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16, generator=g) * 2
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    gate, up = gate_up.float().chunk(2, dim=-1)
    x = (F.silu(gate) * up).bfloat16()  # SiLU·mul stored once, as the compiled step's fused kernel
    ref = F.linear(x.float(), w.float())
    got = swiglu_linear(gate_up, w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, rtol=8e-3, atol=1e-3)
    assert (got.float() - ref).abs().max() <= 2 * (F.linear(x, w).float() - ref).abs().max() + 1e-3
    out = torch.empty_like(got)
    graph = capture_cuda_graph(lambda: out.copy_(swiglu_linear(gate_up, w)))
    gate_up.copy_(torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16, generator=g))
    graph.replay()
    torch.cuda.synchronize()
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(out.float(), F.linear((F.silu(gate) * up).bfloat16().float(), w.float()),
                               rtol=8e-3, atol=1e-3)


@pytest.mark.gpu
def test_gpu_one_row_lm_head_is_fp32_gemv_like_batched():
    """lm_logits: one row (GEMV) and several rows (cuBLAS, fp32 out) both return the fp32 accumulator."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from graphrunner.layers.embedding import lm_logits

    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(3, 896, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(4096, 896, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    ref = F.linear(h.float(), w.float())
    one, many = lm_logits(h[:1], w), lm_logits(h, w)
    assert one.dtype == many.dtype == torch.float32
    torch.testing.assert_close(one, ref[:1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(many, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,i", [(256, 4864), (7, 8192), (1, 14336)])
def test_gpu_silu_mul_kernel_rounds_once(rows, i):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gate_up = torch.randn(rows, 2 * i, device="cuda", dtype=torch.bfloat16) * 4
    gate, up = gate_up.float().chunk(2, dim=-1)
    got = silu_mul_triton(gate_up)
    assert got.shape == (rows, i) and got.dtype == torch.bfloat16
    assert torch.equal(got, (F.silu(gate) * up).to(torch.bfloat16))  # fp32 math, one rounding
