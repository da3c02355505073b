"""`inspect simulate --num-experts`: per-rank expert load with the static placement and with EPLB's."""

from __future__ import annotations

import json

import pytest

from graphrunner.cli import main
from graphrunner_tools.inspect.experts import simulate_expert_load

STEPS = [64] * 40


def test_uniform_router_is_balanced_either_way():
    result = simulate_expert_load(STEPS, num_experts=64, top_k=4, ep_size=4, skew=0.0)
    assert result.routed_tokens == sum(STEPS)
    assert sum(result.static_rank_loads) == sum(STEPS) * 4
    assert result.static_balance < 1.05 and result.eplb_balance < 1.05


def test_eplb_balances_a_skewed_router_that_the_static_placement_does_not():
    result = simulate_expert_load(STEPS, num_experts=64, top_k=4, ep_size=4, redundant=16, skew=1.2, seed=3)
    assert result.static_balance > 1.2
    assert result.eplb_balance < 1.05
    assert sum(result.eplb_rank_loads) == pytest.approx(sum(result.static_rank_loads))


@pytest.mark.parametrize("argv, message", [
    (["--num-experts", "60", "--ep-size", "8"], "--ep-size 8 must be >= 1 and divide --num-experts 60"),
    (["--num-experts", "8", "--top-k", "9"], "need 1 <= top_k <= num_experts"),
    (["--num-experts", "8", "--ep-size", "2", "--num-redundant-experts", "3"], "multiple of --ep-size 2"),
])
def test_bad_expert_arguments_name_the_value(argv, message):
    with pytest.raises(SystemExit) as info:
        main(["inspect", "simulate", "--workload", "mixed", "--num-requests", "4", *argv])
    assert str(info.value.code).startswith("graphrunner inspect simulate:") and message in str(info.value.code)


def test_the_simulation_reports_the_expert_load(capsys):
    assert main(["inspect", "simulate", "--workload", "decode-heavy", "--num-requests", "16", "--num-experts", "32",
                 "--top-k", "2", "--ep-size", "2", "--num-redundant-experts", "4", "--json"]) == 0
    load = json.loads(capsys.readouterr().out)["expert_load"]
    assert load["ep_size"] == 2 and load["num_redundant_experts"] == 4 and len(load["eplb_rank_loads"]) == 2
    assert load["eplb_balance"] <= load["static_balance"]
