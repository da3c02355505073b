"""LoRA under tensor parallelism: two gloo ranks equal one process (and peft).

Column-parallel projections (q|k|v, gate|up) split each slice's B rows, row-parallel ones (o, down)
split A's input columns and add their partial LoRA sums before the all-reduce (vLLM's sharding); the
tokens of a batch mixing two adapters with base rows equal one process's, eagerly and through graphs
(emulated on a CPU). GPU (`gpu` mark): the same over NCCL on two devices.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tests.dist_utils import run_world
from tests.hf_fixtures import make_hf_checkpoint
from tests.lora.lora_fixtures import make_adapter, peft_greedy

pytest.importorskip("peft")

PROMPTS = [[1, 5, 9, 22, 31, 40, 7], [3, 4, 5], [7, 8, 100, 200, 300, 11], [1, 5, 9, 22, 31, 40, 7]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_tp")
    ck = str(make_hf_checkpoint("llama", root / "base"))
    a1 = make_adapter(root / "a1", r=8, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"), seed=4)
    a2 = make_adapter(root / "a2", r=2, targets=("v_proj", "down_proj"), seed=5)
    loras = [(a1, 1), (a2, 2), None, None]
    refs = [peft_greedy(ck, None if lo is None else lo[0], [p], MAX_TOKENS)[0]
            for p, lo in zip(PROMPTS, loras, strict=True)]
    return ck, loras, refs


def _generate(rank: int, world: int, ck: str, loras: list, graphs: bool, device: str = "cpu") -> list[list[int]]:
    from graphrunner import LLM, LoRARequest, SamplingParams

    extra: dict = dict(enforce_eager=True)
    if graphs:  # CPU: FULL graphs emulated, pieces by the eager backend; CUDA: the defaults (inductor)
        extra = dict(enforce_eager=False, cudagraph_capture_sizes=[1, 2, 4, 8])
        if device == "cpu":
            extra["compile_backend"] = "eager"
    llm = LLM(ck, tensor_parallel_size=world, device=device, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=64, num_kv_blocks=48, enable_lora=True, max_loras=2, max_lora_rank=8,
              collective_timeout_s=60.0, **extra)
    requests = [None if lo is None else LoRARequest(f"a{lo[1]}", lo[1], lo[0]) for lo in loras]
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                        lora_request=requests, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_tp2_equals_one_process(world, graphs):
    ck, loras, refs = world
    (one,) = run_world(1, _generate, ck, loras, graphs, timeout_s=120)
    assert one == refs
    two = run_world(2, _generate, ck, loras, graphs, timeout_s=180)
    assert two[0] == one and two[1] == one


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_nccl_equals_one_gpu(world, tmp_path):
    """On CUDA over NCCL with graphs (inductor, FULL_AND_PIECEWISE), under `graphrunner launch` (one
    process per GPU): TP2 gives one GPU's tokens, which are peft's (float32, so that TP's reduction
    order cannot flip a greedy token)."""
    from graphrunner.distributed.launch import launch

    ck, loras, refs = world
    results = []
    for ranks in (1, 2):
        out = tmp_path / f"tp{ranks}.json"
        cmd = [sys.executable, "-m", "tests.lora.test_lora_tp", "--worker", json.dumps([ck, loras]), str(out)]
        assert launch(cmd, ranks, timeout=420) == 0
        results.append(json.loads(out.read_text()))
    assert results[0] == refs and results[1] == results[0]


def _worker(args: str, out: str) -> None:
    """One rank of the GPU test: float32 on cuda:LOCAL_RANK with graphs; rank 0 writes the tokens."""
    import torch.distributed as dist

    ck, loras = json.loads(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    tokens = _generate(rank, world, ck, [None if lo is None else tuple(lo) for lo in loras], True, "cuda")
    if rank == 0:
        with open(out, "w") as f:
            json.dump(tokens, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--worker":
    _worker(sys.argv[2], sys.argv[3])
