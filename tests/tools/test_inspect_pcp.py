"""`graphrunner inspect explain --prefill-context-parallel-size P`: the per-rank split of a batch (CPU).

Hand-worked example, P = 2, one prefill of 5 tokens then two decodes (q = 1): the prefill is padded
to Lp = 8 in 2P = 4 chunks of c = 2. Rank 0 takes chunks 0 and 3 (indices 0,1 | 6,7: 2 real, 2 padding),
rank 1 chunks 1 and 2 (indices 2,3 | 4,5: 3 real, 1 padding); both hold both decodes, so 6 local
tokens each. Prefill work (num_computed = 0): rank 0 = 1 + 2 = 3, rank 1 = 3 + 4 + 5 = 12; the bound
is K = c(n + Lp) - c(c - 1)/2 = 15.
"""

from __future__ import annotations

import pytest

from tests.tools.test_inspect_cli import fails, run_json, run_text

BASE = ("explain", "--device", "cpu", "--query-lens", "5,1,1")


def _rank_rows(text: str) -> list[list[str]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("rank  tokens")) + 2
    return [line.split() for line in lines[start:start + 2]]


def test_text_table_of_the_hand_worked_example():
    text = run_text(*BASE, "-pcp", "2")
    assert "the runner's split" in text and "K/V all-gathered per layer" in text
    assert _rank_rows(text) == [["0", "6", "4", "2", "3", "0,3"], ["1", "6", "5", "1", "12", "1,2"]]
    entries = [line.split() for line in text.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"])]
    prefill = next(e for e in entries if e[1] == "prefill")
    assert prefill[:5] == ["0", "prefill", "5", "2", "8"]
    assert " ".join(prefill[5:]) == "r0: 0,3 r1: 1,2"
    decodes = [e for e in entries if e[1] == "decode"]
    assert [e[0] for e in decodes] == ["1", "2"]
    assert all("duplicated on every rank" in " ".join(e) for e in decodes)
    assert "at most 15" in text


def test_json_carries_the_split_under_pcp():
    out = run_json(*BASE, "--prefill-context-parallel-size", "2")
    pcp = out["pcp"]
    assert pcp["pcp_size"] == 2 and "the runner's split" in pcp["note"]
    assert [(r["rank"], r["tokens"], r["real_tokens"], r["padding"], r["prefill_work"], r["chunks"])
            for r in pcp["ranks"]] == [(0, 6, 4, 2, 3, [0, 3]), (1, 6, 5, 1, 12, [1, 2])]
    first, *decodes = pcp["entries"]
    assert first == {"entry": 0, "kind": "prefill", "query_len": 5, "chunk_len": 2, "padded_len": 8,
                     "chunks_by_rank": [[0, 3], [1, 2]], "duplicated": False}
    assert [(d["kind"], d["duplicated"], d["chunks_by_rank"]) for d in decodes] == [("decode", True, None)] * 2
    assert pcp["work_imbalance_bound"] == 15
    assert {k: v for k, v in out.items() if k != "pcp"} == run_json(*BASE)


def test_uniform_batch_by_sizes_and_larger_p():
    pcp = run_json("explain", "--device", "cpu", "--num-tokens", "12", "--uniform", "6", "-pcp", "3")["pcp"]
    assert [e["kind"] for e in pcp["entries"]] == ["prefill", "prefill"]
    assert [r["chunks"] for r in pcp["ranks"]] == [[0, 5], [1, 4], [2, 3]]
    assert all(r["tokens"] == 4 and r["padding"] == 0 for r in pcp["ranks"])
    assert len({r["prefill_work"] for r in pcp["ranks"]}) == 1  # q a multiple of 2P: balanced


@pytest.mark.parametrize("bad", ["0", "-2"])
def test_bad_pcp_size_is_refused_naming_the_value(bad):
    msg = fails(*BASE, "-pcp", bad)
    assert f"--prefill-context-parallel-size={bad}" in msg


def test_mixed_batch_by_sizes_needs_query_lens():
    msg = fails("explain", "--device", "cpu", "--num-tokens", "9", "--num-reqs", "3", "-pcp", "2")
    assert "--query-lens" in msg


def test_p_1_changes_nothing():
    assert run_text(*BASE, "-pcp", "1") == run_text(*BASE)
    assert run_json(*BASE, "--prefill-context-parallel-size", "1") == run_json(*BASE)
    assert "pcp" not in run_json(*BASE, "-pcp", "1")
