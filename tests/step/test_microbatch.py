"""Dual batch overlap (graphrunner/step/microbatch.py): the cut, the metadata split, and DP2 lockstep worlds.

* `cut_point` / `wants_microbatch`: the pure rules (hypothesis).
* `split_batch`: two microbatches through the torch reference backend write the same KV and give
  the same attention output as the whole batch, and both equal a dense causal SDPA reference.
* gloo worlds (tiny-llama): DP2 lockstep with DBO gives each replica's greedy and seeded tokens of
  the run without DBO and of one process; the steps really split (counter, cut inside the batch);
  all-or-nothing through real ranks (rank 1's thresholds are higher: steps only rank 0 wants run whole).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.attention.torch_ref import TorchReferenceBackend
from graphrunner.config import ParallelConfig
from graphrunner.state.features import SamplingFeatures
from graphrunner.step.inputs import InputBatch, InputBuffers
from graphrunner.step.microbatch import cut_point, split_batch, wants_microbatch
from tests.dist_utils import run_world


# ---- pure rules ---------------------------------------------------------------------------------
@given(st.lists(st.integers(0, 9), min_size=1, max_size=12), st.integers(-3, 100))
def test_cut_point_is_the_nearest_interior_request_boundary(query_lens, split):
    lens = np.array(query_lens, dtype=np.int64)
    total = int(lens.sum())
    bounds = [int(b) for b in np.cumsum(lens)[:-1] if 0 < b < total]
    cut = cut_point(lens, split)
    if not bounds:
        assert cut is None
        return
    assert cut is not None
    r, c = cut
    assert c == int(lens[:r].sum()) and 0 < c < total  # on a request boundary, both halves hold tokens
    assert abs(c - split) == min(abs(b - split) for b in bounds)
    assert c == min(b for b in bounds if abs(b - split) == abs(c - split))  # ties go to the lower one


def test_wants_microbatch_thresholds():
    assert wants_microbatch(4, 4, 1, 1, 4, 100)  # uniform decode: the decode threshold
    assert not wants_microbatch(3, 3, 1, 1, 4, 100)
    assert not wants_microbatch(2, 40, None, 1, 4, 100)  # mixed: the prefill threshold
    assert wants_microbatch(2, 100, None, 1, 4, 100)
    assert not wants_microbatch(1, 1000, None, 1, 4, 100)  # one request: nothing to cut
    assert not wants_microbatch(4, 8, 2, 1, 4, 100)  # uniform but not decode-length: prefill threshold


def test_parallel_config_refuses_dbo_without_lockstep_dp():
    with pytest.raises(ValueError, match="enable_dbo=True needs data_parallel_lockstep=True and data_parallel_size "
                                         "> 1, got data_parallel_lockstep=False, data_parallel_size=2"):
        ParallelConfig(data_parallel_size=2, enable_dbo=True)
    with pytest.raises(ValueError, match="data_parallel_size=1"):
        ParallelConfig(data_parallel_lockstep=True, enable_dbo=True)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        ParallelConfig(data_parallel_size=2, pipeline_parallel_size=2, data_parallel_lockstep=True, enable_dbo=True)
    with pytest.raises(ValueError, match="dbo_decode_token_threshold=0 must be an int >= 1"):
        ParallelConfig(dbo_decode_token_threshold=0)
    with pytest.raises(ValueError, match="enable_dbo=1 must be a bool"):
        ParallelConfig(enable_dbo=1)
    ok = ParallelConfig(data_parallel_size=2, data_parallel_lockstep=True, enable_dbo=True)
    assert (ok.dbo_decode_token_threshold, ok.dbo_prefill_token_threshold) == (32, 512)


def test_llm_options_take_dbo_keywords():
    from graphrunner.engine.options import check_compilation_kwargs, parallel_config

    kwargs = {"enable_dbo": True, "dbo_prefill_token_threshold": 8, "cudagraph_mode": "NONE",
              "pp_token_placeholders": False}
    check_compilation_kwargs(kwargs)
    parallel = parallel_config(1, 1, 2, 60.0, False, kwargs, data_parallel_lockstep=True)
    assert kwargs == {"cudagraph_mode": "NONE"}  # the ParallelConfig fields were taken out
    assert parallel.enable_dbo and parallel.dbo_prefill_token_threshold == 8 and not parallel.pp_token_placeholders
    with pytest.raises(TypeError, match="enable_dbx"):
        check_compilation_kwargs({"enable_dbx": True})


def test_cli_dbo_flags_become_llm_keywords():
    import argparse

    from graphrunner.cli_args import add_dbo_args, dbo_cli_kwargs

    p = argparse.ArgumentParser()
    add_dbo_args(p)
    assert dbo_cli_kwargs(p.parse_args(["--enable-dbo", "--dbo-decode-token-threshold", "8"])) == {
        "enable_dbo": True, "dbo_decode_token_threshold": 8, "dbo_prefill_token_threshold": 512}
    assert dbo_cli_kwargs(p.parse_args([]))["enable_dbo"] is False
    assert dbo_cli_kwargs(argparse.Namespace()) == {}


# ---- the metadata split ---------------------------------------------------------------------------
BLOCK, HKV, GROUP, D = 4, 2, 2, 8


@st.composite
def batches(draw):
    """(query_lens, context_lens, extra padded requests, extra padded tokens, token split)."""
    n = draw(st.integers(2, 6))
    q = draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    ctx = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    split = draw(st.integers(1, sum(q) - 1))
    return q, ctx, draw(st.integers(0, 2)), draw(st.integers(0, 3)), split


def _make_batch(q, ctx, pad_reqs, pad_tokens):
    """A padded InputBatch over fresh buffers with its device-side fields written as prepare_inputs would."""
    R, T = len(q), sum(q)
    Rp, Tp = R + pad_reqs, T + pad_tokens
    max_blocks = -(-(max(c + n for c, n in zip(ctx, q, strict=True))) // BLOCK)
    buf = InputBuffers(Rp, Tp, max_blocks, torch.device("cpu"))
    lens = np.array(q, dtype=np.int32)
    buf.upload(np.arange(R, dtype=np.int32), lens, Rp, pad_row=R)
    batch = InputBatch.from_buffers(buf, [f"r{i}" for i in range(R)], np.arange(R, dtype=np.int32), lens, Rp, Tp,
                                    SamplingFeatures(), max_seq_len=max_blocks * BLOCK)
    perm = torch.randperm(Rp * max_blocks, dtype=torch.int32).view(Rp, max_blocks)  # disjoint blocks per request
    batch.block_table.copy_(perm)
    seq = [c + n for c, n in zip(ctx, q, strict=True)] + [0] * pad_reqs
    batch.seq_lens.copy_(torch.tensor(seq, dtype=torch.int32))
    pos = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx, q, strict=True)] + [torch.zeros(pad_tokens)]).long()
    batch.positions.copy_(pos)
    slots = torch.full((Tp,), -1, dtype=torch.int64)
    starts = np.cumsum([0, *q])
    for b in range(R):
        for t in range(starts[b], starts[b + 1]):
            p = int(pos[t])
            slots[t] = int(perm[b, p // BLOCK]) * BLOCK + p % BLOCK
    batch.slot_mapping.copy_(slots)
    return batch, Rp * max_blocks


def _dense_reference(qh, k_all, v_all, batch, ctx):
    """Per request: SDPA of its query tokens over its whole key sequence (context + new), causal."""
    out = torch.zeros_like(qh)
    qsl = batch.query_start_loc.tolist()
    for b in range(batch.num_reqs):
        q0, q1 = qsl[b], qsl[b + 1]
        keys, vals = k_all[b], v_all[b]  # [ctx + n, Hkv, D]
        n_keys = keys.shape[0]
        pos = torch.arange(ctx[b], ctx[b] + (q1 - q0)).view(-1, 1)
        mask = torch.arange(n_keys).view(1, -1) <= pos  # [n, n_keys]
        qq = qh[q0:q1].transpose(0, 1)  # [H, n, D]
        kk = keys.repeat_interleave(GROUP, dim=1).transpose(0, 1)
        vv = vals.repeat_interleave(GROUP, dim=1).transpose(0, 1)
        out[q0:q1] = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask).transpose(0, 1)
    return out


@settings(deadline=None)
@given(batches(), st.integers(0, 2**31 - 1))
def test_split_attention_equals_whole_batch(case, seed):
    q, ctx, pad_reqs, pad_tokens, split = case
    torch.manual_seed(seed)
    batch, num_blocks = _make_batch(q, ctx, pad_reqs, pad_tokens)
    Tp, H = batch.num_tokens_padded, HKV * GROUP
    cache = torch.randn(2, num_blocks, BLOCK, HKV, D)
    # The context keys live in the cache already; the new tokens' keys are this step's k/v.
    qh, k, v = torch.randn(Tp, H, D), torch.randn(Tp, HKV, D), torch.randn(Tp, HKV, D)
    backend, scale = TorchReferenceBackend(), D**-0.5

    whole_cache = cache.clone()
    whole = backend.forward(qh, k, v, whole_cache, batch.attn_metadata, scale)

    cut = cut_point(batch.query_lens_np, split)
    assert cut is not None
    r, c = cut
    first, second = split_batch(batch, r, c, torch.zeros(batch.num_reqs_padded + 1, dtype=torch.int32))
    assert (first.num_tokens_padded, second.num_tokens_padded) == (c, Tp - c)
    assert second.query_start_loc.tolist() == (batch.query_start_loc[r:] - c).tolist()
    split_cache = cache.clone()
    out0 = backend.forward(qh[:c], k[:c], v[:c], split_cache, first.attn_metadata, scale)
    out1 = backend.forward(qh[c:], k[c:], v[c:], split_cache, second.attn_metadata, scale)
    T = batch.num_tokens
    assert torch.equal(split_cache, whole_cache)  # the same KV written, nothing else touched
    torch.testing.assert_close(torch.cat([out0, out1])[:T], whole[:T])

    # Independent reference: each request's full key sequence gathered from the written cache.
    bt = batch.block_table
    k_all, v_all = [], []
    for b in range(batch.num_reqs):
        n_keys = ctx[b] + q[b]
        blocks = bt[b, : -(-n_keys // BLOCK)].long()
        k_all.append(whole_cache[0, blocks].flatten(0, 1)[:n_keys])
        v_all.append(whole_cache[1, blocks].flatten(0, 1)[:n_keys])
    ref = _dense_reference(qh, k_all, v_all, batch, ctx)
    torch.testing.assert_close(torch.cat([out0, out1])[:T], ref[:T], rtol=1e-4, atol=1e-5)


# ---- DP2 lockstep worlds ----------------------------------------------------------------------------
# Six requests per replica: decode steps of 5-6 requests pad to FULL(8) and split (min real 5 > 8 // 2).
PROMPTS = [[1 + i, 5, 9, 13 + i, 100 + i] for i in range(8)] + [[7] * 12, [3, 4], [8, 9, 10], [2, 6]]
MAX_TOKENS = [6, 5, 8, 4, 6, 4, 5, 7, 7, 3, 5, 6]
LLM_ARGS = dict(device="cpu", num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=96,
                seed=3, collective_timeout_s=30.0)
# Rank 1 wants to split only larger steps than rank 0: the steps only rank 0 wants must run whole.
DBO = [dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2),
       dict(enable_dbo=True, dbo_decode_token_threshold=4, dbo_prefill_token_threshold=12)]


def _params():
    from graphrunner.protocol import SamplingParams

    return [SamplingParams(max_tokens=n, ignore_eos=True, **({"temperature": 0.0} if i % 2 == 0 else
                                                              {"temperature": 0.9, "top_k": 20, "seed": 100 + i}))
            for i, n in enumerate(MAX_TOKENS)]


# Graph modes (emulated on CPU): a uniform-decode step agreed to split replays its descriptor's
# microbatched FULL graph; any other step agreed to split leaves its descriptor for eager.
GRAPH_ARGS = dict(enforce_eager=False, compile_backend="eager", cudagraph_mode="FULL_DECODE_ONLY",
                  cudagraph_capture_sizes=[4, 8])


def _generate(rank: int, world: int, dp: int, dbo: bool) -> dict:
    from graphrunner.engine.llm import LLM

    extra = {**DBO[rank], **GRAPH_ARGS} if dbo else {}
    llm = LLM("builtin:tiny-llama", data_parallel_size=dp, data_parallel_lockstep=dp > 1, **LLM_ARGS, **extra)
    hooks = llm.runner.dp  # lockstep DP (None for one replica)
    # Per coordinated step: [wanted, agreed to split, counter before, [tokens of each model forward call]]
    steps: list[list] = []
    if dp > 1:
        orig_coordinate, orig_wants, orig_forward = hooks._coordinate, hooks._wants_microbatch, llm.runner.body.forward

        def wants(*args):
            steps.append([orig_wants(*args), None, hooks.num_microbatched_steps, []])
            return steps[-1][0]

        def forward(batch, *args):
            steps[-1][3].append((batch.num_tokens, batch.num_tokens_padded))
            return orig_forward(batch, *args)

        llm.runner.body.forward = forward

        def coordinate(*args, **kwargs):
            plan = orig_coordinate(*args, **kwargs)
            steps[-1][1] = plan.microbatch
            steps[-1].append(plan.descriptor is not None and not plan.descriptor.is_eager)  # a graph agreed
            return plan

        hooks._wants_microbatch, hooks._coordinate = wants, coordinate
    outs = llm.generate(PROMPTS, _params())
    ubatched = hooks.num_microbatched_steps if hooks is not None else 0
    info = {"tokens": [o.token_ids for o in outs], "ubatched": ubatched, "steps": steps,
            "ubatched_graphs": hooks.num_microbatched_graph_steps if hooks is not None else 0,
            "mode": llm.runner.graphs.mode.name}
    llm.shutdown()
    return info


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    (info,) = run_world(1, _generate, 1, False, timeout_s=60)
    return info["tokens"]


def test_dp2_lockstep_dbo_matches_without_and_one_process(reference):
    plain = run_world(2, _generate, 2, False, timeout_s=90)
    dbo = run_world(2, _generate, 2, True, timeout_s=90)
    for rank in range(2):
        assert plain[rank]["tokens"] == reference, f"rank {rank} without DBO"
        assert dbo[rank]["tokens"] == reference, f"rank {rank} with DBO"
        assert plain[rank]["ubatched"] == 0
    assert dbo[0]["mode"] == "FULL_DECODE_ONLY"
    # Every rank split the same steps, and some.
    assert dbo[0]["ubatched"] == dbo[1]["ubatched"] > 0
    # both kinds: microbatched FULL graphs (uniform decode) and eager splits (the rest)
    assert 0 < dbo[0]["ubatched_graphs"] < dbo[0]["ubatched"], dbo[0]
    steps0, steps1 = dbo[0]["steps"], dbo[1]["steps"]
    assert len(steps0) == len(steps1)
    counters = [s[2] for s in steps0] + [dbo[0]["ubatched"]]
    only_one = 0
    for i, (a, b) in enumerate(zip(steps0, steps1, strict=True)):
        assert a[1] == b[1], f"step {i}: ranks disagree on splitting"
        split = counters[i + 1] - counters[i]
        assert split == int(a[1]), f"step {i}: agreed {a[1]} but ran {split} microbatched steps"
        for rank_step in (a, b):  # the model really ran twice, on two non-empty halves
            calls = rank_step[3]
            if a[1]:
                assert len(calls) == 2 and min(t for t, _ in calls) > 0, (i, calls)
            else:
                assert len(calls) <= 1, (i, calls)
        if a[1]:
            assert a[0] and b[0]  # all-or-nothing: only when every rank wants it
        only_one += a[0] != b[0]
    assert only_one > 0, "no step where exactly one rank wanted to split: the all-or-nothing rule went untested"
    assert any(s[1] and s[4] for s in steps0), "no split step left a FULL graph: the eager downgrade went untested"
