"""`graphrunner bench host` on CPU: structure of the outputs, never golden numbers."""

from __future__ import annotations

import json

import pytest

from graphrunner.cli import main
from graphrunner_tools.bench.host_overhead import HostSpec


def test_bench_host_writes_one_row_per_scheduling_and_batch(tmp_path):
    out, md = tmp_path / "host.json", tmp_path / "host.md"
    assert main(["bench", "host", "--model", "builtin:tiny-llama", "--device", "cpu", "--batch-sizes", "1,2",
                 "--context", "4", "--steps", "2", "--warmup", "1", "--json", str(out), "--markdown", str(md)]) == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "host" and data["error"] is None and data["resolved_mode"] == "FULL"
    assert sorted((r["scheduling"], r["batch_size"]) for r in data["rows"]) == [
        ("async", 1), ("async", 2), ("sync", 1), ("sync", 2)]
    for r in data["rows"]:
        assert 0 < r["host_us"] <= r["host_p90_us"] and r["step_us"] >= r["host_us"] * 0.99
        assert r["engine_host_us"] > 0 and r["gpu_us"] is None  # no CUDA events on a CPU
        assert r["descriptor"] == f"FULL(t={r['batch_size']},r={r['batch_size']})"
    assert "| async | 2 |" in md.read_text()


@pytest.mark.parametrize("kwargs, needle", [
    (dict(batch_sizes=()), "batch_sizes"), (dict(schedulings=("later",)), "schedulings"),
    (dict(steps=0), "steps=0"), (dict(warmup=-1), "warmup=-1"),
])
def test_host_spec_rejects_bad_values(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        HostSpec(**kwargs)


def test_bench_host_noop_step_measures_the_host_path(tmp_path):
    out = tmp_path / "host.json"
    assert main(["bench", "host", "--model", "builtin:tiny-llama", "--device", "cpu", "--batch-sizes", "4",
                 "--context", "4", "--steps", "3", "--warmup", "1", "--schedulings", "async", "--noop-step",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["spec"]["noop_step"] is True and [r["scheduling"] for r in data["rows"]] == ["async"]


def test_bench_host_bad_mode_exits_with_a_message():
    with pytest.raises(SystemExit, match="bench host"):
        main(["bench", "host", "--device", "cpu", "--mode", "SIDEWAYS"])
