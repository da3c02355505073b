"""graphrunner.kernels.pdl: when programmatic dependent launch is on, and that a PDL consumer
sees its producer's writes, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from graphrunner.kernels import HAS_TRITON
from graphrunner.kernels import pdl as pdl_mod

CUDA = torch.cuda.is_available()


def test_off_on_cpu_and_when_disabled(monkeypatch):
    assert pdl_mod.pdl_launch(torch.device("cpu")) == {}
    assert not pdl_mod.pdl_enabled(torch.device("cpu"))
    monkeypatch.setattr(pdl_mod, "PDL", False)
    assert not pdl_mod.pdl_enabled(torch.device("cuda", 0))
    assert pdl_mod.pdl_launch(torch.device("cuda", 0)) == {}


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
    gdc, launch = pdl_mod.pdl_enabled(dev), pdl_mod.pdl_launch(dev)
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
