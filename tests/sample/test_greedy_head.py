"""The LM head with an argmax epilogue (graphrunner/sample/greedy_head.py): torch.argmax of the
logits, without writing them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.config import KernelConfig
from graphrunner.kernels import HAS_TRITON
from graphrunner.layers import embedding
from graphrunner.layers.embedding import LMHead
from graphrunner.protocol import SamplingParams
from graphrunner.sample.greedy_head import (
    PERSISTENT_MIN_ROWS,
    descriptors_fit,
    greedy_head_fits,
    greedy_head_loads,
    greedy_head_plan,
    greedy_head_serves,
    greedy_head_triton,
    vocab_fits,
)
from tests.cuda_graphs import capture_cuda_graph
from tests.runner_driver import Driver, make_runner

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the interpreter on CPU)")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
TILES = [(16, 16, 16, 4, 1), (16, 32, 16, 4, 1), (32, 16, 32, 4, 1), (16, 64, 16, 4, 1)]


@needs_triton
@given(rows=st.integers(1, 40), vocab=st.integers(1, 200), k=st.integers(1, 40), seed=st.integers(0, 2**31),
       tiles=st.sampled_from(TILES), out_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_equals_torch_argmax_of_the_logits_ties_included(rows, vocab, k, seed, tiles, out_dtype):
    """Small integers make every logit an exact fp32 sum, so ties are exact and frequent: the
    first index of the max must win, across the tiles of a row as inside one."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (rows, k), generator=g).float()
    w = torch.randint(-2, 3, (vocab, k), generator=g).float()
    out = torch.full((rows,), -1, dtype=out_dtype)
    greedy_head_triton(x, w, out, tiles=tiles)
    assert torch.equal(out, F.linear(x, w).argmax(dim=-1).to(out_dtype))


@needs_triton
@given(rows=st.integers(PERSISTENT_MIN_ROWS, PERSISTENT_MIN_ROWS + 40), vocab=st.integers(1, 200),
       k4=st.integers(1, 10), seed=st.integers(0, 2**31), tiles=st.sampled_from(TILES))
