"""Qwen2.5-VL parity with transformers on the same random weights: the vision tower, the image
processor, M-RoPE positions, and greedy tokens for prompts with 0, 1 and 2 images of different sizes,
eagerly and from (CPU-emulated) graphs; an image shown by two requests is encoded once; bad inputs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from graphrunner import LLM, SamplingParams
from tests.multimodal.conftest import engine_requests, first_tokens, hf_greedy, small_llm

pytest.importorskip("PIL")

IMAGE_TOKEN, VISION_START, VISION_END = 600, 601, 602
MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
MIN_PIXELS, MAX_PIXELS = 28 * 28, 28 * 28 * 24
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def random_image(seed: int, width: int, height: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), mode="RGB")


# 60 x 90 px resizes to 56 x 84 (grid 4 x 6 patches: 6 tokens, windows of 2 x 2 blocks cut it unevenly);
# 140 x 112 px stays (grid 8 x 10: 20 tokens).
IMAGES = [random_image(1, 90, 60), random_image(2, 140, 112)]
PROMPTS = [  # (token ids with one placeholder per image, images)
    ([5, 6, 7, 8], []),
    ([5, VISION_START, IMAGE_TOKEN, VISION_END, 9, 10], [IMAGES[0]]),
    ([3, VISION_START, IMAGE_TOKEN, VISION_END, 4, VISION_START, IMAGE_TOKEN, VISION_END, 11], [IMAGES[1], IMAGES[0]]),
]


@torch.no_grad()
def make_qwen2_5_vl(path, seed: int = 0):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=640, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=2,
                         bos_token_id=1, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           window_size=56, fullatt_block_indexes=[1]),
        image_token_id=IMAGE_TOKEN, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    config._attn_implementation = "eager"
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        param.copy_(1.0 + 0.2 * noise if name.endswith(("norm.weight", "norm1.weight", "norm2.weight",
                                                        "ln_q.weight")) else 0.1 * noise)
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "resample": 3, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(MEAN), "image_std": list(STD),
        "do_convert_rgb": True, "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, "patch_size": 14,
        "temporal_patch_size": 2, "merge_size": 2}))
    return model


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    return path, make_qwen2_5_vl(path)


def hf_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
                                    image_mean=list(MEAN), image_std=list(STD))


def _expanded(ids: list[int], counts: list[int]) -> list[int]:
    out, k = [], 0
    for t in ids:
        if t == IMAGE_TOKEN:
            out += [t] * counts[k]
            k += 1
        else:
            out.append(t)
    return out


@torch.no_grad()
def _hf_greedy(hf, ids: list[int], images: list, n: int = 8) -> list[int]:
    kw = {}
    counts: list[int] = []
    if images:
        inputs = hf_processor()(images, return_tensors="pt")
        kw = dict(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
        counts = (inputs["image_grid_thw"].prod(-1) // 4).tolist()
    return hf_greedy(lambda x: hf(input_ids=x, mm_token_type_ids=(x == IMAGE_TOKEN).int(), **kw).logits,
                     _expanded(ids, counts), n)


@pytest.fixture(scope="module")
def expected(qwen):
    _, hf = qwen
    return [_hf_greedy(hf, ids, imgs) for ids, imgs in PROMPTS]




def test_processor_matches_transformers(qwen):
    from graphrunner.models.loader import load_model_config
    from graphrunner.multimodal.qwen2_vl_processor import Qwen2VLImageProcessor

    config = load_model_config(str(qwen[0]))
    proc = Qwen2VLImageProcessor.from_folder(qwen[0], config.vision)
    ref = hf_processor()(IMAGES, return_tensors="pt")
    ours = [proc(image) for image in IMAGES]
    assert torch.equal(torch.stack([o["image_grid_thw"] for o in ours]), ref["image_grid_thw"])
    assert ref["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 10]]
    assert torch.allclose(torch.cat([o["pixel_values"] for o in ours]), ref["pixel_values"].float(), atol=1e-5)
    assert config.vision.num_image_tokens == MAX_PIXELS // 28 ** 2


def test_vision_tower_matches_transformers(qwen):
    from graphrunner.attention.torch_ref import TorchReferenceBackend
    from graphrunner.models.loader import LoadConfig, load_model, load_model_config

    path, hf = qwen
    config = load_model_config(str(path))
    model = load_model(config, LoadConfig(model=str(path)), attn_backend=TorchReferenceBackend(), dtype="float32",
                       device="cpu")
    inputs = hf_processor()(IMAGES, return_tensors="pt")
    with torch.no_grad():
        ref = hf.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    ours = model.encode_mm_inputs([{"pixel_values": p, "image_grid_thw": g} for p, g in zip(
        inputs["pixel_values"].split([24, 80]), inputs["image_grid_thw"], strict=True)])
    assert [tuple(o.shape) for o in ours] == [(6, 64), (20, 64)]
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_mrope_positions_match_get_rope_index(qwen):
    from graphrunner.multimodal.features import MultiModalFeatureSpec, PlaceholderRange
    from graphrunner.multimodal.mrope import mrope_positions

    _, hf = qwen
    grids = torch.tensor([[1, 8, 10], [1, 4, 6]])
    ids = _expanded(PROMPTS[2][0], [20, 6])
    x = torch.tensor([ids])
    ref, ref_delta = hf.model.get_rope_index(x, (x == IMAGE_TOKEN).int(), image_grid_thw=grids)
    starts = [i for i, t in enumerate(ids) if t == IMAGE_TOKEN and ids[i - 1] != IMAGE_TOKEN]
    features = [MultiModalFeatureSpec({"image_grid_thw": g}, "image", str(k), PlaceholderRange(s, int(g.prod()) // 4))
                for k, (g, s) in enumerate(zip(grids, starts, strict=True))]
    positions, delta = mrope_positions(len(ids), features, merge=2)
    assert np.array_equal(positions, ref[:, 0].numpy()) and delta == int(ref_delta)
    text, zero = mrope_positions(5, [], merge=2)
    assert np.array_equal(text, np.tile(np.arange(5), (3, 1))) and zero == 0


@pytest.mark.parametrize("mode", ["NONE", "FULL_AND_PIECEWISE"])
def test_greedy_tokens_match_transformers_with_0_1_2_images(qwen, expected, mode):
    llm = small_llm(qwen[0], mode)
    assert first_tokens(llm.generate(engine_requests(PROMPTS), GREEDY, use_tqdm=False)) == expected
    cache = llm.runner.embeds.encoder_cache
    assert cache.num_encoded == 2  # IMAGES[0] shows in two requests of one step: encoded once
    again = llm.generate(engine_requests(PROMPTS), GREEDY, use_tqdm=False)
    assert first_tokens(again) == expected and cache.num_encoded == 2
    assert again[2].num_cached_tokens > 0  # prompt chunks start inside the prompt: staged from there
    if mode != "NONE":
        assert not llm.runner.last_descriptor.is_eager


def test_chunked_prompts_keep_positions(qwen, expected):
    """A 10-token budget cuts the prompts inside the images' placeholders; tokens are unchanged."""
    llm = small_llm(qwen[0], max_num_batched_tokens=10, max_num_seqs=2)
    assert first_tokens(llm.generate(engine_requests(PROMPTS), GREEDY, use_tqdm=False)) == expected


