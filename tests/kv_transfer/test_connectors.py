"""KV connectors on a CPU: every instance that loads KV gives the tokens (and logprobs) of one LLM that
computes everything, reports the loaded tokens as cached, and recomputes what it cannot trust."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.config import KVTransferConfig

ARGS = dict(device="cpu", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=16, seed=0,
            num_kv_blocks=48)
GRAPHS = dict(enforce_eager=False, compile_backend="eager", cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32])
PROMPTS = [[(i * 7 + j * 13) % 500 + 3 for j in range(70)] for i in range(3)]  # 4 full blocks, then 6 tokens
LOADABLE = 69  # a connector loads every prompt token but the last
PROMPT_BLOCKS = 5  # a producer saves the 4 full blocks and the partial last one
CACHED_BLOCK_TOKENS = 64  # the prefix cache (and CPU offload) keeps the full blocks before the last token


def _params():
    from graphrunner.protocol import SamplingParams

    return [SamplingParams(max_tokens=6, temperature=0.0 if i % 2 else 0.8, seed=i, logprobs=0, ignore_eos=True)
            for i in range(len(PROMPTS))]


def _result(outs) -> list[tuple[list[int], list[float]]]:
    """Tokens and their logprobs: the logprobs move with any change of the KV a step reads."""
    return [(list(o.outputs[0].token_ids), [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
            for o in outs]


def _assert_same(got, want) -> None:
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        assert lps == pytest.approx(ref_lps, rel=1e-5, abs=1e-5)


def _storage(path: Path, role: str) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}


def _generate(prompts=PROMPTS, **extra):
    from graphrunner.engine import LLM

    llm = LLM("builtin:tiny-llama", **{**ARGS, **extra})
    outs = llm.generate(prompts, _params()[:len(prompts)], use_tqdm=False)
    return llm, outs


@pytest.fixture(scope="module")
def reference():
    return _result(_generate()[1])


@pytest.fixture(scope="module")
def store(tmp_path_factory, reference):
    """A directory a producer filled with PROMPTS' blocks (its own tokens equal the reference's)."""
    path = tmp_path_factory.mktemp("kvstore")
    llm, outs = _generate(kv_transfer_config=_storage(path, "kv_producer"))
    _assert_same(_result(outs), reference)
    assert llm.runner.kv_connector.num_saved_blocks == len(PROMPTS) * PROMPT_BLOCKS
    return path


def test_config_names_bad_values():
    with pytest.raises(ValueError, match="kv_connector='Nope'"):
        KVTransferConfig("Nope")
    with pytest.raises(ValueError, match="kv_role='reader'"):
        KVTransferConfig("SharedStorageConnector", "reader")
    with pytest.raises(ValueError, match=r"unknown keys \['role'\]"):
        KVTransferConfig.coerce({"kv_connector": "SharedStorageConnector", "role": "x"})
    with pytest.raises(ValueError, match="shared_storage_path"):
        _generate(kv_transfer_config={"kv_connector": "SharedStorageConnector"})
    with pytest.raises(ValueError, match="needs enable_prefix_caching=True"):
        _generate(enable_prefix_caching=False, kv_transfer_config={
            "kv_connector": "CpuOffloadConnector", "kv_connector_extra_config": {"cpu_bytes": 1 << 20}})
    with pytest.raises(ValueError, match="cpu_bytes"):
        _generate(kv_transfer_config={"kv_connector": "CpuOffloadConnector",
                                      "kv_connector_extra_config": {"cpu_bytes": 10}})


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_consumer_loads_the_producers_blocks(store, reference, async_scheduling):
    llm, outs = _generate(kv_transfer_config=_storage(store, "kv_consumer"), async_scheduling=async_scheduling)
    _assert_same(_result(outs), reference)
    assert [o.num_cached_tokens for o in outs] == [LOADABLE] * len(PROMPTS)
    connector = llm.scheduler.kv_connector
    assert connector.num_external_hit_tokens == LOADABLE * len(PROMPTS)
    assert connector.external_hit_rate == pytest.approx(LOADABLE / 70)


def test_connector_keeps_the_full_graphs(store, reference):
    """Loads land before the step's graphs replay: decode steps still replay FULL graphs, a consumer
    captures the graphs a runner without a connector does, and with every prompt token but the last
    loaded, admitting a request adds a decode-shaped row (no prefill step)."""
    from capture.modes import CUDAGraphMode
    from graphrunner.engine import LLM

    plain = LLM("builtin:tiny-llama", **ARGS, **GRAPHS)
    llm = LLM("builtin:tiny-llama", kv_transfer_config=_storage(store, "kv_consumer"), **ARGS, **GRAPHS)
    assert llm.runner.capture_report.num_graphs == plain.runner.capture_report.num_graphs
    modes = []
    execute = llm.runner.execute_model

    def record(so):
        execute(so)
        modes.append((so.total_num_scheduled_tokens == len(so.num_scheduled_tokens), llm.runner.last_descriptor))

    llm.runner.execute_model = record
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    _assert_same(_result(outs), reference)
    assert [o.num_cached_tokens for o in outs] == [LOADABLE] * len(PROMPTS)
    decodes = [desc for uniform, desc in modes if uniform and desc is not None]
    assert decodes and all(desc.cg_mode == CUDAGraphMode.FULL for desc in decodes)
    # The whole prompt loaded but its last token: even a request's first step is one token a request.
    assert all(uniform for uniform, _ in modes)


def _producer(rank: int, world_size: int, path: str) -> list:
    """Rank 0 produces, rank 1 waits for its marker and consumes; both return their results."""
    import os

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):  # two independent instances, not a world
        os.environ.pop(name, None)
    marker = Path(path) / "done"
    if rank == 1:
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert time.monotonic() < deadline, "the producer never finished"
            time.sleep(0.05)
    llm, outs = _generate(kv_transfer_config=_storage(Path(path), "kv_producer" if rank == 0 else "kv_consumer"))
    if rank == 0:
        marker.write_text("ok")
    return [_result(outs), [o.num_cached_tokens for o in outs]]


def test_producer_and_consumer_in_two_processes(tmp_path, reference):
    from tests.dist_utils import run_world

    (prod, prod_cached), (cons, cons_cached) = run_world(2, _producer, str(tmp_path), init_pg=False, timeout_s=60)
    _assert_same([tuple(r) for r in prod], reference)
    _assert_same([tuple(r) for r in cons], reference)
    assert prod_cached == [0] * len(PROMPTS) and cons_cached == [LOADABLE] * len(PROMPTS)


def _rewrite(path: Path, how: str) -> None:
    from graphrunner.kv_transfer.shared_storage import _LEN, MAGIC

    raw = path.read_bytes()
    (head_len,) = _LEN.unpack_from(raw, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    header = json.loads(raw[start:start + head_len])
    payload = bytearray(raw[start + head_len:])
    if how == "corrupt":
        payload[len(payload) // 2] ^= 0xFF
    elif how == "truncate":
        payload = payload[:-100]
    elif how == "dtype":
        header["dtype"] = "float16"
    elif how == "block_size":
        header["block_size"] = 32
    head = json.dumps(header, sort_keys=True).encode()
    path.write_bytes(MAGIC + _LEN.pack(len(head)) + head + bytes(payload))


def test_bad_store_entries_are_recomputed(store, reference, tmp_path, caplog):
    """A corrupt third block, a foreign second one, a first one of another dtype: each prompt's chain stops
    before its bad block (logged), the rest is computed, the tokens stay the reference's."""
    import shutil

    from graphrunner.kv_transfer import prefix_hashes
    from graphrunner.kv_transfer.shared_storage import block_file

    bad = tmp_path / "store"
    shutil.copytree(store, bad)
    hashes = [prefix_hashes(p, 4, 16) for p in PROMPTS]
    _rewrite(block_file(bad, hashes[0][2]), "corrupt")
    shutil.copy(block_file(bad, hashes[0][3]), block_file(bad, hashes[1][1]))  # foreign: another block's file
    block_file(bad, hashes[1][2]).unlink()  # (behind the foreign one: never read)
    _rewrite(block_file(bad, hashes[2][0]), "dtype")
    with caplog.at_level(logging.WARNING, logger="graphrunner.kv_transfer"):
        llm, outs = _generate(kv_transfer_config=_storage(bad, "kv_consumer"))
    _assert_same(_result(outs), reference)
    assert [o.num_cached_tokens for o in outs] == [32, 16, 0]
    text = caplog.text
    assert "checksum mismatch" in text and "foreign" in text and "dtype='float16'" in text
    assert llm.scheduler.kv_connector.num_rejected_blocks == 3