def test_persistent_descriptor_kernel_equals_torch_argmax_ties_included(rows, vocab, k4, seed, tiles):
    """From PERSISTENT_MIN_ROWS rows, the persistent tensor-descriptor kernel on the same exact-sum logits:
    K a multiple of 4 (16-byte fp32 rows) but not always of BK, so boxes past K, past V and past the
    rows arrive as zeros and must change nothing."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (rows, 4 * k4), generator=g).float()
    w = torch.randint(-2, 3, (vocab, 4 * k4), generator=g).float()
    assert descriptors_fit(x, w, tiles[:3]) and greedy_head_loads(rows) == "tma_persistent"
    out = torch.full((rows,), -1, dtype=torch.int64)
    greedy_head_triton(x, w, out, tiles=tiles)
    assert torch.equal(out, F.linear(x, w).argmax(dim=-1))


def test_descriptors_fit_only_aligned_rows_and_boxes():
    x, w = torch.zeros(4, 8), torch.zeros(100, 8)
    assert descriptors_fit(x, w, (16, 16, 16))
    assert not descriptors_fit(torch.zeros(4, 6), torch.zeros(100, 6), (16, 16, 16))  # 24-byte rows
    assert not descriptors_fit(torch.zeros(4, 9)[:, :8], w, (16, 16, 16))  # 36-byte row stride
    assert not descriptors_fit(x, w, (16, 16, 2))  # 8-byte boxes along K
    assert not descriptors_fit(x, w, (16, 512, 16))  # a box side over 256


@needs_triton
def test_rows_a_descriptor_cannot_describe_take_the_pointer_kernel():
    g = torch.Generator().manual_seed(1)
    rows = PERSISTENT_MIN_ROWS
    x, w = torch.randn(rows, 6, generator=g), torch.randn(70, 6, generator=g)  # 24-byte rows
    assert not descriptors_fit(x, w, TILES[0][:3])
    out = torch.empty(rows, dtype=torch.int64)
    greedy_head_triton(x, w, out, tiles=TILES[0])
    assert torch.equal(out, F.linear(x, w).argmax(dim=-1))


@needs_triton
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
@pytest.mark.parametrize("tiles", TILES[:2])
@pytest.mark.parametrize("rows", [3, PERSISTENT_MIN_ROWS])  # the pointer kernel, the persistent one
def test_nan_and_infinite_logits_follow_torch(tiles, rows):
    """A NaN logit wins at its first column; +inf beats every number; a row of -inf gives 0."""
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])[torch.arange(rows) % 3]  # [rows, 2]
    x, w = F.pad(x, (0, 2)), torch.zeros(70, 4)  # 16-byte rows (the descriptor kernels); the pad adds 0 * 0
    w[5, 0], w[40, 0], w[9, 1] = float("nan"), float("nan"), float("inf")
    w[:, 0] = torch.where(torch.isnan(w[:, 0]), w[:, 0], torch.full((70,), float("inf")))
    logits = F.linear(x, w)  # row 0: NaN at 5 and 40, +inf elsewhere; row 1: +inf at 9; row 2: NaN / -inf
    out = torch.empty(rows, dtype=torch.int64)
    greedy_head_triton(x, w, out, tiles=tiles)
    assert torch.equal(out, logits.argmax(dim=-1))


@needs_triton
def test_rejects_what_it_cannot_serve():
    x, w = torch.zeros(4, 8), torch.zeros(100, 8)
    with pytest.raises(ValueError, match="share K"):
        greedy_head_triton(x, torch.zeros(100, 6), torch.empty(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="out has"):
        greedy_head_triton(x, w, torch.empty(4, dtype=torch.float32))
    with pytest.raises(ValueError, match="at most 1024"):
        greedy_head_triton(x, torch.zeros(1025 * 16, 8), torch.empty(4, dtype=torch.int64),
                           tiles=(16, 16, 16, 4, 1))


def test_loads_take_the_persistent_kernel_where_it_was_measured_ahead():
    assert PERSISTENT_MIN_ROWS == 64
    assert greedy_head_loads(PERSISTENT_MIN_ROWS) == greedy_head_loads(256) == "tma_persistent"
    assert greedy_head_loads(PERSISTENT_MIN_ROWS - 1) == greedy_head_loads(2) == "pointer"


def test_serves_only_several_cuda_rows_of_the_head_dtype():
    assert not greedy_head_fits(torch.zeros(16, 8, dtype=torch.bfloat16))  # CPU: the logits path
    assert not greedy_head_fits(torch.zeros(16, 8, device="meta"))  # fp32 (and not CUDA)
    assert not greedy_head_serves(torch.zeros(4, 8), torch.zeros(16, 8))
    assert greedy_head_plan(256, 896, torch.device("cuda")) == (128, 256, 64, 8, 4)
    assert greedy_head_plan(64, 896, torch.device("cuda")) == (64, 256, 64, 8, 3)
    assert greedy_head_plan(8, 4096, torch.device("cuda"))[:3] == (64, 256, 64)
    # fp32 tiles at half the K step: 64 x 256 x 64 x 4 bytes x 3 stages (240 KiB) exceeds an H100's shared memory.
    assert greedy_head_plan(8, 4096, torch.device("cuda"), torch.float32)[:3] == (64, 256, 32)
    # A row's partials must fit the combine kernel: larger vocabularies keep logits + argmax.
    tiles = greedy_head_plan(256, 4096, torch.device("cuda"))
    assert vocab_fits(151_936, tiles) and vocab_fits(262_144, tiles) and not vocab_fits(262_145, tiles)


def test_head_greedy_on_cpu_is_argmax_of_its_logits():
    torch.manual_seed(0)
    head = LMHead(50, 12, dtype=torch.float32)
    head.weight.data.normal_()
    hidden = torch.randn(5, 12)
    out = torch.empty(5, dtype=torch.int32)
    head.greedy(hidden, out)
    assert torch.equal(out, head.logits(hidden).argmax(dim=-1).int())
    assert not head.fused_greedy  # decided when built: a CPU head never enters the fused kernel's checks


@needs_triton
def test_two_runners_in_one_process_take_their_own_greedy_path(monkeypatch):
    """KernelConfig.greedy_head is per runner: in one process, the runner built with it runs its plain-greedy
    steps through the fused kernel and the one built without it through logits + argmax, with the same
    tokens. The fused kernel serves CUDA half-precision heads only, so here the capability checks let the
    CPU fp32 head in (the kernel runs in the interpreter); the choice between the runners is the config's."""
    monkeypatch.setattr(embedding, "greedy_head_fits", lambda weight: True)
    monkeypatch.setattr(embedding, "greedy_head_serves", lambda hidden, weight: hidden.shape[0] >= 2)
    calls: list[int] = []
    real = embedding.greedy_head_triton
    monkeypatch.setattr(embedding, "greedy_head_triton", lambda h, w, out: calls.append(h.shape[0]) or real(h, w, out))
    runners = {on: make_runner(kernel=KernelConfig(greedy_head=on)) for on in (True, False)}
    tokens, fused_calls = {}, {}
    for on, runner in runners.items():
        driver = Driver(runner)
        for i in range(3):
            driver.add(f"r{i}", [5 + i, 17, 300 + 7 * i], SamplingParams(temperature=0.0))
        calls.clear()
        tokens[on] = [driver.step() for _ in range(3)]  # a prefill, then two decode steps
        fused_calls[on] = list(calls)
    assert fused_calls == {True: [3, 3, 3], False: []}
    assert tokens[True] == tokens[False]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 63, 64, 256])  # the pointer kernel below PERSISTENT_MIN_ROWS
