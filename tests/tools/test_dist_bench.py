"""dist_bench (tools/bench/dist_bench.py): layout names, capture sizes, and one gloo world on CPU.

The benchmark's figures come from GPUs (docs/benchmarks.md); here its plumbing is checked: a name
parses to the sizes it spells, the decode graphs cover every share of a batch that pipelined PP
or DP makes, and a PP2 world on CPU runs the decode and throughput passes and reports an idle
fraction that is a fraction.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphrunner_tools.bench.dist_bench import _markdown, capture_sizes, main, parse_layout

size = st.integers(1, 8)


@given(size, size, size, st.sampled_from(["", "sync", "disjoint", "lock", "lockdbo"]))
def test_layout_names_parse_to_their_sizes(tp: int, pp: int, dp: int, mode: str) -> None:
    name = f"tp{tp}pp{pp}dp{dp}{mode}"
    if (mode in ("sync", "disjoint") and pp == 1) or (mode.startswith("lock") and dp == 1):
        with pytest.raises(ValueError, match="needs"):
            parse_layout(name)
        return
    layout = parse_layout(name)
    assert (layout.tp, layout.pp, layout.dp, layout.mode) == (tp, pp, dp, mode)
    assert layout.world_size == tp * pp * dp
    assert layout.lockstep == mode.startswith("lock")


@pytest.mark.parametrize("name,sizes", [("tp1", (1, 1, 1)), ("pp4", (1, 4, 1)), ("dp2tp2", (2, 1, 2)),
                                        ("tp2pp2", (2, 2, 1)), ("dp4", (1, 1, 4))])
def test_short_names(name: str, sizes: tuple[int, int, int]) -> None:
    layout = parse_layout(name)
    assert (layout.tp, layout.pp, layout.dp) == sizes


@pytest.mark.parametrize("name", ["", "tp", "tp2dp2tp2", "x4", "tp2sync", "tp2disjoint", "pp2lock", "tp4 "])
def test_bad_names_are_refused_with_the_forms(name: str) -> None:
    with pytest.raises(ValueError, match=repr(name)):
        parse_layout(name)


@given(st.lists(st.integers(1, 512), min_size=1, max_size=4), st.integers(1, 8))
def test_capture_sizes_cover_every_share(counts: list[int], splits: int) -> None:
    sizes = capture_sizes(counts, splits)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1
    for n in counts:
        for d in range(1, splits + 1):
            assert -(-n // d) in sizes  # a batch of n cut into d parts: its largest part has a graph


def test_a_pp2_world_on_cpu_reports_throughput_and_idle(tmp_path) -> None:
    status = main(["--out", str(tmp_path), "--device", "cpu", "--model", "builtin:tiny-llama", "--configs", "pp2",
                   "--batch-sizes", "2", "--throughput-requests", "6", "--prompt-len", "8", "--output-len", "4",
                   "--decode-steps", "4", "--compile-backend", "eager", "--num-kv-blocks", "64", "--timeout", "240"])
    assert status == 0
    (result,) = json.loads((tmp_path / "dist_bench.json").read_text())
    assert result["status"] == 0 and (result["tp"], result["pp"], result["dp"]) == (1, 2, 1)
    (decode,) = result["decode"]
    assert decode["bs"] == 2 and decode["ms_per_token"] > 0
    (run,) = result["throughput"]
    assert run["requests"] == 6 and run["output_tokens_per_s"] > 0
    ranks = run["ranks"]
    assert sorted(r["pp_rank"] for r in ranks) == [0, 1]
    for r in ranks:  # every forward timed on both stages; the idle share of a window is a fraction
        assert r["forwards"] > 0 and 0.0 <= r["idle_fraction"] < 1.0 and r["busy_ms"] <= r["window_ms"]
    assert "| pp2 | 6 x 8 in / 4 out |" in _markdown([result])


@given(st.floats(0, 10), st.floats(0, 10), st.floats(0, 10), st.floats(0, 10))
def test_overlap_fraction_is_the_shared_share_of_the_span(a: float, b: float, c: float, d: float) -> None:
    from graphrunner_tools.bench.dist_bench import overlap_fraction

    (s0, e0), (s1, e1) = sorted((a, b)), sorted((c, d))
    got = overlap_fraction(s0, e0, s1, e1)
    assert 0.0 <= got <= 1.0 and got == overlap_fraction(s1, e1, s0, e0)
    if e0 <= s1 or e1 <= s0:  # one after the other
        assert got == 0.0
    if (s0, e0) == (s1, e1) and e0 > s0:  # side by side throughout
        assert got == 1.0
    assert overlap_fraction(0.0, 2.0, 1.0, 3.0) == pytest.approx(1 / 3)


@pytest.mark.parametrize("redundant", [0, 2])
def test_skewed_experts_are_not_the_ones_replicated_at_start(redundant: int) -> None:
    """The initial EPLB placement copies experts 0..R-1 onto the last rank: a skew on them would be
    balanced before EPLB moved anything, so the hot experts start at expert R."""
    from types import SimpleNamespace

    import torch

    from graphrunner.layers.moe.layer import FusedMoE
    from graphrunner_tools.bench.dist_bench import skew_router

    moe = object.__new__(FusedMoE)
    torch.nn.Module.__init__(moe)
    moe.gate = torch.nn.Linear(4, 8, bias=False)
    moe.num_experts, moe.num_physical_experts = 8, 8 + redundant
    before = moe.gate.weight.detach().clone()
    done = skew_router(SimpleNamespace(runner=SimpleNamespace(model=moe)), 3, 20.0)
    hot = list(range(redundant, redundant + 3))
    assert done["hot_experts"] == hot
    scale = torch.ones(8, 1)
    scale[hot] = 20.0
    torch.testing.assert_close(moe.gate.weight.detach(), before * scale)
    too_many = min(8 - redundant, 7) + 1  # past the last expert, or every expert
    with pytest.raises(ValueError, match=f"--hot-experts {too_many} must lie in 1..{too_many - 1}"):
        skew_router(SimpleNamespace(runner=SimpleNamespace(model=moe)), too_many, 20.0)


def test_the_microbatch_timer_wraps_the_forward_with_its_arguments() -> None:
    """MicrobatchOverlap replaces Microbatcher._forward for a run: the forward gets what it was called
    with, each call is timed, and close() puts the original back."""
    from types import SimpleNamespace

    import torch

    from graphrunner.step.microbatch import Microbatcher
    from graphrunner_tools.bench.dist_bench import MicrobatchOverlap

    original = Microbatcher._forward
    calls: list = []
    body = SimpleNamespace(forward=lambda half, **kw: calls.append((half, kw)) or torch.zeros(1))
    timer = MicrobatchOverlap("cpu")
    try:
        ub = Microbatcher(4, torch.device("cpu"))
        ub._forward(body, "first", None)
        ub._forward(body, "second", None)
    finally:
        summary = timer.close()
    assert Microbatcher._forward is original
    assert calls == [("first", {}), ("second", {})] and len(timer.halves) == 2, summary