@pytest.mark.parametrize("how", ["truncate", "block_size"])
def test_truncated_or_foreign_geometry_is_refused(how):
    import torch

    from graphrunner.kv_shape import KVCacheShape
    from graphrunner.kv_transfer.shared_storage import decode_block, encode_block

    shape = KVCacheShape(2, 4, 1, 8, torch.float32)
    data = torch.randn(2, 2, 4, 1, 8)
    raw = encode_block(shape, "m", "h", [1, 2, 3, 4], data)
    assert torch.equal(decode_block(raw, shape, "m", "h", [1, 2, 3, 4]), data)
    with pytest.raises(ValueError, match="another model|does not match"):
        decode_block(raw, shape, "other-model", "h", [1, 2, 3, 4])
    from graphrunner.kv_transfer.shared_storage import _LEN, MAGIC

    (head_len,) = _LEN.unpack_from(raw, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    header = json.loads(raw[start:start + head_len])
    payload = raw[start + head_len:]
    if how == "truncate":
        payload = payload[:-7]
        match = "truncated"
    else:
        header["block_size"] = 8
        match = "block_size=8"
    head = json.dumps(header, sort_keys=True).encode()
    with pytest.raises(ValueError, match=match):
        decode_block(MAGIC + _LEN.pack(len(head)) + head + payload, shape, "m", "h", [1, 2, 3, 4])


def test_cpu_offload_brings_an_evicted_prefix_back(reference):
    """A GPU cache of 12 blocks: the first prompt's blocks are evicted by the later prompts, offloaded
    to the host LRU, and all come back when it is asked again, with the reference's tokens."""
    from graphrunner.engine import LLM

    small = {**ARGS, "num_kv_blocks": 12, "max_num_seqs": 1}
    block_bytes = 2 * 4 * 16 * 2 * 32 * 4  # K and V x layers x tokens x KV heads x head_dim x fp32
    llm = LLM("builtin:tiny-llama", kv_transfer_config={
        "kv_connector": "CpuOffloadConnector", "kv_connector_extra_config": {"cpu_bytes": 32 * block_bytes}}, **small)
    params = _params()
    first = llm.generate(PROMPTS, params, use_tqdm=False)
    _assert_same(_result(first), reference)
    others = [[(i * 11 + j * 5) % 700 + 900 for j in range(70)] for i in range(2)]
    llm.generate(others, params[:2], use_tqdm=False)  # every GPU block of the first prompt is handed out again
    connector = llm.scheduler.kv_connector
    assert connector.num_slots == 32 and connector.num_offloaded_blocks >= 4
    again = llm.generate(PROMPTS[:1], params[:1], use_tqdm=False)
    _assert_same(_result(again), reference[:1])
    assert again[0].num_cached_tokens == CACHED_BLOCK_TOKENS
    assert connector.num_external_hit_tokens == CACHED_BLOCK_TOKENS  # all from host memory


def test_cpu_offload_lru_is_bounded_and_keeps_recent_prefixes():
    import torch

    from graphrunner.kv_shape import KVCacheShape
    from graphrunner.kv_transfer.cpu_offload import CpuOffloadScheduler

    shape = KVCacheShape(1, 2, 1, 2, torch.float32)
    config = KVTransferConfig("CpuOffloadConnector", kv_connector_extra_config={"cpu_bytes": 2 * shape.block_bytes})
    sched = CpuOffloadScheduler(config, shape, "m")

    class Req:
        def __init__(self, rid, tokens, blocks):
            self.req_id, self.all_token_ids, self.block_ids, self.cache_salt = rid, tokens, blocks, 0
            self.block_key_tokens = tokens
            self.num_tokens = len(tokens)

    reqs = [Req(f"r{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3], [i]) for i in range(3)]
    for r in reqs:
        sched.blocks_cached(r, 1)
        sched.block_evicted(r.block_ids[0])
    meta = sched.build_connector_meta(None, {})
    assert [slot for _, slot in meta.offloads] == [0, 1, 0]  # the third reuses the oldest slot
    assert sched.get_num_new_matched_tokens(reqs[0], 0) == 0  # evicted from the host LRU
    assert sched.get_num_new_matched_tokens(reqs[2], 0) == 2
    assert len(sched._index) == 2


def test_fp8_blocks_scatter_and_gather_as_their_bytes():
    """Every one of the 256 e4m3 bit patterns (NaN and -0 included) lands in the paged cache and comes
    back unchanged: fp8 blocks move as bytes, never through a float conversion."""
    import torch

    from graphrunner.kv_shape import KVCacheShape
    from graphrunner.kv_transfer.base import gather_blocks, scatter_blocks

    shape = KVCacheShape(2, 4, 2, 16, torch.float8_e4m3fn)
    caches = shape.allocate(5, torch.device("cpu"))
    data = torch.arange(2 * 2 * 2 * 4 * 2 * 16).remainder(256).to(torch.uint8)
    data = data.reshape(2, 2, 2, 4, 2, 16).view(torch.float8_e4m3fn)  # [L, 2, n=2, bs, h, d]
    scatter_blocks(caches, [3, 1], data)
    back = gather_blocks(caches, [3, 1])
    assert torch.equal(back.view(torch.uint8), data.view(torch.uint8))
    assert not caches[0][:, [0, 2, 4]].view(torch.uint8).any()  # other blocks untouched


@pytest.mark.parametrize("layers", [1, 3])
def test_blocks_move_the_same_through_one_allocation_and_per_layer_tensors(layers):
    """`allocate` gives evenly spaced views of one allocation, moved in one copy for every layer
    (`stacked_layers`); separate per-layer tensors (no common allocation) move layer by layer. Both
    land the same values in the same places and gather them back."""
    import torch

    from graphrunner.kv_shape import KVCacheShape, stacked_layers
    from graphrunner.kv_transfer.base import gather_blocks, scatter_blocks

    shape = KVCacheShape(layers, 4, 2, 8, torch.float32)
    together = shape.allocate(6, torch.device("cpu"))
    apart = [torch.zeros_like(cache) for cache in together]  # same layout, own storages
    stacked = stacked_layers(together)
    assert stacked is not None and (stacked_layers(apart) is None) == (layers > 1)
    assert all(torch.equal(stacked[i], cache) for i, cache in enumerate(together))
    data = torch.randn(layers, 2, 3, 4, 2, 8)[:, :, [2, 0, 1]]  # [L, 2, n, bs, h, d], not contiguous
    for caches in (together, apart):
        scatter_blocks(caches, [4, 0, 2], data)
        assert torch.equal(gather_blocks(caches, [4, 0, 2]), data)
        assert not torch.stack([cache[:, [1, 3, 5]] for cache in caches]).any()  # other blocks untouched
    assert all(torch.equal(a, b) for a, b in zip(together, apart, strict=True))
    shifted = [together[0]] + [cache[:, 1:] for cache in together[1:]]  # not one layout
    assert layers == 1 or stacked_layers(shifted) is None


def test_fp8_kv_blocks_travel_as_their_bytes(tmp_path):
    """fp8 KV (kv_cache_dtype="fp8"): a consumer loads the producer's quantized blocks byte for byte
    and gives the fp8 run's tokens and logprobs; the store names the dtype, so a bf16/fp32 instance
    never takes fp8 blocks (and the reverse)."""
    from graphrunner.kv_transfer import prefix_hashes
    from graphrunner.kv_transfer.shared_storage import _LEN, MAGIC, block_file

    fp8 = {"kv_cache_dtype": "fp8"}
    want = _result(_generate(**fp8)[1])
    _, outs = _generate(kv_transfer_config=_storage(tmp_path, "kv_producer"), **fp8)
    _assert_same(_result(outs), want)
    raw = block_file(tmp_path, prefix_hashes(PROMPTS[0], 4, 16)[0]).read_bytes()
    (head_len,) = _LEN.unpack_from(raw, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    assert json.loads(raw[start:start + head_len])["dtype"] == "float8_e4m3fn"
    assert len(raw) - start - head_len == 2 * 4 * 16 * 2 * 32  # one byte per element
    _, outs = _generate(kv_transfer_config=_storage(tmp_path, "kv_consumer"), **fp8)
    _assert_same(_result(outs), want)
    assert [o.num_cached_tokens for o in outs] == [LOADABLE] * len(PROMPTS)
    _, outs = _generate(kv_transfer_config=_storage(tmp_path, "kv_consumer"))
    assert [o.num_cached_tokens for o in outs] == [0] * len(PROMPTS)  # fp32 instance: dtype mismatch


def test_cpu_offload_moves_fp8_blocks_unchanged():
    """The CPU offload connector with fp8 KV: an evicted prefix comes back from host memory and the
    tokens and logprobs are those of the fp8 run that computed everything."""
    from graphrunner.engine import LLM

    small = {**ARGS, "num_kv_blocks": 12, "max_num_seqs": 1, "kv_cache_dtype": "fp8"}
    block_bytes = 2 * 4 * 16 * 2 * 32  # K and V x layers x tokens x KV heads x head_dim x 1 byte
    want = _result(_generate(kv_cache_dtype="fp8")[1])
    llm = LLM("builtin:tiny-llama", kv_transfer_config={
        "kv_connector": "CpuOffloadConnector", "kv_connector_extra_config": {"cpu_bytes": 32 * block_bytes}}, **small)
    params = _params()
    _assert_same(_result(llm.generate(PROMPTS, params, use_tqdm=False)), want)
    connector = llm.scheduler.kv_connector
    assert connector.num_slots == 32  # the fp8 block size sets the host slots
    others = [[(i * 11 + j * 5) % 700 + 900 for j in range(70)] for i in range(2)]
    llm.generate(others, params[:2], use_tqdm=False)
    assert connector.num_offloaded_blocks >= 4
    again = llm.generate(PROMPTS[:1], params[:1], use_tqdm=False)
    _assert_same(_result(again), want[:1])
    assert again[0].num_cached_tokens == CACHED_BLOCK_TOKENS


@pytest.mark.parametrize("pick", [[0, 1, 2, 3], [1, 2], [2], [0, 2, 3], [3, 2, 1], "two messages", "copies",
                                  "many copies"])
def test_block_runs_are_the_stacked_blocks_and_views_of_consecutive_ones(pick):
    """A message's consecutive blocks come back as views of it (no copy), one run each; blocks read one by
    one come back as runs of one, or past max_runs stacked into one; concatenated, the runs equal the
    stacked blocks."""
    import torch

    from graphrunner.kv_transfer.base import block_runs

    messages = [torch.randn(3, 2, 4, 4, 2, 8) for _ in range(2)]  # [L, 2, n, bs, h, d]
    if pick == "two messages":
        blocks = [messages[0][:, :, 2], messages[0][:, :, 3], messages[1][:, :, 0]]
    elif pick in ("copies", "many copies"):
        blocks = [messages[0][:, :, j % 4].clone() for j in range(2 if pick == "copies" else 5)]
    else:
        blocks = [messages[0][:, :, j] for j in pick]
    runs = block_runs(blocks, max_runs=3)
    assert torch.equal(torch.cat(runs, dim=2), torch.stack(blocks, dim=2))
    if pick == "many copies":
        assert len(runs) == 1
        return
    expected = {"two messages": [2, 1], "copies": [1, 1], "[0, 1, 2, 3]": [4], "[1, 2]": [2], "[2]": [1],
                "[0, 2, 3]": [1, 2], "[3, 2, 1]": [1, 1, 1]}
    assert [r.shape[2] for r in runs] == expected[str(pick)]
    shared = [r.untyped_storage().data_ptr() in (m.untyped_storage().data_ptr() for m in messages) for r in runs]
    assert all(shared) == (pick != "copies")


def _hashes_one_by_one(keys, n, bs, salt):
    import hashlib

    import numpy as np

    from graphrunner.kv_transfer.base import _block_bytes

    out, parent = [], f"salt:{salt}"
    for i in range(n):
        block = keys[i * bs:(i + 1) * bs]
        data = (_block_bytes(block) if any(isinstance(k, str) for k in block)
                else np.asarray(block, dtype=np.int64).tobytes())
        parent = hashlib.sha256(parent.encode() + data).hexdigest()
        out.append(parent)
    return out


_KEY = st.one_of(st.integers(0, 2**40), st.just("a" * 64), st.just("7" * 64))


@given(st.lists(_KEY, min_size=0, max_size=70), st.integers(1, 8), st.integers(0, 3), st.data())
def test_prefix_hashes_of_a_prompt_at_once_equal_block_by_block_and_in_pieces(keys, bs, salt, data):
    """The digests of a whole span (one conversion of its token ids) equal the chain built one block at a
    time, and extending known digests in pieces gives the same chain, with or without content hashes."""
    from graphrunner.kv_transfer.base import prefix_hashes

    n = len(keys) // bs
    whole = prefix_hashes(keys, n, bs, salt)
    assert whole == _hashes_one_by_one(keys, n, bs, salt)
    cut = data.draw(st.integers(0, n))
    assert prefix_hashes(keys, n, bs, salt, prefix_hashes(keys, cut, bs, salt)) == whole


@pytest.mark.parametrize("length", [2, 10, 16, 17, 31])
def test_a_prompt_of_any_length_loads_all_but_its_last_token(tmp_path, length):
    """Shorter than a block, exactly blocks, or one token past them: the consumer loads every prompt token
    but the last (the partial last block is saved and loaded too) and gives the tokens and logprobs of an
    instance computing everything."""
    prompt = [[(j * 11) % 400 + 5 for j in range(length)]]
    want = _result(_generate(prompt)[1])
    producer, outs = _generate(prompt, kv_transfer_config=_storage(tmp_path, "kv_producer"))
    _assert_same(_result(outs), want)
    assert producer.runner.kv_connector.num_saved_blocks == -(-length // 16)
    consumer, outs = _generate(prompt, kv_transfer_config=_storage(tmp_path, "kv_consumer"))
    _assert_same(_result(outs), want)
    assert outs[0].num_cached_tokens == length - 1


@pytest.fixture(scope="module")
def three_instances(tmp_path_factory):
    """A producer and a consumer sharing a store, and an instance computing everything (each with its
    prefix cache, so earlier examples' prompts are local hits for later ones)."""
    from graphrunner.engine import LLM

    path = tmp_path_factory.mktemp("kvprops")
    args = {**ARGS, "max_model_len": 128, "num_kv_blocks": 64}
    return (LLM("builtin:tiny-llama", kv_transfer_config=_storage(path, "kv_producer"), **args),
            LLM("builtin:tiny-llama", kv_transfer_config=_storage(path, "kv_consumer"), **args),
            LLM("builtin:tiny-llama", **args))


@given(st.lists(st.integers(1, 60), min_size=1, max_size=3), st.integers(0, 40), st.integers(0, 999))
def test_loaded_prompts_of_any_length_after_any_local_hit_give_the_plain_tokens(three_instances, lengths, shared,
                                                                                   seed):
    """Prompts sharing a prefix (so the consumer's own prefix cache hits part of later ones) and of any
    length: the consumer's tokens and logprobs equal the plain instance's, and every prompt token but the
    last is either a local hit or loaded."""
    producer, consumer, plain = three_instances
    head = [(seed * 7 + j * 13) % 500 + 3 for j in range(shared)]
    prompts = [head + [(seed + i * 31 + j * 17) % 500 + 3 for j in range(n)] for i, n in enumerate(lengths)]
    params = _params()[:1] * len(prompts)
    want = _result(plain.generate(prompts, params, use_tqdm=False))
    producer.generate(prompts, params, use_tqdm=False)
    outs = consumer.generate(prompts, params, use_tqdm=False)
    _assert_same(_result(outs), want)
    assert [o.num_cached_tokens for o in outs] == [len(p) - 1 for p in prompts]