def test_gpu_bf16_picks_a_maximal_logit_and_replays(rows):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from graphrunner.layers.embedding import lm_logits

    g = torch.Generator(device="cuda").manual_seed(rows)
    hidden = torch.randn(rows, 896, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = torch.randn(151936, 896, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    assert greedy_head_fits(weight) and greedy_head_serves(hidden, weight)
    assert descriptors_fit(hidden, weight, greedy_head_plan(rows, 896, hidden.device)[:3])  # no silent fallback
    out = torch.empty(rows, dtype=torch.int32, device="cuda")
    graph = capture_cuda_graph(lambda: greedy_head_triton(hidden, weight, out))
    for _ in range(2):
        hidden.copy_(torch.randn(rows, 896, device="cuda", dtype=torch.bfloat16, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        logits = lm_logits(hidden, weight)  # cuBLAS, fp32 out
        want = logits.argmax(dim=-1)
        picked = logits.gather(1, out.long()[:, None])[:, 0]
        # The same fp32 sums up to their order: the pick is the argmax, or ties it within that order.
        assert ((out.long() == want) | (logits.max(dim=-1).values - picked <= 1e-3)).all()
        assert (out.long() == want).float().mean() > 0.95


@pytest.mark.gpu
def test_gpu_fp32_takes_ieee_dots_and_fits_shared_memory():
    """fp32 heads are not routed here (greedy_tokens keeps exact logits), but the kernel still
    serves them: the halved K step compiles within shared memory and the dots are IEEE, not TF32."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(7)
    hidden = torch.randn(8, 512, device="cuda", generator=g)
    weight = torch.randn(5000, 512, device="cuda", generator=g)
    assert not greedy_head_fits(weight)
    out = torch.empty(8, dtype=torch.int64, device="cuda")
    greedy_head_triton(hidden, weight, out)
    logits = hidden.double() @ weight.double().t()
    picked = logits.gather(1, out[:, None])[:, 0]
    # TF32 products (10-bit mantissas) would miss by ~1e-1 here; IEEE fp32 sums by ~1e-4.
    assert (logits.max(dim=-1).values - picked <= 1e-3).all()


@pytest.mark.gpu
def test_gpu_heads_built_with_and_without_greedy_head_choose_their_path(monkeypatch):
    """Two bf16 heads on one device: the one built with KernelConfig.greedy_head runs the fused kernel,
    the other the logits + argmax; both pick a maximal logit."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    calls: list[int] = []
    real = embedding.greedy_head_triton
    monkeypatch.setattr(embedding, "greedy_head_triton", lambda h, w, out: calls.append(h.shape[0]) or real(h, w, out))
    g = torch.Generator(device="cuda").manual_seed(3)
    weight = torch.randn(151936, 896, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    hidden = torch.randn(8, 896, device="cuda", dtype=torch.bfloat16, generator=g)
    heads = {on: LMHead(151936, 896, dtype=torch.bfloat16, device="cuda",
                         kernel=KernelConfig(greedy_head=on)) for on in (True, False)}
    for on, head in heads.items():
        head.weight.data.copy_(weight)
        assert head.fused_greedy == on
        calls.clear()
        out = torch.empty(8, dtype=torch.int64, device="cuda")
        head.greedy(hidden, out)
        assert calls == ([8] if on else [])
        logits = head.logits(hidden)
        assert (logits.max(dim=-1).values - logits.gather(1, out[:, None])[:, 0] <= 1e-3).all()