def test_bad_multimodal_input_raises(qwen, tmp_path):
    llm = small_llm(qwen[0])
    with pytest.raises(ValueError, match=r"2 image\(s\) given for 1 image placeholder"):
        llm.generate([{"prompt_token_ids": [5, IMAGE_TOKEN], "multi_modal_data": {"image": IMAGES}}], GREEDY,
                     use_tqdm=False)
    with pytest.raises(ValueError, match=r"or a run of its image's count \[6, 20\]"):
        llm.generate([{"prompt_token_ids": [5] + [IMAGE_TOKEN] * 5 + [9, IMAGE_TOKEN],
                       "multi_modal_data": {"image": IMAGES}}], GREEDY, use_tqdm=False)
    assert not llm.scheduler.has_unfinished_requests()
    text_only = LLM("builtin:tiny-llama", device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16,
                    enforce_eager=True)
    assert text_only.runner.buffers.mrope is None  # one position per token: no M-RoPE buffers, no fill
    with pytest.raises(ValueError, match="is text-only"):
        text_only.generate([{"prompt_token_ids": [5, 6], "multi_modal_data": {"image": IMAGES[0]}}], GREEDY)


def test_config_errors_name_the_field(qwen, tmp_path):
    from graphrunner.models.loader import CheckpointError, load_model_config

    raw = json.loads((qwen[0] / "config.json").read_text())
    cases = [
        (("text_config", "rope_parameters", "mrope_section"), [2, 3, 4], r"mrope_section=\[2, 3, 4\]"),
        (("vision_config", "depth"), 0, r"vision_config.depth=0 must be an int >= 1"),
        (("vision_config", "fullatt_block_indexes"), [3], r"vision_config.fullatt_block_indexes=\[3\]"),
        (("vision_config", "out_hidden_size"), 32, r"out_hidden_size=32 must be the decoder's hidden_size=64"),
        (("vision_config", "num_heads"), 3, r"vision_config.num_heads=3"),
        (("image_token_id",), "x", r"image_token_id='x' must be an int >= 0"),
    ]
    for keys, value, message in cases:
        bad = json.loads(json.dumps(raw))
        node = bad
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
        (tmp_path / "config.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match="config.json.*" + message):
            load_model_config(str(tmp_path))


def test_older_checkpoint_layout_loads(qwen, tmp_path):
    """The Hub's Qwen2.5-VL folders name tensors `model.*` / `visual.*`: the same model loads."""
    from safetensors.torch import load_file, save_file

    from graphrunner.attention.torch_ref import TorchReferenceBackend
    from graphrunner.models.loader import LoadConfig, load_model, load_model_config

    path = qwen[0]
    tensors = load_file(str(path / "model.safetensors"))
    renamed = {k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
               for k, v in tensors.items()}
    save_file(renamed, str(tmp_path / "model.safetensors"))
    for name in ("config.json", "preprocessor_config.json"):
        (tmp_path / name).write_text((path / name).read_text())
    models = [load_model(load_model_config(str(p)), LoadConfig(model=str(p)), attn_backend=TorchReferenceBackend(),
                         dtype="float32", device="cpu") for p in (path, tmp_path)]
    a, b = (dict(m.named_parameters()) for m in models)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_builtin_shape_builds():
    from graphrunner.models.registry import get_builtin

    config = get_builtin("builtin:qwen2.5-vl-7b")
    assert config.vision.num_image_tokens == 16384 and config.rope_scaling["mrope_section"] == [16, 24, 24]
    assert 8.0e9 < config.num_params() < 8.6e9  # Qwen2.5-VL-7B: 8.29B parameters


@pytest.mark.gpu
def test_gpu_qwen2_5_vl_matches_transformers_from_cuda_graphs(qwen, expected):
    """CUDA, fp32: decoder from real FULL / PIECEWISE graphs (M-RoPE positions filled inside them), the
    vision tower eager; same tokens as transformers on the CPU."""
    llm = LLM(str(qwen[0]), device="cuda", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
              max_model_len=128, block_size=16, num_kv_blocks=32)
    assert first_tokens(llm.generate(engine_requests(PROMPTS), GREEDY, use_tqdm=False)) == expected
    assert not llm.runner.last_descriptor.is_eager
    assert llm.runner.embeds.encoder_cache.num_encoded == 2
    llm.shutdown()
