"""bench throughput with images (tools/bench/throughput.py) on a CPU: each prompt's images come from a
pool, the vision tower encodes each distinct image once per timed run (the encoder cache serves the
rest), the input tokens count the images' placeholder rows, Qwen2.5-VL's images get a fixed size and
the count its processor makes of it, and a text-only model is refused."""

from __future__ import annotations

import pytest

from graphrunner_tools.bench.throughput import ThroughputSpec, _image_geometry, run_throughput

TINY = dict(model="builtin:tiny-llava", device="cpu", num_prompts=8, input_len=8, output_len=4, max_num_seqs=8,
            num_kv_blocks=64, mode="NONE", copy_bytes=1 << 20)


@pytest.mark.parametrize("distinct, encoded", [(2, 2), (None, 8)])
def test_each_distinct_image_is_encoded_once(distinct, encoded):
    result = run_throughput(ThroughputSpec(**TINY, images=1, distinct_images=distinct))
    assert result.images_encoded == encoded
    assert result.encoder_hit_rate == pytest.approx(1 - encoded / 8)
    assert result.input_tokens == 8 * (8 + 16)  # 16 placeholder rows per 32 px image in 8 px patches
    assert result.output_tokens == 8 * 4 and result.ttft_median_ms > 0
    assert (result.image_tokens, result.image_size) == (16, 32)


def test_two_images_a_prompt():
    """Each image gets a placeholder of its own (adjacent ones would read as one image's run)."""
    result = run_throughput(ThroughputSpec(**{**TINY, "num_prompts": 4}, images=2))
    assert result.images_encoded == 8 and result.input_tokens == 4 * (8 + 2 * 16)
    with pytest.raises(ValueError, match="at least 2 tokens; input_len=1"):
        ThroughputSpec(**{**TINY, "input_len": 1}, images=3)


def test_images_for_a_text_only_model_are_refused():
    with pytest.raises(ValueError, match="builtin:tiny-llama' is a text-only model"):
        run_throughput(ThroughputSpec(**{**TINY, "model": "builtin:tiny-llama"}, images=1))


def test_qwen2_5_vl_7b_images_are_336_px_squares_of_144_tokens():
    """LLaVA-1.5's pixels per image: 336 px stays 336 (a multiple of 28), a 24 x 24 grid merged 2 x 2."""
    assert _image_geometry(ThroughputSpec(model="builtin:qwen2.5-vl-7b", images=1)) == (336, 144)
    assert _image_geometry(ThroughputSpec(model="builtin:qwen2.5-vl-7b", images=1, image_size=448)) == (448, 256)
    assert _image_geometry(ThroughputSpec(model="builtin:llava-1.5-7b", images=1)) == (336, 576)


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    pytest.importorskip("PIL")
    from tests.multimodal.test_qwen2_5_vl import make_qwen2_5_vl

    path = tmp_path_factory.mktemp("qwen2_5_vl")
    make_qwen2_5_vl(path)
    return str(path)


@pytest.mark.parametrize("image_size, tokens", [(None, 16), (56, 4)])
def test_qwen2_5_vl_images(tiny_qwen, image_size, tokens):
    """A tiny Qwen2.5-VL folder (max_pixels 28² x 24): the default 336 px shrinks to 112 px (16 tokens),
    56 px stays (4 tokens); the bench counts what the engine's processor makes of them."""
    spec = ThroughputSpec(**{**TINY, "model": tiny_qwen, "num_prompts": 4, "output_len": 2}, images=2,
                          distinct_images=3, image_size=image_size)
    result = run_throughput(spec)
    assert (result.image_size, result.image_tokens) == (image_size or 336, tokens)
    assert result.input_tokens == 4 * (8 + 2 * tokens)
    assert result.images_encoded == 3 and result.output_tokens == 4 * 2


def test_cli_image_size_and_tokens_per_image(tiny_qwen, tmp_path, capsys):
    import json

    from graphrunner.cli import main

    out = tmp_path / "tp.json"
    argv = ["bench", "throughput", "--model", tiny_qwen, "--device", "cpu", "--num-prompts", "2", "--input-len", "4",
            "--output-len", "2", "--mode", "NONE", "--num-kv-blocks", "64", "--images", "1", "--image-size", "56",
            "--copy-mib", "1", "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["spec"]["image_size"] == data["image_size"] == 56 and data["image_tokens"] == 4
    assert data["input_tokens"] == 2 * (4 + 4)
    assert "1 a prompt of 56 px, 4 tokens each" in capsys.readouterr().out
