"""The sampler benchmark runs on CPU with tiny sizes and returns well-formed rows."""

import json

from graphrunner_tools.bench.sampler_bench import VARIANTS, bench_sampler, main


def test_bench_sampler_rows_on_cpu():
    rows = bench_sampler("cpu", num_reqs=(1, 3), vocab=64, iters=2, warmup=1, max_model_len=16)
    # greedy: one filter column; sampled / all / all_on: bisect and sort. CPU: eager only.
    assert len(rows) == 2 * (1 + 2 + 2 + 2)
    keys = {"num_reqs", "vocab", "max_model_len", "variant", "filter", "mode", "device", "median_us", "mean_us",
            "min_us", "iters", "graph_pool_mib", "copy_gbps", "limit_us", "ratio"}
    for r in rows:
        assert set(r) == keys
        assert r["mode"] == "eager" and r["device"] == "cpu" and r["variant"] in VARIANTS
        assert r["median_us"] > 0 and r["min_us"] <= r["median_us"]
        assert r["copy_gbps"] > 0 and abs(r["limit_us"] * r["copy_gbps"] * 1e3 / (r["num_reqs"] * 64 * 4) - 1) < 1e-9
        assert abs(r["ratio"] - r["median_us"] / r["limit_us"]) < 1e-9
    assert {(r["num_reqs"], r["variant"]) for r in rows} == {(n, v) for n in (1, 3) for v in VARIANTS}


def test_bench_main_writes_json(tmp_path, capsys):
    path = tmp_path / "s.json"
    assert main(["--device", "cpu", "--num-reqs", "2", "--vocab", "32", "--iters", "1", "--max-model-len", "8",
                 "--filters", "bisect", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "| reqs | variant |" in printed and "read limit µs | × limit" in printed
    rows = json.loads(path.read_text())
    assert [r["variant"] for r in rows] == list(VARIANTS)
