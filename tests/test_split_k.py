"""Split-K row projections summed by the next residual add (graphrunner/layers/split_k.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.config import LoadConfig
from graphrunner.kernels import HAS_TRITON
from graphrunner.layers import split_k
from graphrunner.layers.linear import RowLinear
from graphrunner.layers.norm import RMSNorm, add_rms_norm_torch, add_rms_norm_triton
from graphrunner.layers.split_k import is_partials, settle, split_k_partials, split_k_parts
from graphrunner.models.loader import load_model_config
from tests.hf_fixtures import make_hf_checkpoint
from tests.test_models import _load, _run

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the interpreter on CPU)")


def _operands(rows, n, k, seed, dtype, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=g).to(dtype).to(device),
            (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype).to(device))


@given(rows=st.integers(1, 9), n=st.integers(1, 24), slice_k=st.integers(1, 40), parts=st.integers(1, 4),
       seed=st.integers(0, 2**31), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_each_partial_is_its_slice_product(rows, n, slice_k, parts, seed, dtype):
    x, w = _operands(rows, n, slice_k * parts, seed, dtype)
    p = split_k_partials(x, w, parts)
    assert p.shape == (parts, rows, n) and p.dtype == torch.float32 and is_partials(p)
    for s in range(parts):
        cols = slice(s * slice_k, (s + 1) * slice_k)
        torch.testing.assert_close(p[s], x[:, cols].float() @ w[:, cols].float().T, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(p.sum(0), x.float() @ w.float().T, rtol=1e-5, atol=1e-5)


def test_partials_reject_what_they_cannot_split():
    x, w = _operands(2, 3, 10, 0, torch.float32)
    with pytest.raises(ValueError, match="multiple of parts=3"):
        split_k_partials(x, w, 3)
    with pytest.raises(ValueError, match="unit stride"):
        split_k_partials(x.t().contiguous().t(), w, 2)


def test_settle_sums_once_and_passes_plain_outputs_through():
    p = torch.tensor([[[1.0, 2.0]], [[0.5, -2.0]]])  # [S=2, T=1, N=2]
    assert torch.equal(settle(p, torch.bfloat16), torch.tensor([[1.5, 0.0]], dtype=torch.bfloat16))
    plain = torch.ones(3, 2, dtype=torch.bfloat16)
    assert settle(plain, torch.bfloat16) is plain and not is_partials(plain)


def _partials_and_residual(rows, hidden, parts, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(parts, rows, hidden, generator=g)
    return p, torch.randn(rows, hidden, generator=g).to(dtype), (1 + 0.3 * torch.randn(hidden, generator=g)).to(dtype)


@given(rows=st.integers(1, 6), hidden=st.integers(1, 80), parts=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_torch_norm_of_partials_is_the_norm_of_their_rounded_sum(rows, hidden, parts, seed):
    p, res, nw = _partials_and_residual(rows, hidden, parts, seed, torch.float16)
    normed, new_res = add_rms_norm_torch(p, res, nw, 1e-6)
    ref_normed, ref_res = add_rms_norm_torch(p.sum(0).to(torch.float16), res, nw, 1e-6)
    assert new_res.dtype == normed.dtype == torch.float16
    assert torch.equal(new_res, ref_res) and torch.equal(normed, ref_normed)


@needs_triton
@given(rows=st.integers(1, 6), hidden=st.integers(1, 80), parts=st.integers(1, 4), seed=st.integers(0, 2**31),
       dtype=st.sampled_from([torch.float32, torch.float16]))
def test_triton_norm_sums_partials_like_the_reference(rows, hidden, parts, seed, dtype):
    p, res, nw = _partials_and_residual(rows, hidden, parts, seed, dtype)
    normed, new_res = add_rms_norm_triton(p, res, nw, 1e-6)
    ref_normed, ref_res = add_rms_norm_torch(p, res, nw, 1e-6)
    assert normed.shape == new_res.shape == (rows, hidden) and normed.dtype == dtype
    # The kernel sums the parts in order, torch.sum may pair them: one fp32 ulp apart at most, which
    # a half-precision rounding can carry to one ulp of the dtype.
    tol = {torch.float32: 1e-5, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(new_res, ref_res, rtol=tol, atol=tol)
    torch.testing.assert_close(normed, ref_normed, rtol=tol, atol=tol)


@needs_triton
def test_triton_norm_rejects_half_precision_partials():
    p, res, nw = _partials_and_residual(2, 8, 2, 0, torch.float16)
    with pytest.raises(ValueError, match=r"fp32 \[S, T, hidden\]"):
        add_rms_norm_triton(p.half(), res, nw, 1e-6)
    with pytest.raises(ValueError, match="must be"):
        add_rms_norm_triton(p[:, :1], res, nw, 1e-6)


def test_the_plan_splits_only_what_it_may(monkeypatch):
    x, w = _operands(8, 896, 4864, 0, torch.bfloat16)
    assert split_k_parts(x, w) == 1  # CPU: only measured CUDA parts split
    monkeypatch.setattr(split_k, "FORCE_PARTS", 4)
    assert split_k_parts(x, w) == 4
    assert split_k_parts(x[:1], w) == 1  # one row: the GEMV path
    assert split_k_parts(*_operands(8, 16, 30, 0, torch.bfloat16)) == 1  # K not a multiple of 4
    monkeypatch.setattr(split_k, "SPLIT_K", False)
    assert split_k_parts(x, w) == 1


def test_row_linear_hands_over_partials_only_at_one_rank_without_bias(monkeypatch):
    monkeypatch.setattr(split_k, "FORCE_PARTS", 2)
    x = torch.randn(3, 8)
    plain = RowLinear(8, 5, dtype=torch.float32)
    assert plain(x).shape == (2, 3, 5)
    torch.testing.assert_close(settle(plain(x), torch.float32), x @ plain.weight.T)
    assert RowLinear(8, 5, bias=True, dtype=torch.float32)(x).shape == (3, 5)
    sharded = RowLinear(8, 5, dtype=torch.float32, tp_size=2, all_reduce=lambda t: t)
    assert sharded(x[:, :4]).shape == (3, 5)
    norm = RMSNorm(5, dtype=torch.float32)
    normed, res = norm.add_norm(plain(x), torch.zeros(3, 5))
    torch.testing.assert_close(res, x @ plain.weight.T, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = make_hf_checkpoint("llama3", tmp_path_factory.mktemp("split_k"), seed=3)
    return _load(load_model_config(str(path)), LoadConfig(model=str(path)))


@pytest.mark.parametrize("parts", [2, 4])
def test_model_logits_unchanged_by_split_projections(tiny_llama, monkeypatch, parts):
    gen = torch.Generator().manual_seed(parts)
    ids = torch.randint(0, tiny_llama.config.vocab_size, (12,), generator=gen)
    pos = torch.arange(5, 17)
    plain = _run(tiny_llama, ids, pos)
    monkeypatch.setattr(split_k, "FORCE_PARTS", parts)
    split = _run(tiny_llama, ids, pos)
    assert plain.std() > 0.1
    torch.testing.assert_close(split, plain, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("n", "k", "rows"), [(896, 4864, 256), (896, 896, 64), (2048, 8192, 8), (4096, 14336, 32)])
def test_cuda_partials_and_the_summing_norm(n, k, rows):
    x, w = _operands(rows, n, k, 0, torch.bfloat16, "cuda")
    parts = split_k_parts(x, w)
    if torch.cuda.get_device_capability() == (9, 0):
        assert parts > 1, "a measured shape splits on sm_90"
    parts = max(parts, 2)
    p = split_k_partials(x, w, parts)
    torch.testing.assert_close(p.sum(0), x.float() @ w.float().T, rtol=1e-4, atol=1e-3)
    res = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    nw = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
    got = add_rms_norm_triton(p, res, nw, 1e-6)
    ref = add_rms_norm_torch(settle(p, torch.bfloat16), res, nw, 1e-6)
    for a, b in zip(got, ref, strict=True):  # the fp32 sums may differ by one ulp before the bf16 rounding
        torch.testing.assert_close(a, b, rtol=8e-3, atol=8e-3)
