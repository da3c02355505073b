"""small_m_linear (one-launch small-M linear with an optional SwiGLU prologue) against torch.

CPU: the Triton kernel runs interpreted (TRITON_INTERPRET=1, set by conftest) on tiny
shapes (K <= 96, N <= 48: a handful of programs). GPU (`gpu` mark): the decode projection
shapes of the benchmarked models in bf16, and replay inside a captured CUDA graph.

Tolerances: fp32 compares at 2e-5 (same products, another summation order). The SwiGLU
rounding checks use an identity weight, so y *is* the prologue's row: it must equal
`F.silu(gate) * up` bit for bit but for rare ties of the fp32 silu across one rounding
boundary (different exp implementations), and never by more than one ulp. bf16 on the GPU
compares at 1e-2 (one bf16 rounding of outputs of magnitude ~1, plus summation order).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.kernels import HAS_TRITON
from graphrunner_tools.bench.small_m_linear import MAX_SMALL_M, small_m_linear_plan, small_m_linear_ref

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
if HAS_TRITON:
    from graphrunner_tools.bench.small_m_linear import small_m_linear

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

# CPU-sized tests run wherever the suite runs: interpreted Triton on a CPU, real kernels on a GPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (model, proj, N, K, bias, silu_mul): the decode projections tools/bench/gemv_bench.py times.
GPU_SHAPES = [
    ("qwen2.5-0.5b", "qkv", 1152, 896, True, False),
    ("qwen2.5-0.5b", "down", 896, 4864, False, True),
    ("llama-3.2-1b", "o", 2048, 2048, False, False),
    ("llama-3.2-1b", "gate_up", 16384, 2048, False, False),
    ("llama-3.1-8b", "down", 4096, 14336, False, True),
]


def _inputs(seed: int, m: int, n: int, k: int, *, bias: bool, silu_mul: bool, strided: bool,
            dtype: torch.dtype = torch.float32, device: torch.device = DEVICE,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """(x, weight, bias) with unit-scale outputs; x is a column window of a wider tensor when `strided`."""
    gen = torch.Generator().manual_seed(seed)
    width = 2 * k if silu_mul else k
    pad = 5 if strided else 0
    wide = torch.randn(m, width + 2 * pad, generator=gen)  # [M, width + 2 pad]
    w = torch.randn(n, k, generator=gen) * k**-0.5  # [N, K]
    b = torch.randn(n, generator=gen) if bias else None  # [N]
    x = wide.to(device=device, dtype=dtype)[:, pad : pad + width]  # [M, width], row stride width + 2 pad
    return x, w.to(device=device, dtype=dtype), None if b is None else b.to(device=device, dtype=dtype)


def _silu_mul_identity_check(dtype: torch.dtype, use_dot: bool, m: int, k: int, seed: int) -> None:
    """With W = I the output is the prologue's row: it must round like F.silu(gate) * up."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, 2 * k, generator=gen) * 3).to(device=DEVICE, dtype=dtype)  # [M, 2K]
    eye = torch.eye(k, dtype=dtype, device=DEVICE)  # [K, K]
    got = small_m_linear(x, eye, silu_mul=True, use_dot=use_dot)  # [M, K]
    want = F.silu(x[:, :k]) * x[:, k:]  # [M, K]: two roundings, as the kernel must do
    exact = (got == want).float().mean().item()
    assert exact >= 0.99, f"only {exact:.2%} bit-exact"
    ulp = torch.finfo(dtype).eps * want.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert bool(((got.float() - want.float()).abs() <= ulp).all())


# --------------------------------------------------------------------------- CPU-sized


@needs_triton
@given(
    m=st.integers(1, MAX_SMALL_M),
    n=st.integers(1, 48),
    k=st.integers(1, 96),
    bias=st.booleans(),
    silu_mul=st.booleans(),
    use_dot=st.sampled_from([None, False, True]),
    block_k=st.sampled_from([None, 16, 32]),
    strided=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_reference_fp32(m, n, k, bias, silu_mul, use_dot, block_k, strided, seed):
    x, w, b = _inputs(seed, m, n, k, bias=bias, silu_mul=silu_mul, strided=strided)
    y = small_m_linear(x, w, b, silu_mul=silu_mul, use_dot=use_dot, block_k=block_k)
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y, small_m_linear_ref(x, w, b, silu_mul=silu_mul), atol=2e-5, rtol=2e-5)


@needs_triton
@given(m=st.integers(1, MAX_SMALL_M), n=st.integers(1, 40), k=st.integers(1, 80), bias=st.booleans(),
       block_n=st.sampled_from([8, 16, 32]), seed=st.integers(0, 2**16))  # fmt: skip
def test_explicit_tiles_fp16(m, n, k, bias, block_n, seed):
    """fp16 through both products with explicit tiles (fp16 outputs: 2e-3)."""
    x, w, b = _inputs(seed, m, n, k, bias=bias, silu_mul=False, strided=False, dtype=torch.float16)
    want = small_m_linear_ref(x.float(), w.float(), None if b is None else b.float())
    for use_dot in (False, True):
        y = small_m_linear(x, w, b, block_n=max(block_n, 16) if use_dot else block_n, block_k=16, use_dot=use_dot)
        torch.testing.assert_close(y.float(), want, atol=2e-3, rtol=2e-3)


