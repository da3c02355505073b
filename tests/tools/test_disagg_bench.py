"""disagg_bench (tools/bench/disagg_bench.py): both layouts' process pairs on CPU over gloo.

The benchmark's figures come from two GPUs (docs/kv_transfer.md); here its plumbing is checked:
each layout's two processes serve every request its tokens, the ITL and TTFT figures are finite,
the decode instance of the disaggregated layout loads its prompts' blocks instead of computing
them, and bad options are refused with the value before anything starts.
"""

from __future__ import annotations

import json
import math

import pytest

from graphrunner.cli import main as cli_main
from graphrunner_tools.bench.disagg_bench import ITL_TARGET, main, markdown, target_line

LONG, SHORT = 48, 20


def _loadable(prompt_len: int) -> int:
    """Every prompt token but the last (which is always computed)."""
    return prompt_len - 1


def test_both_layouts_on_cpu_report_finite_latencies_and_loaded_prompts(tmp_path) -> None:
    status = main(["--out", str(tmp_path), "--device", "cpu", "--model", "builtin:tiny-llama", "--num-requests", "4",
                   "--long-len", str(LONG), "--short-len", str(SHORT), "--output-len", "5", "--num-kv-blocks", "64",
                   "--cudagraph-mode", "NONE", "--timeout", "120"])
    assert status == 0
    data = json.loads((tmp_path / "disagg_bench.json").read_text())
    assert data["target_itl_p99_over_median"] == ITL_TARGET
    colocated, disagg = data["layouts"]
    assert (colocated["layout"], disagg["layout"]) == ("colocated", "disagg")
    for r in (colocated, disagg):
        assert r["status"] == 0 and r["requests"] == 4 and r["output_tokens"] == r["expected_output_tokens"] == 20
        for key in ("itl_median_ms", "itl_p99_ms", "ttft_median_ms", "ttft_p99_ms", "output_tokens_per_s"):
            assert math.isfinite(r[key]) and r[key] > 0, key
        assert r["itl_p99_ms"] >= r["itl_median_ms"]
    assert colocated["cached_fraction"] == 0.0
    assert disagg["cached_fraction"] == pytest.approx((_loadable(LONG) + _loadable(SHORT)) / (LONG + SHORT))
    assert disagg["sent_blocks"] > 0 and disagg["dropped_blocks"] == 0
    text = (tmp_path / "disagg_bench.md").read_text()
    assert "| disagg |" in text and f"Target: disagg p99 ITL <= {ITL_TARGET}x its median" in text
    for r in (colocated, disagg):  # the tail's steps, slowest first, each named by its descriptor
        durations = [step[0] for step in r["slowest_steps"]]
        assert durations and durations == sorted(durations, reverse=True)
        # each step's own execute_model calls, host ms, within the step; no device time on a CPU
        assert all(0 <= step[4] <= 1e3 * step[0] and step[5] is None for step in r["slowest_steps"])
        assert any(step[4] > 0 for step in r["slowest_steps"])
        assert f"{r['layout']} slow step: {durations[0] * 1e3:.1f} ms" in text
        # the ms of each step during which blocks arrived: none without a link
        assert all(0 <= step[6] <= 1e3 * step[0] for step in r["slowest_steps"])
    assert not colocated["steps_receiving"]
    [[(beside, _), (alone, _)]] = disagg["steps_receiving"]
    assert beside + alone > 0
    if beside:
        assert "steps ran while blocks arrived" in text


def test_a_missing_layout_or_gpu_is_named_in_the_table() -> None:
    class Args:
        model, num_requests, long_len, short_len, output_len, request_rate, device = "m", 4, 8, 4, 2, math.inf, "cuda"

    text = markdown([{"layout": "colocated", "skipped": "needs 2 GPUs, found 0"}, {"layout": "disagg", "status": 124}],
                    Args())  # type: ignore[arg-type]
    assert "needs 2 GPUs, found 0" in text and "FAILED (status 124)" in text
    assert target_line([{"layout": "disagg", "itl_p99_over_median": 1.2}]).endswith("(1.20x: met).")


@pytest.mark.parametrize("argv,message", [
    (["--layouts", "colocated,offload"], "--layouts='colocated,offload'"),
    (["--num-requests", "1"], "--num-requests=1 must be >= 2"),
    (["--output-len", "0"], "--output-len=0 must be >= 1"),
    (["--request-rate", "0"], "--request-rate=0.0 must be > 0"),
])
def test_bad_options_are_refused_by_the_bench_command(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        cli_main(["bench", "disagg", "--device", "cpu", *argv])
