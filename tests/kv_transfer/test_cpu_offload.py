"""CpuOffloadConnector on a CPU: multi-turn conversations whose histories exceed the GPU cache (and the
host LRU) give the tokens of an engine without offload, and every block loaded back holds exactly the
bytes offloaded for its prefix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphrunner.config import KVTransferConfig
from graphrunner.kv_shape import KVCacheShape
from graphrunner.kv_transfer.cpu_offload import CpuOffloadScheduler, CpuOffloadWorker, block_checksums

# K and V x 4 layers x 16 tokens x 2 KV heads x 32 dims x 4 bytes: one fp32 block of builtin:tiny-llama.
BLOCK_BYTES = 2 * 4 * 16 * 2 * 32 * 4
ENGINE = dict(device="cpu", max_num_seqs=8, max_num_batched_tokens=256, max_model_len=320, block_size=16, seed=0,
              num_kv_blocks=64, enable_prefix_caching=True, enforce_eager=True)


class _Req:
    def __init__(self, rid: str, tokens: list[int], blocks: list[int]) -> None:
        self.req_id, self.all_token_ids, self.block_ids, self.cache_salt = rid, tokens, blocks, 0
        self.block_key_tokens = tokens
        self.num_tokens, self.num_computed_tokens = len(tokens), 0


def test_matched_slots_survive_the_evictions_of_their_own_admission():
    """A full host LRU: admitting a request whose history sits in the two oldest slots allocates its
    GPU blocks, which hands out two other cached blocks. Their offloads must not take the matched slots
    (they were the least recently used), else the loads read the other blocks' KV."""
    shape = KVCacheShape(1, 2, 1, 2, torch.float32)
    config = KVTransferConfig("CpuOffloadConnector", kv_connector_extra_config={"cpu_bytes": 2 * shape.block_bytes})
    sched = CpuOffloadScheduler(config, shape, "m")
    history = _Req("turn1", [1, 2, 3, 4], [0, 1])
    sched.blocks_cached(history, 2)
    sched.block_evicted(0)
    sched.block_evicted(1)
    meta = sched.build_connector_meta(None, {})
    assert meta.offloads == [(0, 0), (1, 1)]  # the host is full
    other = _Req("other", [7, 8, 9, 10], [2, 3])
    sched.blocks_cached(other, 2)

    turn2 = _Req("turn2", [1, 2, 3, 4, 5], [])
    assert sched.get_num_new_matched_tokens(turn2, 0) == 4
    # Admission allocates blocks 2 and 3 for it: the prefix cache hands out `other`'s cached blocks.
    sched.block_evicted(2)
    sched.block_evicted(3)
    turn2.num_computed_tokens = 4
    sched.update_state_after_alloc(turn2, [2, 3, 4], 4)
    meta = sched.build_connector_meta(None, {})
    assert meta.offloads == []  # no free slot: `other` is recomputed if asked again
    assert meta.loads == [(0, 2), (1, 3)]
    assert sched.get_num_new_matched_tokens(_Req("turn3", [1, 2, 3, 4, 5], []), 0) == 4


def test_checksums_see_every_byte_and_its_place():
    data = torch.randn(2, 2, 3, 4, 2, 8, dtype=torch.bfloat16)
    sums = block_checksums(data)
    assert sums.shape == (3,) and torch.equal(sums, block_checksums(data.clone()))
    assert len(set(sums.tolist())) == 3
    flipped = data.clone()
    flipped.view(torch.int16)[1, 0, 2, 3, 1, 7] ^= 1  # one bit of one element of block 2
    assert torch.equal((block_checksums(flipped) != sums), torch.tensor([False, False, True]))
    swapped = data.clone()
    swapped[:, :, 0, [0, 1]] = data[:, :, 0, [1, 0]]  # block 0's first two tokens trade places
    assert block_checksums(swapped)[0] != sums[0]


def test_worker_reports_a_load_of_other_bytes():
    """The worker's check compares what a load left in the paged cache with what was offloaded for the
    same prefix: a slot overwritten in between is caught."""
    shape = KVCacheShape(2, 4, 2, 8, torch.float32)
    config = KVTransferConfig("CpuOffloadConnector",
                              kv_connector_extra_config={"cpu_bytes": 4 * shape.block_bytes, "verify_loads": True})
    worker = CpuOffloadWorker(config, shape, "m", torch.device("cpu"))
    caches = shape.allocate(6, torch.device("cpu"))
    for cache in caches:
        cache.copy_(torch.randn(cache.shape))
    worker.register_kv_caches(caches)
    from graphrunner.kv_transfer.cpu_offload import CpuOffloadMetadata

    worker.load(CpuOffloadMetadata(offloads=[(0, 0), (1, 1)], offload_hashes=["a", "b"]))
    worker.load(CpuOffloadMetadata(loads=[(0, 4)], load_hashes=["a"]))
    worker.host[1].add_(1.0)  # the slot of "b" rewritten behind the index's back
    worker.load(CpuOffloadMetadata(loads=[(1, 5)], load_hashes=["b"]))
    assert worker.verify_report() == {"checked": 2, "mismatched": ["b"]}


def _conversations(llm, num: int, turns: int, first: int, extra: int, out: int) -> list[list[list[int]]]:
    """Every turn's greedy tokens of `num` conversations (bench offload's workload, scaled down)."""
    from graphrunner.protocol import SamplingParams

    rng = np.random.default_rng(0)
    history = rng.integers(3, 2000, size=(num, first)).tolist()
    params = [SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)] * num
    tokens = []
    for _ in range(turns):
        outs = llm.generate(history, params, use_tqdm=False)
        replies = [list(o.outputs[0].token_ids) for o in outs]
        tokens.append(replies)
        new = rng.integers(3, 2000, size=(num, extra)).tolist()
        history = [h + r + e for h, r, e in zip(history, replies, new, strict=True)]
    return tokens


@pytest.mark.parametrize("slots", [400, 48])
def test_multi_turn_offload_gives_the_plain_engines_tokens_and_bytes(slots):
    """8 conversations x 4 turns of 128 + 48 a turn tokens (histories up to 18 blocks, 144 in all) on 64 GPU
    blocks: with 400 host slots everything offloaded stays, with 48 the host LRU is full from turn 2 on
    and reuses slots while requests are matched. fp32: tokens equal the plain engine's, and every loaded
    block's bytes equal those offloaded for its prefix."""
    from graphrunner.engine import LLM

    plain = _conversations(LLM("builtin:tiny-llama", **ENGINE), 8, 4, 128, 32, 16)
    llm = LLM("builtin:tiny-llama", **ENGINE, kv_transfer_config={
        "kv_connector": "CpuOffloadConnector",
        "kv_connector_extra_config": {"cpu_bytes": slots * BLOCK_BYTES, "verify_loads": True}})
    got = _conversations(llm, 8, 4, 128, 32, 16)
    connector = llm.scheduler.kv_connector
    report = llm.runner.kv_connector.verify_report()
    assert connector.num_external_hit_tokens > 0 and report["checked"] > 0
    assert report["mismatched"] == []
    assert got == plain
