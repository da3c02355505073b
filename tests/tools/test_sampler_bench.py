"""The sampler benchmark runs on CPU with tiny sizes and returns well-formed rows."""

import json

import pytest
import torch

from graphrunner_tools.bench.sampler_bench import VARIANTS, bench_sampler, main


def test_bench_sampler_rows_on_cpu():
    rows = bench_sampler("cpu", num_reqs=(1, 3), vocab=64, iters=2, warmup=1, max_model_len=16)
    assert len(rows) == 2 * len(VARIANTS)  # CPU: eager only
    keys = {"num_reqs", "vocab", "max_model_len", "variant", "mode", "device", "median_us", "mean_us",
            "min_us", "iters", "graph_pool_mib", "in_graph_us", "copy_gbps", "limit_us", "ratio"}
    for r in rows:
        assert set(r) == keys
        assert r["mode"] == "eager" and r["device"] == "cpu" and r["variant"] in VARIANTS
        assert r["in_graph_us"] is None  # graphs (and the in-graph time) only on CUDA
        assert r["median_us"] > 0 and r["min_us"] <= r["median_us"]
        assert r["copy_gbps"] > 0 and abs(r["limit_us"] * r["copy_gbps"] * 1e3 / (r["num_reqs"] * 64 * 4) - 1) < 1e-9
        assert abs(r["ratio"] - r["median_us"] / r["limit_us"]) < 1e-9
    assert {(r["num_reqs"], r["variant"]) for r in rows} == {(n, v) for n in (1, 3) for v in VARIANTS}


def test_bench_main_writes_json(tmp_path, capsys):
    path = tmp_path / "s.json"
    assert main(["--device", "cpu", "--num-reqs", "2", "--vocab", "32", "--iters", "1", "--max-model-len", "8",
                 "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "| reqs | variant |" in printed and "read limit µs | × limit" in printed
    rows = json.loads(path.read_text())
    assert [r["variant"] for r in rows] == list(VARIANTS)


@pytest.mark.gpu
def test_gpu_graph_rows_carry_the_in_graph_time():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    with torch.inference_mode():
        rows = bench_sampler("cuda", num_reqs=(4,), vocab=4096, iters=3, warmup=1, max_model_len=64,
                             variants=("greedy", "all_on"), graph_calls=3)
    graph_rows = [r for r in rows if r["mode"] == "graph"]
    assert len(graph_rows) == 2 and all(r["in_graph_us"] > 0 for r in graph_rows)
    assert all(r["in_graph_us"] is None for r in rows if r["mode"] == "eager")
