"""bench offload (tools/bench/offload_bench.py) on a CPU: both engines run the multi-turn workload, the
offload engine serves more of the later turns' prompts from host memory, and their tokens are equal."""

from __future__ import annotations

import json

from graphrunner_tools.bench.offload_bench import main

TINY = ["--device", "cpu", "--model", "builtin:tiny-llama", "--conversations", "4", "--turns", "3", "--first-len", "40",
        "--turn-len", "8", "--output-len", "4", "--num-kv-blocks", "10", "--max-num-seqs", "2",
        "--max-num-batched-tokens", "64", "--cpu-gib", "0.01", "--cudagraph-mode", "NONE"]


def test_offload_serves_evicted_histories_with_equal_tokens(tmp_path):
    out = tmp_path / "offload.json"
    assert main([*TINY, "--json", str(out), "--markdown", str(tmp_path / "offload.md")]) == 0
    report = json.loads(out.read_text())
    gpu, offload = report["results"]
    assert (gpu["engine"], offload["engine"]) == ("gpu", "offload") and report["tokens_equal"] is True
    # The GPU cache (10 blocks) cannot keep four histories of 3-4 blocks between turns; host memory can.
    assert offload["cached_fraction"] > gpu["cached_fraction"] + 0.3
    assert offload["external_hit_tokens"] > 0
    assert all(r["ttft_median_ms"] > 0 and r["ttft_p99_ms"] >= r["ttft_median_ms"] for r in (gpu, offload))
    assert "| offload |" in (tmp_path / "offload.md").read_text()


def test_bad_options_are_named(capsys):
    assert main([*TINY, "--engines", "gpu,nope"]) == 2
    assert "--engines 'gpu,nope'" in capsys.readouterr().err
    assert main([*TINY, "--turns", "1"]) == 2
    assert "--turns 1: must be at least 2" in capsys.readouterr().err
