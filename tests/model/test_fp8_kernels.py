"""fp8 (e4m3) weight projections (graphrunner.layers.fp8) against definitions written here from first principles.

- Quantization round trips: dequantized weights and activations lie within half an e4m3 step of
  the input (relative 2^-4 for normal codes, 2^-10 of the scale for subnormal ones), all-zero rows
  and tiles give zeros and scale 1 (no NaN), huge magnitudes stay finite; the codes equal an
  independent float64 quantization (the e4m3 grid decoded from its bits, ties to even).
- `fp8_linear_reference` against a float64 computation of the same quantized arithmetic, within
  the fp32 summation bound: per-channel, per-tensor, static input scale, bias, block scales.
- The Triton kernels (interpreted on CPU: TRITON_INTERPRET=1 from conftest) on tiny shapes with
  ragged K and N against the reference, within the same bound; the activation quantization kernel
  bit for bit (it exercises the interpreter's emulated fp32 -> fp8 rounding, ties included); the
  custom op's dispatch and fake.
- GPU (`gpu` mark): the GEMV at llama-sized shapes in bf16, the _scaled_mm path, the block GEMM,
  and the op replayed from CUDA graphs with new inputs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.kernels import HAS_TRITON
from graphrunner.layers.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_fp8,
    fp8_gemv_plan,
    fp8_linear,
    fp8_linear_reference,
    quantize_act_fp8,
    quantize_weight_fp8,
)

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
if HAS_TRITON:
    from graphrunner.layers.fp8 import (
        _quantize_act_triton,
        fp8_gemm_triton,
        fp8_gemv_triton,
        fp8_linear_op,
    )

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
F64 = torch.float64
EPS32 = 2.0**-24  # fp32's unit roundoff


# ---------------------------------------------------------------------------------------------
# Independent definitions: the e4m3fn grid from its bits, rounding by search, float64 arithmetic.


def _e4m3_values() -> torch.Tensor:
    """The value of every e4m3fn code 0..255 in float64 (NaN for the two NaN codes), decoded from
    the bits: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal."""
    codes = torch.arange(256, dtype=torch.int64)
    sign = torch.where(codes >= 128, -1.0, 1.0).to(F64)
    exp, man = (codes >> 3) & 15, (codes & 7).to(F64)
    normal = (1 + man / 8) * torch.pow(2.0, (exp - 7).to(F64))
    value = sign * torch.where(exp == 0, man / 8 * 2.0**-6, normal)
    return torch.where((codes & 127) == 127, torch.nan, value)


_VALUES = _e4m3_values()
_POS = _VALUES[:127]  # codes 0..126: 0, 2^-9, ..., 448, increasing


def _round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float64 v clamped to +-448, rounded to the nearest e4m3 value, ties to the even code."""
    a = v.abs().clamp(max=FP8_MAX)
    hi = torch.searchsorted(_POS, a).clamp(max=126)  # first grid value >= a
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - _POS[lo], _POS[hi] - a
    pick = torch.where(d_lo < d_hi, lo, torch.where(d_hi < d_lo, hi, torch.where(lo % 2 == 0, lo, hi)))
    return torch.copysign(_POS[pick], v)


def _scale64(amax: torch.Tensor) -> torch.Tensor:
    # amax / 448 in float64 rounded to fp32 is the fp32 quotient: double rounding of a quotient is
    # harmless when the wide format has >= 2p + 2 bits (53 >= 50).
    s = (amax.to(F64) / FP8_MAX).float().to(F64)
    return torch.where(s >= 2.0**-126, s, torch.ones_like(s))  # below fp32's smallest normal: 1


