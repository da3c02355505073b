"""LLaVA parity with transformers on the same weights: greedy tokens for prompts with 0, 1 and 2
images, eagerly and from graphs; each image content encoded once however many requests show it;
chunks that stop inside (or before) an image; prefix caching keyed by the image; bad inputs."""

from __future__ import annotations

import pytest
import torch

from graphrunner import LLM, SamplingParams
from tests.multimodal.conftest import (
    IMAGE_TOKEN,
    engine_requests,
    first_tokens,
    hf_greedy,
    random_image,
    reference_pixels,
    small_llm,
)

pytest.importorskip("PIL")

N = 16  # image tokens: (28 / 7)² patches, the class token dropped
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
IMAGES = [random_image(1), random_image(2)]
PROMPTS = [  # (token ids with one placeholder per image, images)
    ([5, 6, 7, 8], []),
    ([5, IMAGE_TOKEN, 9, 10], [IMAGES[0]]),
    ([3, IMAGE_TOKEN, 4, IMAGE_TOKEN, 11], IMAGES),
]


def _expanded(ids: list[int]) -> list[int]:
    return [u for t in ids for u in ([t] * N if t == IMAGE_TOKEN else [t])]


@torch.no_grad()
def _hf_greedy(hf, ids: list[int], images: list, n: int = 8) -> list[int]:
    pixels = torch.stack([reference_pixels(i) for i in images]) if images else None
    return hf_greedy(lambda x: hf(input_ids=x, pixel_values=pixels).logits, _expanded(ids), n)


@pytest.fixture(scope="module")
def expected(llava):
    _, hf = llava
    return [_hf_greedy(hf, ids, imgs) for ids, imgs in PROMPTS]




@pytest.mark.parametrize("mode", ["NONE", "FULL_AND_PIECEWISE"])
def test_greedy_tokens_match_transformers_with_0_1_2_images(llava, expected, mode):
    llm = small_llm(llava[0], mode)
    assert first_tokens(llm.generate(engine_requests(PROMPTS), GREEDY, use_tqdm=False)) == expected
    cache = llm.runner.embeds.encoder_cache
    assert cache.num_encoded == 2  # IMAGES[0] shows in two requests of one step: encoded once
    # The same images in a later call come from the encoder cache, and their blocks from the prefix cache.
    again = llm.generate(engine_requests(PROMPTS), GREEDY, use_tqdm=False)
    assert first_tokens(again) == expected and cache.num_encoded == 2
    assert again[1].num_cached_tokens > 0
    if mode != "NONE":
        assert not llm.runner.last_descriptor.is_eager


def test_chunks_inside_and_before_images(llava, expected):
    """A 12-token budget cuts prompts inside the placeholders; an encoder budget of one image (16
    tokens) per step makes the two-image prompt wait for its second image; tokens are unchanged."""
    llm = small_llm(llava[0], max_num_batched_tokens=12, max_num_seqs=2)
    assert llm.scheduler.encoder.budget == N
    assert first_tokens(llm.generate(engine_requests(PROMPTS), GREEDY, use_tqdm=False)) == expected
    assert llm.runner.embeds.encoder_cache.num_encoded == 2


def test_prefix_cache_tells_images_apart(llava):
    llm = small_llm(llava[0])
    a = {"prompt_token_ids": [5, IMAGE_TOKEN, 9, 10], "multi_modal_data": {"image": IMAGES[0]}}
    b = {"prompt_token_ids": [5, IMAGE_TOKEN, 9, 10], "multi_modal_data": {"image": IMAGES[1]}}
    first = llm.generate([a], GREEDY, use_tqdm=False)[0]
    other = llm.generate([b], GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0 and other.outputs[0].token_ids != first.outputs[0].token_ids
    same = llm.generate([a], GREEDY, use_tqdm=False)[0]
    assert same.num_cached_tokens > 0 and same.outputs[0].token_ids == first.outputs[0].token_ids


def test_processor_reads_the_checkpoint_config(llava):
    from graphrunner.models.loader import load_model_config
    from graphrunner.multimodal.processor import ImageProcessor

    config = load_model_config(str(llava[0]))
    assert config.vision is not None and config.vision.num_image_tokens == N
    proc = ImageProcessor.from_folder(llava[0], config.vision.image_size)
    pixels = proc(IMAGES[0])
    assert torch.allclose(pixels, reference_pixels(IMAGES[0]), atol=1e-6)
    chw = torch.from_numpy(__import__("numpy").asarray(IMAGES[0]).copy()).permute(2, 0, 1)  # uint8 [3, H, W]
    assert torch.equal(proc(chw), pixels)
    assert proc(random_image(3, size=40)).shape == (3, 28, 28)  # resized on the short edge, then cropped


def test_bad_multimodal_input_raises_and_leaves_others_alone(llava, expected):
    llm = small_llm(llava[0])
    good = engine_requests(PROMPTS)
    with pytest.raises(ValueError, match=r"2 image\(s\) given for 1 image placeholder"):
        llm.generate([good[0], {"prompt_token_ids": [5, IMAGE_TOKEN], "multi_modal_data": {"image": IMAGES}}],
                     GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"multi_modal_data keys \['audio'\] are not supported"):
        llm.generate([{"prompt_token_ids": [5], "multi_modal_data": {"image": [], "audio": 1}}], GREEDY)
    with pytest.raises(ValueError, match=r"image tensor must be \[3, H, W\] or \[H, W, 3\]"):
        llm.generate([{"prompt_token_ids": [IMAGE_TOKEN], "multi_modal_data": {"image": torch.zeros(2, 5)}}], GREEDY)
    assert not llm.scheduler.has_unfinished_requests()
    assert first_tokens(llm.generate(good, GREEDY, use_tqdm=False)) == expected
    with pytest.raises(ValueError, match="vision-language model"):
        LLM(str(llava[0]), runner="pooling", device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16)


@pytest.mark.gpu
def test_gpu_llava_matches_transformers_from_cuda_graphs(llava, expected):
    """CUDA, fp32: decoder from real FULL / PIECEWISE graphs, the vision tower eager; same tokens."""
    llm = LLM(str(llava[0]), device="cuda", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
              max_model_len=128, block_size=16, num_kv_blocks=32)
    assert first_tokens(llm.generate(engine_requests(PROMPTS), GREEDY, use_tqdm=False)) == expected
    assert llm.runner.embeds.encoder_cache.num_encoded == 2
    llm.shutdown()
