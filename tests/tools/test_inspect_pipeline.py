"""`inspect simulate -pp P`: the pipeline model's invariants over arbitrary step times, and the CLI.

The model (graphrunner_tools.inspect.pipeline): a step's work splits evenly over P stages;
the synchronous schedule keeps one batch in flight, the pipelined one up to P. Checked
against bounds and closed forms, never golden numbers.
"""

from __future__ import annotations

import contextlib
import io
import json
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphrunner.cli import main
from graphrunner_tools.inspect.pipeline import pipelined, simulate_pipeline, synchronous

step_tokens = st.lists(st.integers(1, 4096), min_size=1, max_size=200)
pp_sizes = st.integers(1, 16)
overheads = st.integers(0, 256)


@given(step_tokens, pp_sizes, overheads)
def test_bubble_fractions_lie_in_zero_to_one(tokens, p, overhead):
    result = simulate_pipeline(tokens, p, overhead)
    for schedule in (result.sync, result.piped):
        assert 0 <= schedule.bubble_fraction < 1


@given(step_tokens, pp_sizes)
def test_synchronous_bubble_is_p_minus_one_over_p_without_overhead(tokens, p):
    sync = simulate_pipeline(tokens, p, 0).sync
    assert sync.bubble == Fraction(p - 1, p)
    assert sync.bubble_fraction == (p - 1) / p
    assert sync.makespan_tokens == sum(tokens)


@given(step_tokens, pp_sizes, overheads)
def test_pipelined_makespan_lies_between_the_busiest_stage_and_synchronous(tokens, p, overhead):
    result = simulate_pipeline(tokens, p, overhead)
    work = [n + overhead for n in tokens]
    piped = result.piped.makespan_tokens
    assert sum(work) / p <= piped <= result.sync.makespan_tokens
    assert result.speedup >= 1
    # The FIFO bound (at most P batches in flight) only ever delays: the bare recurrence is a lower bound.
    assert pipelined(work, p, bounded=False).makespan_units <= result.piped.makespan_units


@given(st.integers(1, 4096), st.integers(1, 200), pp_sizes)
def test_equal_steps_give_the_closed_form_bubble(tokens, n, p):
    piped = simulate_pipeline([tokens] * n, p).piped
    assert piped.bubble == Fraction(p - 1, n + p - 1)
    assert piped.bubble_fraction == (p - 1) / (n + p - 1)
    assert piped.makespan_units == (n + p - 1) * tokens


@given(step_tokens, overheads)
def test_one_stage_has_no_bubble(tokens, overhead):
    result = simulate_pipeline(tokens, 1, overhead)
    assert result.sync.bubble == result.piped.bubble == 0
    assert result.speedup == 1


@given(step_tokens, pp_sizes)
def test_the_schedules_do_the_same_work(tokens, p):
    assert synchronous(tokens, p).busy_units == pipelined(tokens, p).busy_units == p * sum(tokens)


@pytest.mark.parametrize("p, overhead", [(0, 0), (-2, 0), (2, -1), (2.5, 0), ("2", 0), (True, 0)])
def test_bad_sizes_are_refused_by_name(p, overhead):
    with pytest.raises(ValueError, match="--pipeline-parallel-size|--step-overhead-tokens") as info:
        simulate_pipeline([1, 2], p, overhead)
    assert repr(p if "pipeline" in str(info.value) else overhead) in str(info.value)


# ---- CLI ------------------------------------------------------------------------------
def _run(argv: list[str]) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    return buf.getvalue()


SIM = ["inspect", "simulate", "--device", "cpu", "--workload", "mixed",
       "--num-requests", "24", "--max-model-len", "512"]


def test_cli_pp2_json_reports_both_schedules():
    data = json.loads(_run([*SIM, "-pp", "2", "--json"]))
    pipe = data["pipeline"]
    assert pipe["pipeline_parallel_size"] == 2 and pipe["step_overhead_tokens"] == 0
    assert pipe["work_tokens"] == data["real_tokens"] + data["padding_tokens"]
    assert pipe["synchronous"]["bubble_fraction"] == 0.5
    assert 0 <= pipe["pipelined"]["bubble_fraction"] < 0.5
    assert pipe["pipelined"]["makespan_tokens"] >= pipe["work_tokens"] / 2
    sync, piped = pipe["synchronous"]["makespan_tokens"], pipe["pipelined"]["makespan_tokens"]
    assert pipe["speedup"] == pytest.approx(sync / piped)
    assert "disjoint" in pipe["note"]


def test_cli_pp1_output_is_unchanged():
    assert _run([*SIM, "--json"]) == _run([*SIM, "-pp", "1", "--json"])
    assert "pipeline" not in json.loads(_run([*SIM, "--json"]))
    assert "bubble" not in _run(SIM)


def test_cli_text_shows_the_bubble_and_the_note():
    text = _run([*SIM, "--pipeline-parallel-size", "3", "--step-overhead-tokens", "4"])
    assert "synchronous" in text and "pipelined" in text and "66.7%" in text
    assert "speed-up of pipelined over synchronous" in text and "disjoint requests" in text


@pytest.mark.parametrize("value, match", [("0", "--pipeline-parallel-size=0"), ("-1", "--pipeline-parallel-size=-1")])
def test_cli_refuses_a_bad_pp_size_by_name(value, match):
    with pytest.raises(SystemExit) as info:
        main([*SIM, "-pp", value])
    assert match in str(info.value.code)


def test_cli_refuses_a_non_int_pp_size(capsys):
    with pytest.raises(SystemExit):
        main([*SIM, "-pp", "two"])
    assert "'two'" in capsys.readouterr().err
