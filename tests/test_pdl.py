"""graphrunner.kernels.pdl: when programmatic dependent launch is on, and that a PDL consumer
sees its producer's writes, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from graphrunner.kernels import HAS_TRITON
from graphrunner.kernels import pdl as pdl_mod

CUDA = torch.cuda.is_available()


def test_off_on_cpu_and_when_disabled(monkeypatch):
    monkeypatch.setattr(pdl_mod, "PDL", True)
    assert pdl_mod.pdl_launch(torch.device("cpu"), 1) == {}
    assert not pdl_mod.pdl_enabled(torch.device("cpu"))
    monkeypatch.setattr(pdl_mod, "PDL", False)
    assert not pdl_mod.pdl_enabled(torch.device("cuda", 0))
    assert pdl_mod.pdl_launch(torch.device("cuda", 0), 1) == {}


def test_launch_only_up_to_max_rows(monkeypatch):
    """PDL applies to launches of at most PDL_MAX_ROWS rows; larger ones keep the full
    dependency (measured slower with it: the module's comment)."""
    monkeypatch.setattr(pdl_mod, "pdl_enabled", lambda device: True)
    monkeypatch.setattr(pdl_mod, "PDL_MAX_ROWS", 4)
    dev = torch.device("cuda", 0)
    assert [bool(pdl_mod.pdl_launch(dev, rows)) for rows in (1, 4, 5, 256)] == [True, True, False, False]


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
def test_consumer_sees_producer_in_graph_replays(monkeypatch):
    dev = torch.device("cuda")
    monkeypatch.setattr(pdl_mod, "PDL", True)  # on whatever GRAPHRUNNER_PDL says
    if not pdl_mod.pdl_enabled(dev):
        pytest.skip("PDL needs compute capability >= 9.0")
    gdc, launch = True, pdl_mod.pdl_launch(dev, 1)
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
def test_step_with_pdl_gives_the_same_tokens(monkeypatch, mode):
    """The whole decode step (GEMV, add + norm, rope / KV write, attention and its split merge
    launched with PDL) against the same runner without it: identical greedy and seeded tokens,
    batch 1 and mixed batches, eager warm-up and graph replays."""
    from graphrunner import LLM, SamplingParams

    if not pdl_mod._device_has_pdl(torch.cuda.current_device()):
        pytest.skip("PDL needs compute capability >= 9.0")
    prompts = [[(11 * i + j) % 2000 for j in range(2 + 13 * i)] for i in range(5)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)] * 2
    params.append(SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    kw = dict(device="cuda", dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=160,
              block_size=16, num_kv_blocks=64, enforce_eager=False, cudagraph_mode=mode)
    tokens = {}
    for on in (False, True):
        monkeypatch.setattr(pdl_mod, "PDL", on)
        llm = LLM("builtin:tiny-llama", **kw)
        tokens[on] = [o.token_ids for o in llm.generate(prompts, params)]
        tokens[on, "single"] = llm.generate([prompts[3]], params[0])[0].token_ids
        del llm
    assert tokens[True] == tokens[False]
    assert tokens[True, "single"] == tokens[False, "single"]
