"""`graphrunner bench serve` on a CPU: the in-process server under a short Poisson load, beside offline generate."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("graphrunner.runner")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from graphrunner.cli import main  # noqa: E402
from graphrunner_tools.bench.serve_load import parse_rates  # noqa: E402


def test_bench_serve_reports_every_rate_and_the_offline_ratio(tmp_path, capsys):
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--model", "builtin:tiny-llama", "--device", "cpu", "--request-rate", "50,inf",
               "--num-prompts", "6", "--prompt-len", "8", "--max-tokens", "4", "--max-num-seqs", "4",
               "--max-num-batched-tokens", "64", "--max-model-len", "32", "--num-kv-blocks", "32",
               "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert [r["request_rate"] for r in data["rates"]] == [50.0, "inf"]
    for row in data["rates"]:
        assert row["completed"] == 6 and row["failed"] == 0 and row["output_tokens"] == 6 * 4
        assert 0 < row["ttft_ms_p50"] <= row["ttft_ms_p99"] and row["itl_ms_p50"] > 0
    assert data["offline"]["output_tokens"] == 24
    assert data["served_vs_offline"] == pytest.approx(data["rates"][1]["output_tokens_per_s"]
                                                      / data["offline"]["output_tokens_per_s"])
    table = capsys.readouterr().out
    assert "TTFT p50" in table and "served at the highest rate / offline" in table


def test_bad_rates_are_refused():
    assert parse_rates("4, 16,inf")[-1] == float("inf")
    with pytest.raises(SystemExit, match="'fast' is not a number"):
        parse_rates("4,fast")
    with pytest.raises(SystemExit, match="rates must be > 0"):
        parse_rates("0")
