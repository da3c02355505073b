"""A tiny random LLaVA (CLIP tower 28 px / 7 px patches: 16 image tokens, Llama decoder) saved with
a `preprocessor_config.json` written here, and the reference preprocessing computed independently."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

IMAGE_TOKEN = 600
IMAGE_SIZE = 28
MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)


def engine_requests(prompts) -> list[dict]:
    """vLLM-style prompt dicts of (token ids, images) pairs: images under multi_modal_data when any."""
    return [{"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}} if imgs else {"prompt_token_ids": ids}
            for ids, imgs in prompts]


def small_llm(path, mode: str = "NONE", **kw):
    """An fp32 CPU engine over a tiny checkpoint folder: eager, or `mode`'s graphs with the eager backend."""
    from graphrunner import LLM

    args = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                block_size=4, num_kv_blocks=128)
    args.update(kw)
    if mode == "NONE":
        return LLM(str(path), enforce_eager=True, **args)
    return LLM(str(path), enforce_eager=False, cudagraph_mode=mode, compile_backend="eager",
               cudagraph_capture_sizes=(1, 2, 4, 8, 16, 32, 64), debug_cudagraphs=True, **args)


@torch.no_grad()
def hf_greedy(step, ids: list[int], n: int = 8) -> list[int]:
    """`n` greedy tokens after the expanded prompt `ids`; `step(x)` is a transformers model's logits for
    the token ids x [1, L] (its image inputs bound in)."""
    x = torch.tensor([ids])
    out = []
    for _ in range(n):
        token = step(x)[0, -1].argmax()
        out.append(int(token))
        x = torch.cat([x, token.view(1, 1)], dim=1)
    return out


def first_tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@torch.no_grad()
def make_llava(path, seed: int = 0):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=7, projection_dim=16)
    text = LlamaConfig(vocab_size=640, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=2,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    config._attn_implementation = "eager"
    model = LlavaForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        is_norm = name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "layrnorm.weight"))
        param.copy_(1.0 + 0.2 * noise if is_norm else 0.1 * noise)
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": IMAGE_SIZE},
        "resample": 3, "do_center_crop": True, "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(MEAN),
        "image_std": list(STD), "do_convert_rgb": True}))
    return model


def random_image(seed: int, size: int = IMAGE_SIZE):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), mode="RGB")


def reference_pixels(image) -> torch.Tensor:
    """An image already at the crop size, normalised as the config says: [3, S, S] float32."""
    x = np.asarray(image, dtype=np.float32) / 255.0
    x = (x - np.asarray(MEAN, dtype=np.float32)) / np.asarray(STD, dtype=np.float32)
    return torch.from_numpy(x.transpose(2, 0, 1).copy())


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    pytest.importorskip("PIL")
    path = tmp_path_factory.mktemp("llava")
    return path, make_llava(path)