def _quant64(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The e4m3 values (float64) of the fp32 quotient v / scale, the definition's two roundings: the
    fp32 quotient can be a tie of the e4m3 grid that the exact one is not (0.0171 / 5.09e-5 -> 336.0
    rounds to 320, the exact 336.00000x to 352). float64 then fp32 is the fp32 quotient (53 >= 2 * 24 + 2)."""
    return _round_e4m3((v.to(F64) / scale).float().to(F64))


def _quant64_act(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An activation's e4m3 values: v times the scale's fp32 reciprocal, that product rounded to
    fp32, then to e4m3. The float64 quotient 1 / scale rounded to fp32 is the fp32 one (53 >= 50),
    and the float64 product of two fp32 values is exact."""
    inv = (1.0 / scale.to(F64)).float().to(F64)
    return _round_e4m3((v.to(F64) * inv).float().to(F64))


def _expand(scale: torch.Tensor, bn: int, bk: int, n: int, k: int) -> torch.Tensor:
    return scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def _act64(x: torch.Tensor, group: int | None = None, static: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] quantized and dequantized in float64 (the activation's exact fp8 values times scales)."""
    x64 = x.to(F64)
    t, k = x64.shape
    if static is not None:
        s = static.to(F64).reshape(1, 1)
    elif group is None:
        s = _scale64(x64.abs().amax(dim=1, keepdim=True))
    else:
        g = -(-k // group)
        pad = torch.zeros(t, g * group, dtype=F64)
        pad[:, :k] = x64
        s = _expand(_scale64(pad.view(t, g, group).abs().amax(dim=2)), 1, group, t, k)
    return _quant64_act(x64, s) * s


def _weight_values(w_q: torch.Tensor) -> torch.Tensor:
    """w_q's values in float64, decoded from its bytes."""
    return _VALUES[w_q.view(torch.uint8).long()]


def _weight64(w_q, w_scale, block=None) -> torch.Tensor:
    n, k = w_q.shape
    s = w_scale.to(F64)
    if block is not None:
        s = _expand(s, block[0], block[1], n, k)
    elif s.numel() == 1:
        s = s.reshape(1, 1)
    else:
        s = s.reshape(n, 1)
    return _weight_values(w_q) * s  # exact: 4 x 24 significant bits


def _linear64(x, w_q, w_scale, bias=None, *, block=None, input_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the projection in float64, the bound on an fp32 evaluation's error: (K + 2) u sum |terms|)."""
    xd = _act64(x, block[1] if block is not None else None, input_scale)
    wd = _weight64(w_q, w_scale, block)
    y = xd @ wd.t()
    mag = xd.abs() @ wd.abs().t()
    if bias is not None:
        y, mag = y + bias.to(F64), mag + bias.to(F64).abs()
    return y, (w_q.shape[1] + 2) * EPS32 * mag + 1e-30


def _assert_within(y: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str = "") -> None:
    err = (y.to(F64) - want).abs()
    assert torch.isfinite(y).all(), what
    assert (err <= bound).all(), f"{what}: max excess {(err - bound).max().item():.3g} (max err {err.max():.3g})"


def _matrix(rows: int, cols: int, seed: int, exponent: int, zero_rows: bool = True) -> torch.Tensor:
    """Normal values times 10^exponent, each row scaled by 10^U(-2, 2); with zero_rows some rows all zero."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(rows, cols, generator=g, dtype=F64) * 10.0 ** (4 * torch.rand(rows, 1, generator=g, dtype=F64) - 2)
    if zero_rows and rows > 1:
        m[torch.rand(rows, generator=g) < 0.2] = 0
    return (m * 10.0**exponent).float()


blocks = st.one_of(st.none(), st.tuples(st.integers(1, 160), st.integers(1, 160)))


# ---------------------------------------------------------------------------------------------
# Quantization.


def _check_round_trip(v: torch.Tensor, deq: torch.Tensor, scale_full: torch.Tensor) -> None:
    """Half an e4m3 step: 2^-4 relative for normal codes, 2^-10 * scale for subnormal ones, plus the
    fp32 roundings of the division and of the dequantizing product."""
    v64, d64 = v.to(F64), deq.to(F64)
    assert torch.isfinite(deq).all()
    bound = 2.0**-4 * v64.abs() + 2.0**-10 * scale_full + 4 * EPS32 * v64.abs()
    assert ((d64 - v64).abs() <= bound).all(), ((d64 - v64).abs() - bound).max()


@given(n=st.integers(1, 300), k=st.integers(1, 300), block=blocks, exponent=st.integers(-30, 30),
       seed=st.integers(0, 2**16), bf16=st.booleans())
def test_quantize_weight_round_trip(n, k, block, exponent, seed, bf16):
    w = _matrix(n, k, seed, exponent)
    if bf16:
        w = w.to(torch.bfloat16)
    w_q, scale = quantize_weight_fp8(w, block)
    assert w_q.dtype == FP8_DTYPE and w_q.shape == (n, k) and scale.dtype == torch.float32
    if block is None:
        assert scale.shape == (n,)
        full = scale.to(F64)[:, None].expand(n, k)
        amax = w.float().abs().amax(dim=1)
    else:
        bn, bk = block
        assert scale.shape == (-(-n // bn), -(-k // bk))
        full = _expand(scale.to(F64), bn, bk, n, k)
        nb, kb = scale.shape
        padded = torch.zeros(nb * bn, kb * bk, dtype=F64)
        padded[:n, :k] = w.to(F64).abs()
        amax = padded.view(nb, bn, kb, bk).amax(dim=(1, 3))
    torch.testing.assert_close(scale.to(F64), _scale64(amax), rtol=0, atol=0)  # zero rows/tiles: exactly 1
    deq = dequantize_fp8(w_q, scale, block)
    _check_round_trip(w.float(), deq, full)
    assert torch.equal(_weight_values(w_q), _quant64(w.float(), full))  # the codes, ties to even
    assert (deq[w.float() == 0] == 0).all()


@pytest.mark.parametrize("magnitude", [1e4, 1e20, 1e30, 3.0e38])
def test_quantize_huge_rows_stay_finite(magnitude):
    w = torch.tensor([[magnitude, -magnitude, magnitude / 3, 1.0], [0.0, 0.0, 0.0, 0.0]])
    for block in (None, (1, 2), (2, 3)):
        w_q, scale = quantize_weight_fp8(w, block)
        deq = dequantize_fp8(w_q, scale, block)
        assert torch.isfinite(deq).all() and torch.isfinite(scale).all()
        assert not torch.isnan(w_q.float()).any()
        assert (w_q.float().abs() <= FP8_MAX).all()
        assert deq[0, 0] == pytest.approx(magnitude, rel=2.0**-4) and (deq[1] == 0).all()
    x_q, x_scale = quantize_act_fp8(w)
    assert torch.isfinite(dequantize_fp8(x_q, x_scale)).all() and x_scale[1, 0] == 1.0


@pytest.mark.parametrize("magnitude", [1e-36, 1e-40, 1e-45])
def test_quantize_tiny_rows_give_zeros_not_nan(magnitude):
    """A row whose amax / 448 is below fp32's smallest normal gets scale 1 (its reciprocal would be
    inf, and 0 * inf NaN): its values, far below e4m3's smallest subnormal 2^-9, quantize to 0."""
    x = torch.tensor([[magnitude, -magnitude, 0.0, magnitude / 2]])
    for group in (None, 2):
        x_q, scale = quantize_act_fp8(x, group)
        assert (scale == 1.0).all() and (x_q.float() == 0).all()
    w_q, w_scale = quantize_weight_fp8(x)
    assert w_scale.item() == 1.0 and (w_q.float() == 0).all()


@given(t=st.integers(1, 40), k=st.integers(1, 300), group=st.one_of(st.none(), st.integers(1, 160)),
       exponent=st.integers(-30, 30), seed=st.integers(0, 2**16))
def test_quantize_act_round_trip(t, k, group, exponent, seed):
    x = _matrix(t, k, seed, exponent)
    x_q, scale = quantize_act_fp8(x, group)
    assert x_q.dtype == FP8_DTYPE and scale.shape == ((t, 1) if group is None else (t, -(-k // group)))
    g = group or k
    full = _expand(scale.to(F64), 1, g, t, k)
    deq = dequantize_fp8(x_q, scale, (1, g) if group else None)
    _check_round_trip(x, deq, full)
    torch.testing.assert_close(deq.to(F64), _act64(x, group), rtol=EPS32, atol=0)  # one fp32 rounding apart
    assert torch.equal(_weight_values(x_q), _quant64_act(x, full))


def test_quantize_act_static_scale_clamps():
    x = torch.tensor([[1.0, -1.0, 1e6, -1e6, 0.0, 3.3]])
    s = torch.tensor([0.01])
    x_q, scale = quantize_act_fp8(x, static_scale=s)
    assert scale.shape == (1, 1) and scale.item() == pytest.approx(0.01)
    assert x_q.float()[0, :4].tolist() == [96.0, -96.0, 448.0, -448.0]  # 100 -> 96 (step 8 there), +-1e8 clamps
    assert x_q.float()[0, 4] == 0 and torch.equal(_weight_values(x_q), _quant64_act(x, s.to(F64)))
    x_q2, scale2 = quantize_act_fp8(torch.cat([x, x]), static_scale=s)
    assert scale2.shape == (2, 1)


def test_dequantize_layouts():
    q = torch.tensor([[1.0, 2.0, -4.0], [0.5, 448.0, 0.0]]).to(FP8_DTYPE)
    torch.testing.assert_close(dequantize_fp8(q, torch.tensor([2.0])), q.float() * 2)
    for s in (torch.tensor([2.0, 3.0]), torch.tensor([[2.0], [3.0]])):
        torch.testing.assert_close(dequantize_fp8(q, s), q.float() * torch.tensor([[2.0], [3.0]]))
    tiles = torch.tensor([[2.0, 5.0], [3.0, 7.0]])  # (1, 2) tiles over 3 columns: the last is partial
    torch.testing.assert_close(dequantize_fp8(q, tiles, (1, 2)),
                               q.float() * torch.tensor([[2.0, 2.0, 5.0], [3.0, 3.0, 7.0]]))


# ---------------------------------------------------------------------------------------------
# The reference projection.


@given(t=st.integers(1, 12), n=st.integers(1, 70), k=st.integers(1, 150), block=blocks,
       kind=st.sampled_from(["channel", "tensor", "static"]), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_reference_matches_float64(t, n, k, block, kind, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = _matrix(t, k, seed + 1, 0)
    w_q, w_scale = quantize_weight_fp8(_matrix(n, k, seed, -1), block)
    input_scale = None
    if block is None and kind == "tensor":
        w_scale = w_scale.amax().reshape(1)
        w_q = (dequantize_fp8(w_q, quantize_weight_fp8(_matrix(n, k, seed, -1))[1]) / w_scale).to(FP8_DTYPE)
    if block is None and kind == "static":
        input_scale = (x.abs().amax() / 300).reshape(1)  # some values clamp at 448
    b = torch.randn(n, generator=g) if bias else None
    y = fp8_linear_reference(x, w_q, w_scale, b, block=block, input_scale=input_scale)
    assert y.dtype == torch.float32 and y.shape == (t, n)
    want, bound = _linear64(x, w_q, w_scale, b, block=block, input_scale=input_scale)
    _assert_within(y, want, bound, f"{kind} block={block}")


def test_reference_rounds_once_to_the_input_dtype():
    x = _matrix(5, 64, 0, 0, zero_rows=False).to(torch.bfloat16)
    w_q, w_scale = quantize_weight_fp8(_matrix(24, 64, 1, 0))
    b = torch.randn(24).to(torch.bfloat16)
    y = fp8_linear_reference(x, w_q, w_scale, b)
    assert y.dtype == torch.bfloat16
    y32 = fp8_linear_reference(x, w_q, w_scale, b, out_dtype=torch.float32)
    assert torch.equal(y, y32.to(torch.bfloat16))
    want, bound = _linear64(x, w_q, w_scale, b)
    _assert_within(y32, want, bound)
    assert torch.equal(fp8_linear(x.view(5, 1, 64), w_q, w_scale, b), y.view(5, 1, 24))  # CPU: the reference
    with pytest.raises(ValueError):
        fp8_linear_reference(x, w_q, w_scale, block=(1, 16), input_scale=torch.ones(1))


def test_gemv_plan_fits_the_register_budget():
    """Every planned tile: powers of two, 8 to 64 fp32 accumulators per thread (the range swept),
    and no more columns per step than K needs (a 896-column row is not read in 4096-wide steps)."""
    for n, k in [(896, 896), (1152, 896), (4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336),
                 (128256, 4096), (1024, 100), (9728, 896), (896, 4864)]:
        block_n, block_k, warps = fp8_gemv_plan(n, k)
        assert all(v & (v - 1) == 0 for v in (block_n, block_k, warps))
        assert 8 <= block_n * block_k // (32 * warps) <= 64
        assert block_k <= max(1024, k)


# ---------------------------------------------------------------------------------------------
# The Triton kernels, interpreted on CPU (and natively on a GPU).


def _case(m, n, k, block, kind, bias, seed, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = _matrix(m, k, seed + 1, 0, zero_rows=False).to(dtype)
    w_q, w_scale = quantize_weight_fp8(_matrix(n, k, seed, -1), block)
    input_scale = None
    if block is None and kind == "tensor":
        w_scale = w_scale.amax().reshape(1)
        w_q = _matrix(n, k, seed, 0).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    if block is None and kind == "static":
        input_scale = (x.float().abs().amax() / 300).reshape(1)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
    moved = [v.to(device) if v is not None else None for v in (x, w_q, w_scale, b, input_scale)]
    return moved


def _check_against_reference(y, x, w_q, w_scale, b, block, input_scale, what=""):
    """y (fp32 x) against the reference within twice the fp32 summation bound (two orders)."""
    ref = fp8_linear_reference(x, w_q, w_scale, b, block=block, input_scale=input_scale)
    want, bound = _linear64(x.cpu(), w_q.cpu(), w_scale.cpu(), None if b is None else b.cpu(), block=block,
                            input_scale=None if input_scale is None else input_scale.cpu())
    _assert_within(ref.cpu(), want, bound, "reference " + what)
    _assert_within(y.cpu(), want, bound, what)


kernel_kinds = st.sampled_from(["channel", "tensor", "static", "block"])


@needs_triton
@given(n=st.integers(1, 40), k=st.integers(1, 100), kind=kernel_kinds, bn=st.integers(1, 20),
       bk=st.sampled_from([16, 32]), tile=st.sampled_from([(2, 16, 4), (4, 32, 4), (8, 64, 2)]),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_gemv_interpreted(n, k, kind, bn, bk, tile, bias, seed):
    block = (bn, bk) if kind == "block" else None
    x, w_q, w_scale, b, input_scale = _case(1, n, k, block, kind, bias, seed)
    y = fp8_gemv_triton(x, w_q, w_scale, b, tile, block=block, input_scale=input_scale)
    assert y.shape == (1, n) and y.dtype == x.dtype
    _check_against_reference(y, x, w_q, w_scale, b, block, input_scale, f"gemv {kind} {tile}")


@needs_triton
@given(m=st.integers(2, 20), n=st.integers(1, 40), k=st.integers(33, 90), kind=kernel_kinds, bn=st.integers(1, 20),
       bk=st.sampled_from([16, 32]), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_gemm_interpreted(m, n, k, kind, bn, bk, bias, seed):
    block = (bn, bk) if kind == "block" else None
    x, w_q, w_scale, b, input_scale = _case(m, n, k, block, kind, bias, seed)
    tile = (16, 16, bk if block else 32, 4)
    y = fp8_gemm_triton(x, w_q, w_scale, b, block=block, input_scale=input_scale, tile=tile)
    assert y.shape == (m, n)
    _check_against_reference(y, x, w_q, w_scale, b, block, input_scale, f"gemm {kind}")


@needs_triton
@pytest.mark.parametrize("block", [(12, 32), (1, 16), (40, 16)])
def test_block_kernels_interpreted(block):
    """The block format on fixed ragged shapes (K = 90: partial last group; N = 37: partial last
    BLOCK_N and weight row block), so every run multiplies several K groups' scales."""
    x, w_q, w_scale, b, _ = _case(5, 37, 90, block, "block", True, sum(block))
    y = fp8_gemm_triton(x, w_q, w_scale, b, block=block, tile=(16, 16, block[1], 4))
    _check_against_reference(y, x, w_q, w_scale, b, block, None, f"gemm {block}")
    y1 = fp8_gemv_triton(x[2:3], w_q, w_scale, b, (8, 32, 4), block=block)
    _check_against_reference(y1, x[2:3], w_q, w_scale, b, block, None, f"gemv {block}")


def _ties_and_grid() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (ties), values just off them, and
    values past 448: x / 1.0 must round as torch rounds."""
    pos = _POS.float()
    mid = (pos[:-1] + pos[1:]) / 2
    vals = torch.cat([pos, mid, mid.nextafter(torch.tensor(0.0)), mid.nextafter(torch.tensor(1e9)),
                      torch.tensor([448.5, 460.0, 480.0, 1e6, 2.0**-12, 2.0**-10, 3 * 2.0**-11])])
    return torch.cat([vals, -vals])[None, :]


@needs_triton
def test_activation_quantization_kernel_bit_for_bit():
    """The kernels' fp32 -> fp8 rounding (emulated in the interpreter, the hardware's on a GPU)
    against torch's, on every tie of the e4m3 grid, and the per-token / group / static scales."""
    ties = _ties_and_grid()
    q, s = _quantize_act_triton(ties, torch.ones(1))
    q_ref, _ = quantize_act_fp8(ties, static_scale=torch.ones(1))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    x = torch.cat([_matrix(6, 150, 3, 0), torch.zeros(1, 150), _matrix(2, 150, 4, 30)])
    for group in (None, 16, 32):
        q, s = _quantize_act_triton(x, None, group)
        q_ref, s_ref = quantize_act_fp8(x, group)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref), group


@needs_triton
def test_gemv_quantizes_ties_as_torch():
    """The GEMV's in-kernel quantization rounds the grid's ties as torch does: with W = I (scale 1)
    and a static scale of 1 each output is one quantized activation."""
    ties = _ties_and_grid()
    k = ties.shape[1]
    w_q = torch.eye(k).to(FP8_DTYPE)
    y = fp8_gemv_triton(ties, w_q, torch.ones(1), None, (128, 256, 4), input_scale=torch.ones(1))  # few programs
    assert torch.equal(y, quantize_act_fp8(ties, static_scale=torch.ones(1))[0].float())


@needs_triton
def test_op_dispatch_and_fake_on_cpu():
    """graphrunner::fp8_linear on CPU tensors (interpreted): one row through the GEMV, several
    through the Triton GEMM, a group that is no power of two through the reference; its fake gives
    [T, N] in x's dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for m, block in [(1, None), (3, None), (1, (4, 16)), (3, (4, 32)), (2, (4, 24))]:
        x, w_q, w_scale, b, _ = _case(m, 20, 70, block, "block" if block else "channel", True, m)
        y = fp8_linear_op(x, w_q, w_scale, b, None, block or (), (4, 32, 4))
        _check_against_reference(y, x, w_q, w_scale, b, block, None, f"op m={m} block={block}")
    x16 = x.to(torch.bfloat16)
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x16)
        out = fp8_linear_op(fx, mode.from_tensor(w_q), mode.from_tensor(w_scale), None, None, (4, 24), (4, 32, 4))
        assert out.shape == (2, 20) and out.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# GPU.


def _bf16_bound(want: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    # Two fp32 results within `bound` of `want`, each rounded to bf16: up to an ulp apart (2^-7 relative).
    return 2 * bound + 2.0**-7 * want.abs()


def _gpu_check(y, x, w_q, w_scale, b, block, input_scale, what):
    ref = fp8_linear_reference(x, w_q, w_scale, b, block=block, input_scale=input_scale)
    want, bound = _linear64(x.cpu(), w_q.cpu(), w_scale.cpu(), None if b is None else b.cpu(), block=block,
                            input_scale=None if input_scale is None else input_scale.cpu())
    assert y.dtype == x.dtype and y.shape == ref.shape
    _assert_within(ref.cpu(), want, _bf16_bound(want, bound), "reference " + what)
    _assert_within(y.cpu(), want, _bf16_bound(want, bound), what)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [2048, 4096, 14336])
@pytest.mark.parametrize("n", [1024, 4096, 6144])
@pytest.mark.parametrize("kind", ["channel", "static", "block"])
def test_gpu_gemv(n, k, kind):
    block = (128, 128) if kind == "block" else None
    x, w_q, w_scale, b, input_scale = _case(1, n, k, block, kind, True, n + k, "cuda", torch.bfloat16)
    y = fp8_linear(x, w_q, w_scale, b, block=block, input_scale=input_scale)
    _gpu_check(y, x, w_q, w_scale, b, block, input_scale, f"gemv {kind} {n}x{k}")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [2, 16, 64, 256])
@pytest.mark.parametrize("kind", ["channel", "tensor", "static"])
def test_gpu_scaled_mm(t, kind):
    from graphrunner.layers.fp8 import _scaled_mm_fits

    x, w_q, w_scale, b, input_scale = _case(t, 6144, 4096, None, kind, True, t, "cuda", torch.bfloat16)
    assert _scaled_mm_fits(x, w_q, b)
    y = fp8_linear(x, w_q, w_scale, b, input_scale=input_scale)
    _gpu_check(y, x, w_q, w_scale, b, None, input_scale, f"_scaled_mm {kind} t={t}")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16, 256])
@pytest.mark.parametrize("n, k", [(6144, 4096), (1000, 1000)])
def test_gpu_block_gemm(t, n, k):
    x, w_q, w_scale, b, _ = _case(t, n, k, (128, 128), "block", True, t, "cuda", torch.bfloat16)
    y = fp8_linear(x, w_q, w_scale, b, block=(128, 128))
    _gpu_check(y, x, w_q, w_scale, b, (128, 128), None, f"block t={t} {n}x{k}")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [2, 64])
def test_gpu_triton_gemm_where_scaled_mm_refuses(t):
    """K and N not multiples of 16, and fp16 activations: the Triton GEMM, per channel."""
    for n, k, dtype in [(1000, 1000, torch.bfloat16), (512, 1024, torch.float16)]:
        x, w_q, w_scale, b, _ = _case(t, n, k, None, "channel", True, t, "cuda", dtype)
        y = fp8_linear(x, w_q, w_scale, b)
        _gpu_check(y, x, w_q, w_scale, b, None, None, f"gemm {n}x{k} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16])
@pytest.mark.parametrize("kind", ["channel", "block"])
def test_gpu_op_replays_from_cuda_graph(t, kind):
    block = (128, 128) if kind == "block" else None
    x, w_q, w_scale, b, _ = _case(t, 2048, 4096, block, kind, True, 7, "cuda", torch.bfloat16)
    tile = fp8_gemv_plan(2048, 4096)
    blk = block or ()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp8_linear_op(x, w_q, w_scale, b, None, blk, tile)  # warm-up: compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear_op(x, w_q, w_scale, b, None, blk, tile)
    for seed in (1, 2):
        x.copy_(_matrix(t, 4096, seed, 1, zero_rows=False).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fp8_linear_op(x, w_q, w_scale, b, None, blk, tile))
        _gpu_check(out, x, w_q, w_scale, b, block, None, f"graph {kind} t={t}")


@pytest.mark.gpu
def test_gpu_gemm_wgmma_tiles_stay_close_at_long_k():
    """fp32 activations, K = 4096: the 64-row tile (fp8 wgmma, its partial sums promoted every 128 columns)
    within 1e-3 of the float64 reference relative to the output's scale, the 16-row tile (mma.sync, fp32
    accumulation) within 3e-5. Unpromoted wgmma chains lose about 2% at this K (DeepSeek-V3's measure)."""
    x, w_q, w_scale, _, _ = _case(64, 512, 4096, None, "channel", False, 11, "cuda", torch.float32)
    want = fp8_linear_reference(x.double().cpu(), w_q.cpu(), w_scale.cpu())
    for tile, bound in (((64, 128, 128, 4), 1e-3), ((16, 128, 128, 4), 3e-5)):
        got = fp8_gemm_triton(x, w_q, w_scale, None, tile=tile).double().cpu()
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < bound, (tile, err)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(4096, 14336), (1024, 1000)])
def test_gpu_swiglu_gemv_equals_silu_mul_then_the_gemv(n, k):
    from graphrunner.layers.gemv import silu_mul_triton

    _, w_q, w_scale, _, _ = _case(1, n, k, None, "channel", False, n, "cuda", torch.bfloat16)
    gate_up = (_matrix(1, 2 * k, 3, 0, zero_rows=False) * 3).to(torch.bfloat16).cuda()
    tile = fp8_gemv_plan(n, k)
    want = fp8_gemv_triton(silu_mul_triton(gate_up), w_q, w_scale, None, tile)
    assert torch.equal(fp8_gemv_triton(gate_up, w_q, w_scale, None, tile, swiglu=True), want)
    assert torch.equal(fp8_linear(gate_up, w_q, w_scale, swiglu=True, tile=tile), want)


@pytest.mark.gpu
def test_gpu_op_under_torch_compile():
    x, w_q, w_scale, b, _ = _case(8, 1024, 2048, (128, 128), "block", True, 3, "cuda", torch.bfloat16)
    fn = torch.compile(lambda v: fp8_linear(v, w_q, w_scale, b, block=(128, 128), tile=(4, 1024, 4)), fullgraph=True)
    for rows in (8, 1):
        assert torch.equal(fn(x[:rows]), fp8_linear(x[:rows], w_q, w_scale, b, block=(128, 128), tile=(4, 1024, 4)))


_PROMOTION_PTX = """
import re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from graphrunner.layers.fp8 import _fp8_gemm_kernel
sig = dict(x_ptr="*fp32", w_ptr="*u8", ws_ptr="*fp32", xs_ptr="*fp32", b_ptr="*fp32", y_ptr="*fp32", M="i32",
           N="i32", K="i32", stride_xm="i32", stride_wn="i32", stride_ym="i32", stride_wsn="i32", BN_W="i32")
consts = dict(MODE=0, W_PER_ROW=True, HAS_BIAS=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, EVEN_K=True)
src = ASTSource(fn=_fp8_gemm_kernel, signature={**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts)
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3)).asm["ptx"]
print(len(re.findall(r"wgmma.mma_async", ptx)), len(re.findall(r"\\badd(?:\\.rn)?\\.f32", ptx)))
"""


@needs_triton
@given(n=st.integers(1, 40), k=st.integers(1, 100), kind=st.sampled_from(["channel", "tensor", "static"]),
       tile=st.sampled_from([(2, 16, 4), (4, 32, 4), (8, 64, 2)]), bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_swiglu_gemv_equals_silu_mul_then_the_gemv(n, k, kind, tile, bias, dtype, seed):
    """The one-row GEMV that forms silu(gate) * up while it loads x gives, bit for bit, the SiLU·mul
    kernel's row (fp32 math, one rounding to the row's dtype) through the plain GEMV."""
    from graphrunner.layers.gemv import silu_mul_triton

    _, w_q, w_scale, b, input_scale = _case(1, n, k, None, kind, bias, seed)
    gate_up = (_matrix(1, 2 * k, seed + 5, 0, zero_rows=False) * 3).to(dtype)
    b = None if b is None else b.to(dtype)
    want = fp8_gemv_triton(silu_mul_triton(gate_up), w_q, w_scale, b, tile, input_scale=input_scale)
    got = fp8_gemv_triton(gate_up, w_q, w_scale, b, tile, input_scale=input_scale, swiglu=True)
    assert got.shape == (1, n) and torch.equal(got, want)
    # Through the dispatch: CPU takes torch's SiLU·mul and the reference, as the unfused layer does.
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(fp8_linear(gate_up, w_q, w_scale, b, input_scale=input_scale, swiglu=True),
                       fp8_linear(torch.nn.functional.silu(gate) * up, w_q, w_scale, b, input_scale=input_scale))


@needs_triton
def test_the_gemm_promotes_hopper_fp8_partial_sums_every_k_step():
    """Compiled for sm_90 without a GPU: a 64 x 128 tile's four fp8 wgmma per 128 columns, then its 64
    accumulators per thread added into the fp32 sum (Triton's default on sm_90 leaves an fp8 wgmma
    chain in the tensor core's reduced-precision accumulator over the whole K: no such adds)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _PROMOTION_PTX], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0 and "ptxas" in done.stderr and "not found" in done.stderr:  # pragma: no cover
        pytest.skip("this triton has no CUDA toolchain to compile with")
    assert done.returncode == 0, done.stderr[-2000:]
    wgmma, adds = map(int, done.stdout.split())
    assert wgmma == 4 and adds >= 64, done.stdout
