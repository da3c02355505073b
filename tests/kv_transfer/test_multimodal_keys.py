"""KV connectors key blocks as the prefix cache does: by the prompt's tokens with each image's (or prompt
embeddings') content hash in place of its placeholder ids. Two prompts with equal placeholder tokens
and different images (or embeddings) never share a connector's block, and equal ones still do."""

from __future__ import annotations

import pytest
import torch

from tests.multimodal.conftest import IMAGE_TOKEN, make_llava, random_image

pytest.importorskip("PIL")

GREEDY = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
# block_size 4: block 0 is text, blocks 1-4 the image's 16 positions, then text (28 prompt tokens).
IDS = [5, 6, 7, 8, IMAGE_TOKEN, 9, 10, 11, 12, 13, 14, 15, 16]
FILLER = [(7 * j) % 500 + 20 for j in range(88)]  # 22 blocks: evicts the cached image blocks
ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128,
              block_size=4, num_kv_blocks=24, enforce_eager=True, enable_prefix_caching=True)


def _request(image) -> dict:
    return {"prompt_token_ids": IDS, "multi_modal_data": {"image": image}}


def _tokens(llm, prompt) -> tuple[list[int], int]:
    from graphrunner import SamplingParams

    out = llm.generate([prompt], SamplingParams(**GREEDY), use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("llava")
    make_llava(path)
    return path


@pytest.fixture(scope="module")
def images():
    return [random_image(11), random_image(12)]


@pytest.fixture(scope="module")
def plain(llava_path, images):
    """Each image's greedy tokens from an engine without a connector."""
    from graphrunner.engine import LLM

    llm = LLM(str(llava_path), **ENGINE)
    return [_tokens(llm, _request(image))[0] for image in images]


def test_cpu_offload_keys_blocks_by_the_image(llava_path, images, plain):
    """Image A's blocks are offloaded (a long text prompt evicts them); a prompt with image B and the same
    placeholder tokens must not load them, and image A again does."""
    from graphrunner.engine import LLM

    llm = LLM(str(llava_path), **ENGINE, kv_transfer_config={
        "kv_connector": "CpuOffloadConnector",
        "kv_connector_extra_config": {"cpu_bytes": 1 << 20, "verify_loads": True}})
    connector = llm.scheduler.kv_connector
    assert _tokens(llm, _request(images[0]))[0] == plain[0]
    _tokens(llm, FILLER)
    assert connector.num_offloaded_blocks >= 4
    assert _tokens(llm, _request(images[1]))[0] == plain[1]
    assert connector.num_external_hit_tokens <= 4  # at most the text block before the image
    _tokens(llm, FILLER)
    hits = connector.num_external_hit_tokens
    assert _tokens(llm, _request(images[0]))[0] == plain[0]
    assert connector.num_external_hit_tokens - hits >= 16  # the image's blocks came back from the host
    assert llm.runner.kv_connector.verify_report()["mismatched"] == []


def test_shared_storage_keys_blocks_by_the_image(llava_path, images, plain, tmp_path):
    """A store holding image A's blocks: a prompt with image B and the same placeholder tokens misses them,
    a consumer asking for image A loads them."""
    from graphrunner.engine import LLM

    config = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    llm = LLM(str(llava_path), **ENGINE, kv_transfer_config=config)
    connector = llm.scheduler.kv_connector
    assert _tokens(llm, _request(images[0]))[0] == plain[0]
    assert llm.runner.kv_connector.num_saved_blocks == 7
    assert _tokens(llm, _request(images[1]))[0] == plain[1]
    assert connector.num_external_hit_tokens == 0  # block 0 is a local prefix-cache hit; the rest is B's own
    consumer = LLM(str(llava_path), **ENGINE, kv_transfer_config={**config, "kv_role": "kv_consumer"})
    tokens, cached = _tokens(consumer, _request(images[0]))
    assert tokens == plain[0] and cached == 27  # every prompt token but the last


def test_connectors_key_prompt_embeds_by_their_content(tmp_path):
    """Prompt embeddings fill their positions with one placeholder id: two of the same length share no block."""
    from graphrunner.engine import LLM

    args = dict(ENGINE, num_kv_blocks=64, enable_prompt_embeds=True)
    gen = torch.Generator().manual_seed(0)
    embeds = [{"prompt_embeds": torch.randn(20, 128, generator=gen)} for _ in range(2)]
    ref = LLM("builtin:tiny-llama", **args)
    plain = [_tokens(ref, e)[0] for e in embeds]
    llm = LLM("builtin:tiny-llama", **args, kv_transfer_config={
        "kv_connector": "SharedStorageConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    assert [_tokens(llm, e)[0] for e in embeds] == plain
    assert llm.scheduler.kv_connector.num_external_hit_tokens == 0
    consumer = LLM("builtin:tiny-llama", **args, kv_transfer_config={
        "kv_connector": "SharedStorageConnector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    assert _tokens(consumer, embeds[1]) == (plain[1], 19)  # the full block and 3 of the partial last one


def test_prefix_hashes_tell_content_hashes_from_token_ids():
    """Token-id blocks keep their names (stores written before stay valid); a block holding a content hash
    gets another name, whatever its characters, and the rest of the chain follows it."""
    import hashlib

    import numpy as np

    from graphrunner.kv_transfer import prefix_hashes

    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    first = hashlib.sha256(b"salt:0" + np.asarray(ids[:4], dtype=np.int64).tobytes()).hexdigest()
    assert prefix_hashes(ids, 2, 4)[0] == first
    digits = "1" * 64  # a content hash of digits only still differs from any token id
    keyed = [1, digits, digits, 4, 5, 6, 7, 8]
    named = prefix_hashes(keyed, 2, 4)
    assert named[0] != first and named[1] != prefix_hashes(ids, 2, 4)[1]
    assert named != prefix_hashes([1, "2" * 64, "2" * 64, 4, 5, 6, 7, 8], 2, 4)
    assert prefix_hashes(keyed, 2, 4, salt=1) != named