@needs_triton
@pytest.mark.parametrize("use_dot", [False, True])
def test_silu_mul_rounds_like_torch_fp16(use_dot):
    # fp16 only: triton 3.6's interpreter truncates fp32 -> bf16 (and its tl.dot mishandles
    # bf16), so the bf16 roundings are checked by the GPU test below.
    _silu_mul_identity_check(torch.float16, use_dot, m=5, k=40, seed=3)


@needs_triton
def test_zero_rows_launch_nothing():
    y = small_m_linear(torch.empty(0, 24, device=DEVICE), torch.ones(8, 24, device=DEVICE))
    assert y.shape == (0, 8)


@needs_triton
def test_rejects_unsupported_inputs():
    w = torch.zeros(8, 16, device=DEVICE)
    x = torch.zeros(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"M=17.*MAX_SMALL_M=16"):
        small_m_linear(torch.zeros(17, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match=r"expected \[M, 2\*K=32\]"):
        small_m_linear(x, w, silu_mul=True)
    with pytest.raises(ValueError, match=r"expected \[M, K=16\]"):
        small_m_linear(torch.zeros(2, 15, device=DEVICE), w)
    with pytest.raises(ValueError, match=r"weight must be contiguous"):
        small_m_linear(x, torch.zeros(16, 8, device=DEVICE).t())
    with pytest.raises(ValueError, match=r"weight has dtype torch.int32"):
        small_m_linear(x, w.int())
    with pytest.raises(ValueError, match=r"x has dtype torch.float16.*torch.float32"):
        small_m_linear(x.half(), w)
    with pytest.raises(ValueError, match=r"bias has shape \(9,\)"):
        small_m_linear(x, w, torch.zeros(9, device=DEVICE))
    with pytest.raises(ValueError, match=r"block_n=8 .*16\.\.256"):
        small_m_linear(x, w, block_n=8, use_dot=True)
    with pytest.raises(ValueError, match=r"block_k=24"):
        small_m_linear(x, w, block_k=24)
    with pytest.raises(ValueError, match=r"num_warps=3"):
        small_m_linear(x, w, num_warps=3)


@given(m=st.integers(1, MAX_SMALL_M), n=st.integers(1, 1 << 17), k=st.integers(1, 1 << 15),
       device=st.sampled_from(["cpu", DEVICE]))  # fmt: skip
def test_plan_tiles_are_valid(m, n, k, device):
    plan = small_m_linear_plan(m, n, k, device)
    assert plan.block_n in ((16, 32, 64) if plan.use_dot else (8, 16, 32, 64))
    assert plan.block_k & (plan.block_k - 1) == 0 and 16 <= plan.block_k <= 512
    assert plan.block_k <= max(16, 1 << (k - 1).bit_length())  # no tile wider than K needs
    assert plan.programs == -(-n // plan.block_n)
    assert plan.num_warps in (4, 8)


def test_plan_rejects_rows_outside_small_m():
    for m in (0, MAX_SMALL_M + 1):
        with pytest.raises(ValueError, match=rf"M={m} .*MAX_SMALL_M={MAX_SMALL_M}"):
            small_m_linear_plan(m, 64, 64, "cpu")


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("model,proj,n,k,bias,silu_mul", GPU_SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_gpu_bf16_decode_shapes(model, proj, n, k, bias, silu_mul, m):
    x, w, b = _inputs(n + m, m, n, k, bias=bias, silu_mul=silu_mul, strided=False, dtype=torch.bfloat16,
                      device=torch.device("cuda"))  # fmt: skip
    act = F.silu(x[:, :k]) * x[:, k:] if silu_mul else x  # [M, K] bf16, rounded as today
    want = F.linear(act.float(), w.float(), None if b is None else b.float())  # [M, N] fp32
    for use_dot in (None, False, True):
        y = small_m_linear(x, w, b, silu_mul=silu_mul, use_dot=use_dot)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("use_dot", [False, True])
def test_gpu_silu_mul_rounds_like_torch(use_dot):
    _silu_mul_identity_check(torch.bfloat16, use_dot, m=16, k=1024, seed=5)


@pytest.mark.gpu
@needs_triton
def test_gpu_cuda_graph_replay():
    """Capture gate_up -> down (SwiGLU prologue) and a biased qkv once; replay with new inputs."""
    cuda = torch.device("cuda")
    x, w_gu, _ = _inputs(1, 8, 2 * 1024, 512, bias=False, silu_mul=False, strided=False, dtype=torch.bfloat16,
                         device=cuda)  # fmt: skip
    _, w_down, _ = _inputs(2, 8, 512, 1024, bias=False, silu_mul=True, strided=False, dtype=torch.bfloat16,
                           device=cuda)  # fmt: skip
    _, w_qkv, b_qkv = _inputs(3, 8, 768, 512, bias=True, silu_mul=False, strided=False, dtype=torch.bfloat16,
                              device=cuda)  # fmt: skip

    def step():
        gate_up = small_m_linear(x, w_gu)  # [8, 2048]
        return small_m_linear(gate_up, w_down, silu_mul=True), small_m_linear(x, w_qkv, b_qkv)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles the kernels) outside the capture
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_down, out_qkv = step()
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        want_down, want_qkv = step()  # eager: the same kernels, so bit-identical
        torch.cuda.synchronize()
        assert torch.equal(out_down, want_down) and torch.equal(out_qkv, want_qkv)
        ref = small_m_linear_ref(small_m_linear_ref(x.float(), w_gu.float()).to(x.dtype), w_down, silu_mul=True)
        torch.testing.assert_close(out_down.float(), ref.float(), atol=3e-2, rtol=3e-2)
