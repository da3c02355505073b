"""graphrunner.kernels.pdl: when programmatic dependent launch is on, and that a PDL consumer
sees its producer's writes, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from graphrunner.config import KernelConfig
from graphrunner.kernels import HAS_TRITON
from graphrunner.kernels import pdl as pdl_mod
from graphrunner.kernels.device import DeviceProperties, device_properties

CUDA = torch.cuda.is_available()
HOPPER = DeviceProperties((9, 0), 132, 85_045_870_592, 52_428_800, 3.35e12)
AMPERE = DeviceProperties((8, 0), 108, 85_045_870_592, 41_943_040, 2.04e12)


def test_max_rows_follow_kernel_config_and_the_device():
    """Off a GPU, below compute capability 9.0, or with KernelConfig.pdl off: no launch uses PDL;
    otherwise launches of up to KernelConfig.pdl_max_rows rows (the step's decode chain at batch 1)."""
    assert pdl_mod.pdl_max_rows(KernelConfig(), None) == 0
    assert pdl_mod.pdl_max_rows(KernelConfig(), AMPERE) == 0
    assert pdl_mod.pdl_max_rows(KernelConfig(pdl=False), HOPPER) == 0
    if HAS_TRITON:
        assert pdl_mod.pdl_max_rows(KernelConfig(), HOPPER) == 1
        assert pdl_mod.pdl_max_rows(KernelConfig(pdl_max_rows=8), HOPPER) == 8


def test_launch_only_up_to_max_rows():
    """PDL applies to launches of at most max_rows rows; larger ones keep the full dependency
    (measured slower with it: KernelConfig's docstring)."""
    assert [bool(pdl_mod.pdl_launch(rows, 4)) for rows in (1, 4, 5, 256)] == [True, True, False, False]
    assert pdl_mod.pdl_launch(1, 0) == {} and pdl_mod.pdl_launch(0, 4) == {}
    assert pdl_mod.pdl_launch(1, 1) == {"launch_pdl": True}


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _produce(value_ptr, out_ptr, n, ROUNDS: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
        # A slow producer: ROUNDS read-modify-write passes, so a consumer that did not wait
        # would see a partial result.
        pdl_mod.pdl_wait(GDC)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        value = tl.load(value_ptr)
        tl.store(out_ptr + offs, tl.zeros([BLOCK], tl.float32), mask=ok)
        for _ in range(ROUNDS):
            tl.store(out_ptr + offs, tl.load(out_ptr + offs, mask=ok) + value, mask=ok)

    @triton.jit
    def _consume(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, GDC: tl.constexpr):
        pdl_mod.pdl_wait(GDC)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=ok) * 2.0, mask=ok)


def _chain(value, mid, out, gdc: bool, launch: dict):
    n, block = mid.numel(), 1024
    grid = (triton.cdiv(n, block),)
    _produce[grid](value, mid, n, ROUNDS=8, BLOCK=block, GDC=gdc, **launch)
    _consume[grid](mid, out, n, BLOCK=block, GDC=gdc, **launch)


@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
def test_consumer_sees_producer_in_graph_replays():
    dev = torch.device("cuda")
    if not pdl_mod.pdl_max_rows(KernelConfig(), device_properties(dev)):
        pytest.skip("PDL needs compute capability >= 9.0")
    gdc, launch = True, pdl_mod.pdl_launch(1, 1)
    assert launch == {"launch_pdl": True}
    value = torch.ones(1, device=dev)
    mid = torch.empty(1 << 22, device=dev)
    out = torch.empty_like(mid)
    _chain(value, mid, out, gdc, launch)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, 16.0))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _chain(value, mid, out, gdc, launch)
    for step in range(2, 12):
        value.fill_(float(step))
        out.fill_(-1.0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.full_like(out, 16.0 * step)), step


@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("mode", ["FULL", "PIECEWISE"])
def test_step_with_pdl_gives_the_same_tokens(mode):
    """The whole decode step (GEMV, add + norm, rope / KV write, attention and its split merge
    launched with PDL) against the same runner without it (KernelConfig.pdl): identical greedy and
    seeded tokens, batch 1 and mixed batches, eager warm-up and graph replays."""
    from graphrunner.config import CompilationConfig
    from graphrunner.protocol import SamplingParams
    from tests.runner_driver import Driver, make_runner

    if not pdl_mod.pdl_max_rows(KernelConfig(), device_properties("cuda")):
        pytest.skip("PDL needs compute capability >= 9.0")
    prompts = [[(11 * i + j) % 2000 for j in range(2 + 13 * i)] for i in range(5)]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, seed=3)] * 2
    params.append(SamplingParams(temperature=0.0))
    tokens = {}
    for on in (False, True):
        for batch in ("mixed", "single"):
            runner = make_runner(device="cuda", dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=256,
                                 max_model_len=160, block_size=16,
                                 num_blocks=64, compilation=CompilationConfig(cudagraph_mode=mode),
                                 kernel=KernelConfig(pdl=on))
            runner.capture_model()
            driver = Driver(runner)
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                if batch == "mixed" or i == 3:
                    driver.add(str(i), prompt, p, max_len=160)
            for _ in range(24):
                driver.step()
            tokens[on, batch] = {rid: r.outputs for rid, r in driver.reqs.items()}
            del runner, driver
    assert tokens[True, "mixed"] == tokens[False, "mixed"]
    assert tokens[True, "single"] == tokens[False, "single"]
