"""TP / PP / DP end to end on CPU (gloo): greedy tokens equal one process; groups; launcher; timeouts.

Every multi-process test runs `LLM(...)` in SPMD on a gloo world of 2 (or 4) forked
CPU processes (tests/dist_utils.py) with builtin:tiny-llama dummy weights (the sharded
loader gives each rank its shard of the single-process weights) and compares the
greedy tokens with a single-process run of the same prompts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.config import ParallelConfig
from graphrunner.distributed.groups import ParallelGroups, coordinates, group_ranks, init_distributed
from graphrunner.distributed.launch import launch
from graphrunner.models.stages import pp_layer_range
from tests.dist_utils import WorldError, run_world, start_world

PROMPTS = [[1 + i, 5, 9, 13 + i, 100 + i] for i in range(4)] + [[7] * 20, [3, 4]]
MAX_TOKENS = [6, 3, 8, 2, 6, 4]  # skewed: one DP replica runs out of work first
LLM_ARGS = dict(
    device="cpu", num_kv_blocks=48, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=96, seed=3,
    collective_timeout_s=30.0,
)
GRAPH_ARGS = dict(enforce_eager=False, compile_backend="eager", cudagraph_capture_sizes=[1, 2, 4, 8])


def _dummy_steps(llm) -> int:
    """Idle-replica dummy steps the runner ran (lockstep DP; 0 without it)."""
    return llm.runner.dp.num_dummy_steps if llm.runner.dp is not None else 0


def _generate(rank: int, world: int, tp: int, pp: int, dp: int, extra: dict) -> dict:
    from graphrunner.engine.llm import LLM
    from graphrunner.protocol import SamplingParams

    llm = LLM("builtin:tiny-llama", tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
              **LLM_ARGS, **extra)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params)
    info = {
        "tokens": [o.token_ids for o in outs],
        "dummy_steps": _dummy_steps(llm),
        "mode": llm.runner.graphs.mode.name,
        "async": llm.async_scheduling,
    }
    llm.shutdown()
    return info


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    (info,) = run_world(1, _generate, 1, 1, 1, {}, timeout_s=60)
    return info["tokens"]


# ---------------------------------------------------------------------------- pure layout


@given(tp=st.integers(1, 4), pp=st.integers(1, 3), dp=st.integers(1, 3))
@settings(deadline=None)
def test_group_layout_partitions_the_world(tp: int, pp: int, dp: int) -> None:
    world = tp * pp * dp
    layout = group_ranks(tp, pp, dp)
    for kind, size in (("tp", tp), ("pp", pp), ("dp", dp)):
        groups = layout[kind]
        assert sorted(r for g in groups for r in g) == list(range(world)), kind
        assert all(len(g) == size for g in groups)
    for g in layout["tp"]:  # TP innermost: contiguous ranks
        assert g == list(range(g[0], g[0] + tp))
    for rank in range(world):
        d, p, t = coordinates(rank, tp, pp)
        assert rank == (d * pp + p) * tp + t
        assert layout["pp"][d * tp + t][p] == rank and layout["dp"][p * tp + t][d] == rank


@given(layers=st.integers(1, 40), pp=st.integers(1, 8))
def test_pp_layer_range_covers_layers(layers: int, pp: int) -> None:
    if layers < pp:
        with pytest.raises(ValueError, match="empty"):
            pp_layer_range(layers, pp, 0)
        return
    ranges = [pp_layer_range(layers, pp, r) for r in range(pp)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a[1] == b[0] for a, b in pairwise(ranges))
    sizes = [e - s for s, e in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


@given(vocab=st.integers(1, 50), tp=st.integers(1, 4))
def test_vocab_parallel_shards_pad_and_cover(vocab: int, tp: int) -> None:
    import torch

    from graphrunner.distributed.comm import TPComm
    from graphrunner.layers.embedding import LMHead

    full = torch.randn(vocab, 3)
    shards = []
    for r in range(tp):
        head = LMHead(vocab, 3, dtype=torch.float32, tp=TPComm(tp, r, "unused" if tp > 1 else ""))
        head.load_shard("weight", full)
        shards.append(head.weight)
    cat = torch.cat(shards)
    assert cat.shape[0] == -(-vocab // tp) * tp
    assert torch.equal(cat[:vocab], full) and bool((cat[vocab:] == 0).all())


def test_single_process_needs_no_process_group(monkeypatch) -> None:
    import torch.distributed as dist

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    groups = init_distributed(ParallelConfig(), "cpu")
    assert not groups.is_distributed and groups.tp.device_group is None and groups.pp_broadcast_group is None
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="WORLD_SIZE=1 but tp\\*pcp\\*pp\\*dp"):
        init_distributed(ParallelConfig(tensor_parallel_size=2), "cpu")
    groups.destroy()
    assert isinstance(ParallelGroups.single(), ParallelGroups)


# ---------------------------------------------------------------------------- end to end


@pytest.mark.parametrize(
    "tp,pp,dp,lockstep,sync",
    [(2, 1, 1, False, False), (1, 2, 1, False, False), (1, 1, 2, False, False), (1, 1, 2, True, False),
     (1, 1, 2, True, True)],
    ids=["tp2", "pp2", "dp2", "dp2-lockstep", "dp2-lockstep-sync"],
)
def test_two_ranks_match_one_process_eager(reference, tp: int, pp: int, dp: int, lockstep: bool, sync: bool) -> None:
    """Each layout in its default loop (async scheduling, lockstep DP included), and lockstep DP in the sync one."""
    extra = {"data_parallel_lockstep": lockstep, **({"async_scheduling": False} if sync else {})}
    infos = run_world(2, _generate, tp, pp, dp, extra, timeout_s=90)
    for rank, info in enumerate(infos):
        assert info["tokens"] == reference, f"rank {rank} (tp={tp} pp={pp} dp={dp})"
        assert info["async"] == (not sync), info
    # Lockstep: the replica that finished first kept stepping with dummy steps; independent: never.
    assert (sum(i["dummy_steps"] for i in infos) > 0) == (dp == 2 and lockstep)


@pytest.mark.parametrize("tp,dp", [(2, 1), (1, 2)], ids=["tp2", "dp2"])
def test_async_scheduling_with_tp_and_independent_dp_matches_one_process(reference, tp: int, dp: int) -> None:
    infos = run_world(2, _generate, tp, 1, dp, {"async_scheduling": True}, timeout_s=90)
    for rank, info in enumerate(infos):
        assert info["tokens"] == reference, f"rank {rank} (tp={tp} dp={dp}, async)"


def test_async_scheduling_refuses_what_it_does_not_run() -> None:
    from graphrunner.engine.options import parallel_config

    with pytest.raises(ValueError, match="prefill_context_parallel_size=2"):
        parallel_config(1, 1, 1, 60.0, True, prefill_context_parallel_size=2)
    assert parallel_config(1, 1, 2, 60.0, True, data_parallel_lockstep=True).data_parallel_lockstep
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 .pipelined through the async loop. does not run "
                                         "with data_parallel_lockstep=True"):
        parallel_config(1, 2, 2, 60.0, False, data_parallel_lockstep=True)
    assert parallel_config(2, 1, 2, 60.0, True, decode_context_parallel_size=2).world_size == 4


@pytest.mark.parametrize("tp,pp,dp", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["tp2", "pp2", "dp2"])
def test_two_ranks_match_one_process_graphs(reference, tp: int, pp: int, dp: int) -> None:
    """FULL_AND_PIECEWISE (CPU-emulated FULL graphs, compiled pieces): collectives inside
    the compiled pieces and the FULL step bodies; PP buffers read by both; DP re-dispatch."""
    infos = run_world(2, _generate, tp, pp, dp, GRAPH_ARGS, timeout_s=120)
    for rank, info in enumerate(infos):
        assert info["mode"] == "FULL_AND_PIECEWISE"
        assert info["tokens"] == reference, f"rank {rank} (tp={tp} pp={pp} dp={dp})"


def test_tp2_pp2_four_ranks_match_one_process(reference) -> None:
    infos = run_world(4, _generate, 2, 2, 1, {}, timeout_s=120)
    for rank, info in enumerate(infos):
        assert info["tokens"] == reference, f"rank {rank}"


# ---------------------------------------------------------------------------- failures


def _dead_or_stalled_peer(rank: int, world: int, how: str) -> dict:
    import torch
    import torch.distributed as dist

    groups = init_distributed(ParallelConfig(tensor_parallel_size=2, collective_timeout_s=4.0), "cpu")
    groups.barrier()
    if rank == 1:
        if how == "kill":
            os._exit(7)
        time.sleep(60)  # stalled: never joins the collective
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=groups.tp.cpu_group)
    except RuntimeError as e:
        return {"raised": True, "seconds": time.monotonic() - start, "msg": str(e)[:300]}
    return {"raised": False, "seconds": time.monotonic() - start, "msg": ""}


LAYOUTS = {"tp2": (2, 1, 1), "pp2": (1, 2, 1), "dp2": (1, 1, 2)}


@pytest.fixture(scope="module")
def stalled_worlds() -> dict[str, list | WorldError]:
    """Every stall case's world, run side by side: each mostly waits out its collective timeout
    (4 or 5 s), which their tests used to do one after another. name -> results or the error."""
    hang = frozenset({1})
    worlds = {"peer": start_world(2, _dead_or_stalled_peer, "stall", timeout_s=40, allow_hang=hang)}
    for name, layout in LAYOUTS.items():
        worlds[name] = start_world(2, _engine_with_dead_peer, *layout, "stall", timeout_s=90, allow_hang=hang)
    results: dict[str, list | WorldError] = {}
    for name, world in worlds.items():
        try:
            results[name] = world.wait()
        except WorldError as e:
            results[name] = e
    return results


def _dead_or_stalled(request, name: str, how: str, run) -> list:
    """A stall case's results from the shared fixture (its error re-raised); a kill case's own run."""
    if how != "stall":
        return run()
    result = request.getfixturevalue("stalled_worlds")[name]
    if isinstance(result, WorldError):
        raise result
    return result


@pytest.mark.parametrize("how", ["kill", "stall"])
def test_dead_or_stalled_rank_raises_within_timeout(request, how: str) -> None:
    info, _ = _dead_or_stalled(request, "peer", how, lambda: run_world(2, _dead_or_stalled_peer, how, timeout_s=40,
                                                                        allow_hang=frozenset({1})))
    assert info["raised"], info
    assert info["seconds"] < 4.0 + 10.0, info


def _engine_with_dead_peer(rank: int, world: int, tp: int, pp: int, dp: int, how: str,
                           model: str = "builtin:tiny-llama", expert_parallel: bool = False) -> dict:
    """Both ranks serve one generate; then rank 1 dies or stalls, and rank 0 generates again."""
    from graphrunner.engine.llm import LLM
    from graphrunner.protocol import SamplingParams

    llm = LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
              enable_expert_parallel=expert_parallel, **{**LLM_ARGS, "collective_timeout_s": 5.0})
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate(PROMPTS[:2], params)
    # Both ranks finished the first generate (the last PP stage's final token broadcast is
    # asynchronous: without this, rank 1 could die before rank 0 received it).
    llm.groups.barrier()
    if rank == 1:
        if how == "kill":
            os._exit(7)
        time.sleep(120)  # stalled: never joins the next step's collectives
    start = time.monotonic()
    try:
        llm.generate(PROMPTS[:2], params)
    except Exception as e:  # the error type depends on the collective that noticed
        return {"raised": True, "seconds": time.monotonic() - start, "msg": f"{type(e).__name__}: {str(e)[:200]}"}
    return {"raised": False, "seconds": time.monotonic() - start, "msg": ""}


@pytest.mark.parametrize("how", ["kill", "stall"])
@pytest.mark.parametrize("tp, pp, dp", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["tp2", "pp2", "dp2"])
def test_engine_rank_dead_or_stalled_fails_within_timeout(request, tp: int, pp: int, dp: int, how: str) -> None:
    """In every parallel mode a lost peer ends the survivor's step with an error within the
    collective timeout (5 s here) plus slack, instead of a hang."""
    name = {v: k for k, v in LAYOUTS.items()}[(tp, pp, dp)]
    info, _ = _dead_or_stalled(request, name, how, lambda: run_world(2, _engine_with_dead_peer, tp, pp, dp, how,
                                                                      timeout_s=90, allow_hang=frozenset({1})))
    assert info["raised"], info
    assert info["seconds"] < 5.0 + 15.0, info
    # The error names the exchange, this rank's place and the timeout (not only the transport's words).
    assert info["msg"].startswith("CollectiveError: "), info
    assert f"tp 0/{tp}, pp 0/{pp}, dp 0/{dp}; collective_timeout_s=5.0" in info["msg"], info


def test_dp2_expert_parallel_rank_death_fails_within_timeout() -> None:
    """DP2 + EP: the replicas step in lockstep and every MoE layer exchanges tokens across them, so a
    replica that dies leaves the survivor inside a collective; it raises within the timeout instead."""
    info, _ = run_world(2, _engine_with_dead_peer, 1, 1, 2, "kill", "builtin:tiny-moe", True, timeout_s=90,
                        allow_hang=frozenset({1}))
    assert info["raised"], info
    assert info["seconds"] < 5.0 + 15.0, info
    assert info["msg"].startswith("CollectiveError: "), info
    assert "tp 0/1, pp 0/1, dp 0/2; collective_timeout_s=5.0" in info["msg"], info


# ---------------------------------------------------------------------------- launcher


def test_launch_sets_env_and_propagates_failure(tmp_path) -> None:
    script = tmp_path / "child.py"
    script.write_text(
        "import os, sys, time\n"
        "r = int(os.environ['RANK'])\n"
        "print('rank', r, 'of', os.environ['WORLD_SIZE'], os.environ['MASTER_PORT'], flush=True)\n"
        "if len(sys.argv) > 1 and r == 1:\n"
        "    sys.exit(3)\n"
        "time.sleep(0.1 if len(sys.argv) == 1 else 60)\n"
    )
    log = tmp_path / "out.txt"
    with open(log, "w") as out:
        assert launch([sys.executable, str(script)], 2, out=out, timeout=30) == 0
    text = log.read_text()
    assert "[rank 0] rank 0 of 2" in text and "[rank 1] rank 1 of 2" in text
    start = time.monotonic()
    with open(log, "w") as out:
        assert launch([sys.executable, str(script), "fail"], 2, out=out, timeout=30) == 3
    assert time.monotonic() - start < 20  # rank 0 (sleeping 60 s) was stopped, not waited for


def test_generate_cli_relaunches_itself_for_tp2() -> None:
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "graphrunner.cli", "generate", "--tp", "2", "--device", "cpu", "--num-prompts", "2",
           "--prompt-len", "4", "--max-tokens", "2", "--num-kv-blocks", "16", "--max-model-len", "64",
           "--no-warmup", "--temperature", "0"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("generated tokens: 4") == 1  # printed by one rank only
    assert "tensor parallel:  2" in proc.stdout


# ---------------------------------------------------------------------------- HF checkpoint sharding


def _make_checkpoint(rank: int, world: int, path: str) -> None:
    from tests.hf_fixtures import make_hf_checkpoint

    # Qwen2: q/k/v bias, tied embeddings (the last PP stage keeps the embedding for its
    # head); an odd vocabulary pads the vocab-parallel shards.
    make_hf_checkpoint("qwen2", path, vocab_size=509)


def _generate_ckpt(rank: int, world: int, tp: int, pp: int, path: str) -> list[list[int]]:
    from graphrunner.engine.llm import LLM
    from graphrunner.protocol import SamplingParams

    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **LLM_ARGS)
    outs = llm.generate([p[:6] for p in PROMPTS], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    llm.shutdown()
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_hf_checkpoint_sharded_load_matches_one_process(tmp_path, tp: int, pp: int) -> None:
    path = str(tmp_path / "qwen2")
    run_world(1, _make_checkpoint, path, timeout_s=60)
    (ref,) = run_world(1, _generate_ckpt, 1, 1, path, timeout_s=60)
    got = run_world(2, _generate_ckpt, tp, pp, path, timeout_s=90)
    assert got[0] == ref and got[1] == ref


@pytest.mark.parametrize("tp,pp,spec", [
    (1, 2, {"method": "ngram", "num_speculative_tokens": 3}),
    (2, 1, {"method": "ngram", "num_speculative_tokens": 2}),
    (1, 2, {"method": "draft_model", "model": "builtin:tiny-llama", "num_speculative_tokens": 2, "draft_seed": 9}),
])
def test_speculative_decoding_under_tp_and_pp_matches_one_process(reference, tp, pp, spec):
    """The last PP stage's emitted tokens, counts and drafts reach every stage ([rows, 2k + 4]);
    under TP every rank verifies and drafts alike. Greedy tokens equal plain decoding."""
    infos = run_world(tp * pp, _generate, tp, pp, 1, {"speculative_config": spec}, timeout_s=120)
    for info in infos:
        assert info["tokens"] == reference


def test_speculative_decoding_under_lockstep_dp_in_the_async_loop_matches_one_process(reference) -> None:
    """Lockstep DP replicas in the async loop with n-gram drafts: every rank steps once per iteration,
    the idle one through dummy steps, and the greedy tokens equal plain decoding."""
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    infos = run_world(2, _generate, 1, 1, 2, {"data_parallel_lockstep": True, "speculative_config": spec},
                      timeout_s=120)
    for info in infos:
        assert info["tokens"] == reference and info["async"]
    assert sum(i["dummy_steps"] for i in infos) > 0
