"""GPU: TP2, PP2, DP2 and TP2xPP2 with FULL graphs (NCCL) give one GPU's greedy tokens, and exit cleanly.

Each case runs this module as a worker (`python -m tests.test_dist_gpu --worker ...`)
under `graphrunner launch` (one process per GPU, NCCL), with builtin:tiny-llama in
float32 (so TP's different reduction order cannot flip a greedy token) and the default
FULL_AND_PIECEWISE mode with inductor: FULL graphs capture the step body with its
NCCL all-reduces, PIECEWISE pieces capture theirs. The reference is the same worker
on one GPU. Skipped without enough GPUs. tools/gpu_dist.sh runs these.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

WORKER_TIMEOUT_S = 420
PROMPTS = [[1 + i, 5, 9, 13 + i, 100 + i] for i in range(6)] + [[7] * 40, [3, 4]]
MAX_TOKENS = [12, 5, 16, 3, 12, 8, 10, 6]


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # pragma: no cover
        return 0


def _run(tmp_path, tp: int, pp: int, dp: int, mode: str = "FULL_AND_PIECEWISE") -> dict:
    from graphrunner.distributed.launch import launch

    out = tmp_path / f"tp{tp}_pp{pp}_dp{dp}_{mode.replace(':', '_')}.json"
    cmd = [sys.executable, "-m", "tests.test_dist_gpu", "--worker", str(tp), str(pp), str(dp), mode, str(out)]
    pcp = int(mode.split(PCP_SUFFIX)[1]) if PCP_SUFFIX in mode else 1
    status = launch(cmd, tp * pp * dp * pcp, timeout=WORKER_TIMEOUT_S)
    assert status == 0, f"tp={tp} pp={pp} dp={dp}: launcher exit status {status} (124 = timeout/hang)"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    if _gpus() < 1:
        pytest.skip("needs a CUDA GPU")
    return _run(tmp_path_factory.mktemp("ref"), 1, 1, 1)["tokens"]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tp,pp,dp", [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1)], ids=["tp2", "pp2", "dp2", "tp2pp2"]
)
def test_parallel_full_graphs_match_one_gpu(reference, tmp_path, tp: int, pp: int, dp: int) -> None:
    need = tp * pp * dp
    if _gpus() < need:
        pytest.skip(f"needs {need} GPUs, found {_gpus()}")
    info = _run(tmp_path, tp, pp, dp)
    assert info["captured"] and "FULL" in info["mode"]
    assert info["tokens"] == reference


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["FULL", "PIECEWISE"])
def test_tp2_single_graph_modes_match(reference, tmp_path, mode: str) -> None:
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    info = _run(tmp_path, 2, 1, 1, mode)
    assert info["tokens"] == reference


@pytest.mark.gpu
@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1)], ids=["pp2", "tp2"])
def test_speculative_decoding_under_parallelism_matches_one_gpu(reference, tmp_path, tp: int, pp: int) -> None:
    """n-gram speculation (k = 3) in FULL graphs: under PP the last stage's [rows, 2k + 4]
    outcome goes to the other stage over NCCL; under TP every rank verifies alike."""
    if _gpus() < tp * pp:
        pytest.skip(f"needs {tp * pp} GPUs")
    info = _run(tmp_path, tp, pp, 1, "FULL_AND_PIECEWISE" + SPEC_SUFFIX)
    assert info["captured"] and info["tokens"] == reference


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE:ngram3"], ids=["plain", "ngram3"])
def test_prefill_context_parallel_matches_one_gpu(reference, tmp_path, mode: str) -> None:
    """PCP2: prefills split DualChunkSwap over two GPUs (K/V all-gathered over NCCL in the
    attention op between PIECEWISE pieces), decodes in FULL graphs on both; one GPU's tokens."""
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    info = _run(tmp_path, 1, 1, 1, mode + PCP_SUFFIX + "2")
    assert info["captured"] and info["split_steps"] > 0 and info["tokens"] == reference


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE:ngram3"], ids=["plain", "ngram3"])
def test_decode_context_parallel_matches_one_gpu(reference, tmp_path, mode: str) -> None:
    """TP2 x DCP2: both GPUs hold every KV head and half of each sequence; the query all-gather,
    the sharded attention and the LSE merge run in FULL decode graphs (NCCL captured) and
    between PIECEWISE pieces; one GPU's tokens."""
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    info = _run(tmp_path, 2, 1, 1, mode + DCP_SUFFIX + "2")
    assert info["captured"] and info["tokens"] == reference


SPEC_SUFFIX = ":ngram3"  # a mode argument with it turns n-gram speculation (k = 3) on
DCP_SUFFIX = ":dcp"  # a mode argument ending in it and a size runs decode context parallelism (inside TP)
PCP_SUFFIX = ":pcp"  # a mode argument ending in it and a size runs prefill context parallelism


def _worker(tp: int, pp: int, dp: int, mode: str, out_path: str) -> None:
    from graphrunner.engine.llm import LLM
    from graphrunner.protocol import SamplingParams

    spec, pcp, dcp = None, 1, 1
    if PCP_SUFFIX in mode:
        mode, size = mode.split(PCP_SUFFIX)
        pcp = int(size)
    if DCP_SUFFIX in mode:
        mode, size = mode.split(DCP_SUFFIX)
        dcp = int(size)
    if mode.endswith(SPEC_SUFFIX):
        mode, spec = mode.removesuffix(SPEC_SUFFIX), {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(
        "builtin:tiny-llama", dtype="float32", device="cuda", tensor_parallel_size=tp, pipeline_parallel_size=pp,
        data_parallel_size=dp, prefill_context_parallel_size=pcp, decode_context_parallel_size=dcp,
        max_num_seqs=16, max_num_batched_tokens=128, max_model_len=256, num_kv_blocks=128,
        enforce_eager=False, cudagraph_mode=mode, collective_timeout_s=120.0, seed=5, speculative_config=spec,
    )
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params)
    info = {
        "tokens": [o.token_ids for o in outs],
        "captured": bool(llm.runner.graphs.captured),
        "mode": llm.runner.graphs.mode.name,
        "split_steps": llm.runner.body.pcp.num_split_steps if llm.runner.body.pcp is not None else 0,
    }
    rank = llm.groups.rank
    llm.shutdown()  # graphs and pool, then the process groups: must not hang
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(info, f)


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--worker":
        tp, pp, dp = (int(x) for x in sys.argv[2:5])
        _worker(tp, pp, dp, sys.argv[5], sys.argv[6])
        sys.stdout.flush()
        os._exit(0)
    raise SystemExit("usage: python -m tests.test_dist_gpu --worker TP PP DP MODE OUT.json")
