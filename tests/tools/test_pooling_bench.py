"""CPU smoke test of `graphrunner bench throughput --runner pooling` (the device run uses 1,024
prompts of 256 tokens on builtin:qwen3-0.6b; here a tiny model, a few prompts)."""

from __future__ import annotations

import json

from graphrunner.cli import main


def test_pooling_throughput_reports_both_rates(tmp_path, capsys):
    out = tmp_path / "pool.json"
    argv = ["bench", "throughput", "--runner", "pooling", "--model", "builtin:tiny-llama", "--device", "cpu",
            "--num-prompts", "3", "--input-len", "6", "--mode", "FULL", "--max-num-seqs", "2",
            "--max-num-batched-tokens", "32", "--compile-backend", "eager", "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["prompt_tokens"] == 18 and data["spec"]["mode"] == "FULL"
    assert data["pooling_tokens_per_s"] > 0 and data["prefill_tokens_per_s"] > 0
    assert "generative prefill" in capsys.readouterr().out
