"""layers/linear.py (the projection seam) and layers/gemv.py (its single-row kernels).

The kernels against independent references (F.linear, torch's add + RMSNorm and SiLU·mul) under
the Triton interpreter on CPU (hypothesis over N, K, tiles, bias, the masked and the even-K paths)
and natively on GPU in bf16 (decode projection shapes, in a CUDA graph replay); the plans keyed
by device properties (an H100's and an H200's); the method each layer picks from KernelConfig;
the custom ops under torch.compile."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.config import KernelConfig
from graphrunner.kernels import HAS_TRITON
from graphrunner.kernels.device import DeviceProperties, device_properties
from graphrunner.layers.gemv import gemv_plan, gemv_triton, norm_gemv_plan, norm_gemv_triton, silu_mul_triton
from graphrunner.layers.linear import (
    TORCH_LINEAR,
    ColumnLinear,
    GemvMethod,
    RowLinear,
    add_norm_linear,
    choose_linear_method,
    decode_linear,
    swiglu_linear,
)
from graphrunner.layers.norm import RMSNorm, add_rms_norm_torch
from tests.cuda_graphs import capture_cuda_graph

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the interpreter on CPU)")
BLOCKS = [(1, 64, 4), (2, 32, 4), (4, 128, 2), (8, 64, 4), (2, 512, 4)]


def _props(name: str) -> DeviceProperties:
    """What torch.cuda.get_device_properties reports (memory clock in kHz, bus width in bits)."""
    reported = {  # H100 SXM: 80 GB HBM3 at 3.35 TB/s; H200: 141 GB HBM3e at 4.8 TB/s
        "H100": SimpleNamespace(major=9, minor=0, multi_processor_count=132, total_memory=85_045_870_592,
                                L2_cache_size=52_428_800, memory_clock_rate=2_619_000, memory_bus_width=5120),
        "H200": SimpleNamespace(major=9, minor=0, multi_processor_count=132, total_memory=150_110_011_392,
                                L2_cache_size=62_914_560, memory_clock_rate=3_201_000, memory_bus_width=6144),
    }
    return DeviceProperties.from_torch(reported[name])


H100, H200 = _props("H100"), _props("H200")


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@needs_triton
@given(n=st.integers(1, 40), k=st.integers(1, 300), seed=st.integers(0, 2**31),
       block=st.sampled_from([(1, 64, 4), (2, 64, 4), (2, 128, 2), (4, 32, 4)]), with_bias=st.booleans())
def test_gemv_equals_f_linear(n, k, seed, block, with_bias):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(1, k, generator=g), torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    got = gemv_triton(x, w, bias, block)
    assert got.shape == (1, n) and got.dtype == x.dtype
    torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-5 * k ** 0.5)


@needs_triton
def test_gemv_rejects_what_it_cannot_serve():
    with pytest.raises(ValueError, match=r"must be \[1, K\]"):
        gemv_triton(torch.zeros(2, 8), torch.zeros(4, 8), None, (1, 64, 4))
    with pytest.raises(ValueError, match="unit stride"):
        gemv_triton(torch.zeros(1, 8), torch.zeros(8, 4).t(), None, (1, 64, 4))


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
    got = gemv_triton(gate_up, w, bias, block, swiglu=True)
    gate, up = gate_up.float().chunk(2, dim=-1)
    x = (F.silu(gate) * up).to(dtype).float()  # the stored SiLU·mul, one rounding
    want = F.linear(x, w.float(), bias.float())
    assert got.shape == (1, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=1e-3 if half else 1e-5, atol=(1e-3 if half else 1e-5) * k)
    with pytest.raises(ValueError, match=r"\[1, 2K\]"):
        gemv_triton(gate_up[:, :-1], w, None, block, swiglu=True)


@needs_triton
@pytest.mark.parametrize("fused", [True, False])
def test_swiglu_custom_op_under_compile_serves_every_row_count(fused):
    """One compiled graph, dynamic rows (the step's unbacked token count): the op chooses at run time."""
    w = torch.randn(8, 16)
    compiled = torch.compile(lambda gu: swiglu_linear(gu, w, None, (2, 16, 4), fused, 0), backend="aot_eager",
                             dynamic=True, fullgraph=True)
    for rows in (1, 3, 1):
        gu = torch.randn(rows, 32)
        torch.testing.assert_close(compiled(gu), F.linear(_silu_mul(gu), w), rtol=1e-5, atol=1e-5)


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


def test_device_properties_give_bandwidth_and_the_wide_memory_class():
    assert H100.memory_bytes_per_s == pytest.approx(3.35e12, rel=0.01) and not H100.wide_memory
    assert H200.memory_bytes_per_s == pytest.approx(4.92e12, rel=0.01) and H200.wide_memory
    assert device_properties("cpu") is None and device_properties(torch.device("meta")) is None
    unclocked = [dataclasses.replace(p, memory_bytes_per_s=0.0) for p in (H100, H200)]  # no clock reported
    assert [p.wide_memory for p in unclocked] == [False, True]  # the memory size stands in


def test_plan_follows_the_row_length():
    for device in (None, H100):  # the base plan
        assert gemv_plan(4096, 14336, device) == (1, 2048, 4)
        assert gemv_plan(2048, 8192, device) == (1, 2048, 8)
        assert gemv_plan(1152, 896, device) == (2, 1024, 4)


def test_wide_memory_plan_changes_only_the_shapes_measured_there():
    """An H200's properties: the shapes swept there (llama-3.1-8b, qwen2.5-0.5b, llama-3.2-1b) get their
    winners or a measured near-winner; an H100 keeps the base plan; rows of a length not swept there
    (K = 1536, 3072) keep the base plan on both."""
    wide = {(6144, 4096): (4, 2048, 8), (4096, 4096): (8, 1024, 4), (28672, 4096): (4, 2048, 8),
            (4096, 14336): (4, 2048, 4), (128256, 4096): (4, 2048, 8),  # llama-3.1-8b
            (896, 896): (4, 1024, 4), (151936, 896): (4, 1024, 4), (896, 4864): (8, 2048, 8),  # qwen2.5-0.5b
            (2048, 2048): (2, 2048, 4), (2048, 8192): (8, 2048, 8), (128256, 2048): (4, 1024, 4)}  # llama-3.2-1b
    for (n, k), block in wide.items():
        assert gemv_plan(n, k, H200) == block
        assert gemv_plan(n, k, H100) == gemv_plan(n, k) != block
    for n, k in [(1536, 1536), (8960, 1536), (3072, 3072), (5120, 3072)]:
        assert gemv_plan(n, k, H200) == gemv_plan(n, k, H100) == gemv_plan(n, k)


def test_norm_plan_gives_more_rows_than_the_plain_gemv():
    for device in (None, H100):
        assert norm_gemv_plan(1152, 896, device) == (4, 1024, 4)
        assert norm_gemv_plan(28672, 4096, device) == (2, 2048, 4)


def test_norm_wide_memory_plan_changes_only_short_rows():
    """An H200's properties: qwen2.5-0.5b's q|k|v and gate|up get their winners; llama-3.2-1b's (K = 2048,
    fastest with the base plan there) and longer rows keep the base plan."""
    assert norm_gemv_plan(1152, 896, H200) == (16, 1024, 8)
    assert norm_gemv_plan(9728, 896, H200) == (8, 512, 4)
    for n, k in [(3072, 2048), (16384, 2048), (28672, 4096)]:
        assert norm_gemv_plan(n, k, H200) == norm_gemv_plan(n, k, H100) == norm_gemv_plan(n, k)


def test_method_follows_kernel_config_and_device():
    """No GPU, or decode_gemv off: torch. On a GPU the tiles follow the device's plan, the fused entries
    KernelConfig's limits on K, PDL its flag, its row limit and the compute capability."""
    qwen_gate_up, qwen_down, llama8b_qkv = (9728, 896), (896, 4864), (6144, 4096)
    assert choose_linear_method(KernelConfig(), None, *qwen_gate_up) is TORCH_LINEAR
    assert choose_linear_method(KernelConfig(decode_gemv=False), H100, *qwen_gate_up) is TORCH_LINEAR
    m = choose_linear_method(KernelConfig(), H100, *qwen_gate_up)
    assert isinstance(m, GemvMethod)
    assert (m.tile, m.norm_tile, m.fuse_swiglu, m.pdl_rows) == ((2, 1024, 4), (4, 1024, 4), True, 1)
    m = choose_linear_method(KernelConfig(), H200, *qwen_gate_up)
    assert (m.tile, m.norm_tile) == ((4, 1024, 4), (8, 512, 4))
    down = choose_linear_method(KernelConfig(), H100, *qwen_down)
    assert down.fuse_swiglu and not choose_linear_method(KernelConfig(swiglu_gemv_max_k=4096), H100,
                                                         *qwen_down).fuse_swiglu
    assert choose_linear_method(KernelConfig(), H100, *llama8b_qkv).norm_tile == ()  # K 4096 > 2048
    assert choose_linear_method(KernelConfig(norm_gemv_max_k=0), H100, *qwen_gate_up).norm_tile == ()
    assert choose_linear_method(KernelConfig(pdl=False), H100, *qwen_gate_up).pdl_rows == 0
    assert choose_linear_method(KernelConfig(pdl_max_rows=4), H100, *qwen_gate_up).pdl_rows == 4
    ampere = DeviceProperties((8, 0), 108, 85_000_000_000, 41_943_040, 2.0e12)
    assert choose_linear_method(KernelConfig(), ampere, *qwen_gate_up).pdl_rows == 0  # PDL needs 9.0


def test_cpu_layers_take_the_torch_method():
    x, b = torch.randn(1, 16), torch.randn(8)
    proj = ColumnLinear(16, 8, bias=True, dtype=torch.float32, kernel=KernelConfig())
    assert proj.method is TORCH_LINEAR
    proj.weight.data.normal_()
    proj.bias.data.copy_(b)
    for rows in (1, 3):
        x = torch.randn(rows, 16)
        assert torch.equal(proj(x), F.linear(x, proj.weight, b))
    down = RowLinear(16, 8, dtype=torch.float32)
    down.weight.data.normal_()
    gate_up = torch.randn(3, 32)
    assert torch.equal(down.forward_swiglu(gate_up), F.linear(_silu_mul(gate_up), down.weight))


def test_cpu_add_norm_forward_is_add_norm_then_the_projection():
    torch.manual_seed(0)
    norm = RMSNorm(16, 1e-6, dtype=torch.float32)
    norm.weight.data.normal_()
    proj = ColumnLinear(16, 24, bias=True, dtype=torch.float32)
    proj.weight.data.normal_()
    proj.bias.data.normal_()
    for rows in (1, 3):
        x, res = torch.randn(rows, 16), torch.randn(rows, 16)
        y, res_out = proj.add_norm_forward(norm, x, res)
        normed, ref_res = add_rms_norm_torch(x, res, norm.weight, 1e-6)
        assert torch.equal(y, F.linear(normed, proj.weight, proj.bias)) and torch.equal(res_out, ref_res)


@needs_triton
def test_custom_op_under_compile_serves_every_row_count():
    w, b = torch.randn(8, 16), torch.randn(8)
    compiled = torch.compile(lambda x: decode_linear(x, w, b, (2, 16, 4), 0), backend="aot_eager", dynamic=True,
                             fullgraph=True)
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
    method = _gpu_method(n, k)
    got = method.linear(x, w, b)
    assert got.dtype == torch.bfloat16
    # One bf16 rounding of an fp32 sum: within bf16's half ulp of the fp32 result, like cuBLAS's.
    torch.testing.assert_close(got.float(), ref, rtol=8e-3, atol=1e-3)
    cublas_err = (F.linear(x, w, b).float() - ref).abs().max()
    assert (got.float() - ref).abs().max() <= 2 * cublas_err + 1e-3
    out = torch.empty_like(got)
    graph = capture_cuda_graph(lambda: out.copy_(method.linear(x, w, b)))
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
    got = gemv_triton(x, w, None, (2, 64, 4), out_dtype=torch.float32)
    assert got.dtype == torch.float32 and got.shape == (1, n)
    ref = F.linear(x.float(), w.float())  # exact products of fp16 values, summed in fp32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * k ** 0.5)
    half = gemv_triton(x, w, None, (2, 64, 4))
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
    method = _gpu_method(n, k)
    assert method.fuse_swiglu == (k <= KernelConfig().swiglu_gemv_max_k)
    got = method.swiglu_linear(gate_up, w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, rtol=8e-3, atol=1e-3)
    assert (got.float() - ref).abs().max() <= 2 * (F.linear(x, w).float() - ref).abs().max() + 1e-3
    out = torch.empty_like(got)
    graph = capture_cuda_graph(lambda: out.copy_(method.swiglu_linear(gate_up, w)))
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
def test_norm_gemv_fp32_equals_norm_then_linear(n, k, seed, block, with_bias, eps):
    x, res, nw, w, bias = _inputs(n, k, seed, torch.float32, with_bias)
    y, res_out = norm_gemv_triton(x, res, nw, eps, w, bias, block)
    normed, ref_res = add_rms_norm_torch(x, res, nw, eps)
    assert y.shape == (1, n) and res_out.shape == (1, k) and y.dtype == res_out.dtype == torch.float32
    assert torch.equal(res_out, ref_res)  # the sum, stored by program 0 only, over every K tile
    torch.testing.assert_close(y, F.linear(normed, w, bias), rtol=1e-5, atol=1e-5 * k ** 0.5)


def _check_identity_projection(k, seed, block, dtype, device="cpu"):
    """With W = I each output is one product, normed[j] * 1, so it must equal the torch
    path's normalized row bit for bit: the half-precision roundings are in the same places."""
    x, res, nw = (t.to(device) for t in _inputs(k, k, seed, dtype, False)[:3])
    y, res_out = norm_gemv_triton(x, res, nw, 1e-6, torch.eye(k, dtype=dtype, device=device), None, block)
    normed, ref_res = add_rms_norm_torch(x, res, nw, 1e-6)
    assert torch.equal(res_out, ref_res)
    assert torch.equal(y, normed)


@needs_triton
@given(k=st.integers(1, 96), seed=st.integers(0, 2**31), block=st.sampled_from([(4, 32, 4), (8, 64, 4), (2, 16, 4)]))
def test_the_normalized_row_is_rounded_like_rms_norm(k, seed, block):
    # fp16 only: the interpreter rounds fp32 -> bf16 differently from torch (bf16 runs on the GPU below).
    _check_identity_projection(k, seed, block, torch.float16)


@needs_triton
def test_norm_gemv_rejects_what_it_cannot_serve():
    z = torch.zeros
    with pytest.raises(ValueError, match=r"must be \[1, K\]"):
        norm_gemv_triton(z(2, 8), z(2, 8), z(8), 1e-6, z(4, 8), None, (1, 64, 4))
    with pytest.raises(ValueError, match=r"norm_weight \(4,\)"):
        norm_gemv_triton(z(1, 8), z(1, 8), z(4), 1e-6, z(4, 8), None, (1, 64, 4))
    with pytest.raises(ValueError, match="unit stride"):
        norm_gemv_triton(z(1, 8), z(1, 8), z(8), 1e-6, z(8, 4).t(), None, (1, 64, 4))


@needs_triton
@pytest.mark.parametrize("norm_tile", [(2, 16, 4), ()])
def test_add_norm_custom_op_under_compile_serves_every_row_count(norm_tile):
    nw, w, b = torch.randn(16), torch.randn(8, 16), torch.randn(8)
    compiled = torch.compile(lambda x, r: add_norm_linear(x, r, nw, 1e-6, w, b, norm_tile, (2, 16, 4), 0),
                             backend="aot_eager",
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
    from graphrunner.layers.norm import add_rms_norm_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    x, res = (torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    nw = 1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g) if with_bias else None

    def two_kernels():
        normed, r = add_rms_norm_triton(x, res, nw, 1e-6)
        return gemv_triton(normed, w, b, method.tile), r, normed

    method = _gpu_method(n, k)
    assert bool(method.norm_tile) == (k <= KernelConfig().norm_gemv_max_k)
    norm = RMSNorm(k, 1e-6, dtype=torch.bfloat16, device="cuda")
    norm.weight.data.copy_(nw)
    y, res_out = method.add_norm_linear(norm, x, res, w, b)
    ref_y, ref_res, normed = two_kernels()
    assert torch.equal(res_out, ref_res)
    fp32 = F.linear(normed.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(y.float(), fp32, rtol=8e-3, atol=1e-3)  # one rounding of an fp32 sum
    assert (y.float() - fp32).abs().max() <= 2 * (ref_y.float() - fp32).abs().max() + 1e-3
    outs = (torch.empty_like(y), torch.empty_like(res_out))
    graph = capture_cuda_graph(
        lambda: [o.copy_(t) for o, t in zip(outs, method.add_norm_linear(norm, x, res, w, b), strict=True)])
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
    _check_identity_projection(k, 0, norm_gemv_plan(k, k, H200 if wide else H100), torch.bfloat16, "cuda")


def _gpu_method(n: int, k: int) -> GemvMethod:
    """The default method of an [N, K] projection on this GPU."""
    method = choose_linear_method(KernelConfig(), device_properties("cuda"), n, k)
    assert isinstance(method, GemvMethod)
    return method


@pytest.mark.gpu
def test_gpu_this_part_is_in_the_class_its_bandwidth_says():
    """The properties torch reports put this GPU where its datasheet does: an H100 (3.35 TB/s) below the
    wide-memory line, an H200 (4.8 TB/s) above it; the base and wide plans are what each got by name."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    props, name = device_properties("cuda"), torch.cuda.get_device_name()
    assert props is not None and props.memory_bytes_per_s > 0, props
    if "H100" in name:
        assert not props.wide_memory, props
    if "H200" in name:
        assert props.wide_memory, props
