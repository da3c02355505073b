"""bench offload (tools/bench/offload_bench.py) on a CPU: both engines run the multi-turn workload, the
offload engine serves more of the later turns' prompts from host memory, every block it loads back holds
the bytes offloaded for its prefix, and (fp32) their tokens are equal; a wrong load fails the run."""

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
    assert report["requests_tokens_equal"] == [12, 12] and report["kv_mismatched"] == []
    assert gpu["kv_verify"] is None and offload["kv_verify"]["checked"] * 16 == offload["external_hit_tokens"]
    # The GPU cache (10 blocks) cannot keep four histories of 3-4 blocks between turns; host memory can.
    assert offload["cached_fraction"] > gpu["cached_fraction"] + 0.3
    assert offload["external_hit_tokens"] > 0
    assert all(r["ttft_median_ms"] > 0 and r["ttft_p99_ms"] >= r["ttft_median_ms"] for r in (gpu, offload))
    table = (tmp_path / "offload.md").read_text()
    assert "| offload |" in table and "Requests with equal greedy tokens in both engines: 12 of 12" in table
    n = offload["kv_verify"]["checked"]
    assert f"offloaded for their prefix (offload, exact): {n} of {n}." in table


def test_a_load_into_the_wrong_blocks_fails_the_run(tmp_path, monkeypatch, capsys):
    """Loads scattered into each other's blocks (a misplaced copy) are caught by the exact check: exit 1
    with the mismatched prefixes named, whatever the tokens."""
    from graphrunner.kv_transfer import cpu_offload

    real = cpu_offload.scatter_blocks

    def misplaced(caches, block_ids, data):
        real(caches, list(block_ids)[::-1], data)

    monkeypatch.setattr(cpu_offload, "scatter_blocks", misplaced)
    out = tmp_path / "offload.json"
    assert main([*TINY, "--json", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["kv_mismatched"] and "MISMATCHED" in capsys.readouterr().out


def test_bad_options_are_named(capsys):
    assert main([*TINY, "--engines", "gpu,nope"]) == 2
    assert "--engines 'gpu,nope'" in capsys.readouterr().err
    assert main([*TINY, "--turns", "1"]) == 2
    assert "--turns 1: must be at least 2" in capsys.readouterr().err
