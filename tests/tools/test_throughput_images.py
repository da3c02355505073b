"""bench throughput with images (tools/bench/throughput.py) on a CPU: each prompt's images come from a
pool, the vision tower encodes each distinct image once per timed run (the encoder cache serves the
rest), the input tokens count the images' placeholder rows, and a text-only model is refused."""

from __future__ import annotations

import pytest

from graphrunner_tools.bench.throughput import ThroughputSpec, run_throughput

TINY = dict(model="builtin:tiny-llava", device="cpu", num_prompts=8, input_len=8, output_len=4, max_num_seqs=8,
            num_kv_blocks=64, mode="NONE", copy_bytes=1 << 20)


@pytest.mark.parametrize("distinct, encoded", [(2, 2), (None, 8)])
def test_each_distinct_image_is_encoded_once(distinct, encoded):
    result = run_throughput(ThroughputSpec(**TINY, images=1, distinct_images=distinct))
    assert result.images_encoded == encoded
    assert result.encoder_hit_rate == pytest.approx(1 - encoded / 8)
    assert result.input_tokens == 8 * (8 + 16)  # 16 placeholder rows per 32 px image in 8 px patches
    assert result.output_tokens == 8 * 4 and result.ttft_median_ms > 0


def test_images_for_a_text_only_model_are_refused():
    with pytest.raises(ValueError, match="builtin:tiny-llama' is a text-only model"):
        run_throughput(ThroughputSpec(**{**TINY, "model": "builtin:tiny-llama"}, images=1))
