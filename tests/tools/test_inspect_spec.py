"""`graphrunner inspect` with speculative decoding: the q = 1 + k descriptors and the drafter's nodes.

table/explain are checked against a `DispatchTable` built independently with q = 1 + k;
capture runs on builtin:tiny-llama on a CPU (FULL graphs emulated: the drafter's node count
is reported as unavailable, and the extra captures must leave the runner's graphs alone).
The drafter's node attribution itself needs real CUDA graphs: the `gpu` tests.
"""

from __future__ import annotations

import types

import pytest

from capture.report import CaptureRecord, NodeAttribution
from tests.runner_driver import make_runner
from tests.tools.test_inspect_cli import MODEL, fails, reference_table, run_json, run_text

K = 3
NGRAM = f'{{"method": "ngram", "num_speculative_tokens": {K}}}'
DRAFT = '{"method": "draft_model", "model": "builtin:tiny-llama", "num_speculative_tokens": 2}'
EAGLE3 = '{"method": "eagle3", "model": "builtin:eagle3-tiny-llama", "num_speculative_tokens": 2}'
SIZES = [1, 4, 8, 16]
TABLE = ["--device", "cpu", "--attention-support", "ALWAYS", "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
         "--capture-sizes", ",".join(map(str, SIZES))]
CAPTURE = ["--model", MODEL, "--device", "cpu", "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
           "--max-model-len", "64", "--capture-sizes", "4,8"]


def _table(mode: str | None, q: int = 1 + K):
    return reference_table(mode, "ALWAYS", SIZES, 8, 32, q)


# ---- table --------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [None, "FULL_DECODE_ONLY", "FULL", "PIECEWISE"])
def test_table_json_names_q_and_the_verifying_descriptors(mode):
    argv = TABLE + (["--mode", mode] if mode else [])
    data = run_json("table", *argv, "--speculative-config", NGRAM)
    want = _table(mode)
    verifying = [str(d) for d in want.descriptors if d.uniform_token_count == 1 + K]
    assert data["uniform_decode_query_len"] == 1 + K
    assert [d["key"] for d in data["descriptors"]] == [str(d) for d in want.descriptors]
    assert [d["key"] for d in data["descriptors"] if d["verifying"]] == verifying
    assert all("q=4" in key for key in verifying)
    spec = data["speculative"]
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == K
    assert spec["uniform_decode_query_len"] == 1 + K and spec["verifying_descriptors"] == verifying
    assert bool(verifying) == (mode in (None, "FULL_DECODE_ONLY"))  # modes with separate decode graphs


def test_table_text_marks_the_verifying_descriptors():
    out = run_text("table", *TABLE, "--speculative-config", NGRAM)
    assert f"q = 1 + {K} = {1 + K}" in out and "ngram" in out
    lines = out.splitlines()
    for d in _table(None).descriptors:
        (row,) = [line for line in lines if line.startswith(f"  {d} ")]
        assert ("verifying" in row) == (d.uniform_token_count == 1 + K), row
    assert "FULL(t=4,r=1,q=4)" in out  # size 1 rounds up to one decode of q = 4 tokens


def test_table_text_without_separate_decode_graphs_says_where_drafts_are_verified():
    out = run_text("table", *TABLE, "--mode", "FULL", "--speculative-config", NGRAM)
    assert "none dedicated" in out and "mixed FULL graphs" in out


def test_speculative_config_and_num_speculative_tokens_agree_or_fail():
    assert run_json("table", *TABLE, "--speculative-config", NGRAM, "--num-speculative-tokens", str(K))[
        "uniform_decode_query_len"] == 1 + K
    msg = fails("table", *TABLE, "--speculative-config", NGRAM, "--num-speculative-tokens", "2")
    assert "--num-speculative-tokens=2" in msg and f"num_speculative_tokens={K}" in msg


def test_draft_model_config_needs_no_model_for_the_table():
    data = run_json("table", *TABLE, "--speculative-config", DRAFT)
    assert data["speculative"]["draft_model"] == "builtin:tiny-llama"
    assert data["uniform_decode_query_len"] == 3


# ---- explain ------------------------------------------------------------------------
@pytest.mark.parametrize("num_decodes", [1, 2, 3, 5])
def test_explain_sends_decodes_to_the_q_descriptor(num_decodes):
    q = 1 + K
    lens = ",".join([str(q)] * num_decodes)
    want = _table(None).dispatch(num_decodes, num_decodes * q, q)
    assert want.uniform_token_count == (None if want.is_eager else q)  # 5 decodes outgrow the largest graph
    data = run_json("explain", *TABLE, "--speculative-config", NGRAM, "--query-lens", lens)
    assert data["descriptor"] == str(want)
    assert data["batch"] == {"num_reqs": num_decodes, "num_tokens": num_decodes * q, "uniform": q, "has_lora": False}
    spec = data["speculative"]
    assert spec["verifying_descriptor"] == (not want.is_eager) and spec["draft_slots_per_decode"] == K
    assert spec["draft_tokens_verified"] == num_decodes * K

    text = run_text("explain", *TABLE, "--speculative-config", NGRAM, "--query-lens", lens)
    assert f"descriptor:     {want}\n" in text
    assert f"each decode carries 1 + {K} draft slots" in text
    where = f"{want} (eager)" if want.is_eager else f"the verifying graph {want}"
    assert f"verify {num_decodes * K} draft tokens in {where}" in text


def test_explain_by_sizes_uses_q_from_the_config():
    data = run_json("explain", *TABLE, "--speculative-config", NGRAM, "--num-tokens", "8", "--uniform", "4")
    assert data["descriptor"] == "FULL(t=8,r=2,q=4)"


def test_explain_hints_when_decodes_are_given_without_their_drafts():
    text = run_text("explain", *TABLE, "--speculative-config", NGRAM, "--query-lens", "1,1")
    assert "not a uniform q=4 decode batch" in text
    assert "a decode is scheduled as 4 tokens, not 1" in text
    data = run_json("explain", *TABLE, "--speculative-config", NGRAM, "--query-lens", "1,1")
    assert data["speculative"]["draft_tokens_verified"] is None
    assert not data["speculative"]["verifying_descriptor"]


def test_explain_without_speculation_says_nothing_about_it():
    assert "speculative" not in run_text("explain", *TABLE, "--query-lens", "1,1")
    assert run_json("explain", *TABLE, "--query-lens", "1,1")["speculative"] is None


# ---- simulate -----------------------------------------------------------------------
def test_simulate_schedules_decodes_with_their_draft_slots(tmp_path):
    import json

    trace = tmp_path / "trace.jsonl"
    data = run_json("simulate", "--device", "cpu", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                    "--workload", "decode-heavy", "--num-requests", "6", "--max-model-len", "256",
                    "--speculative-config", NGRAM, "--save-trace", str(trace))
    assert data["uniform_decode_query_len"] == 1 + K
    assert data["uniform_decode_steps"] > data["num_steps"] / 2
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    decodes = [r for r in records if r["uniform"] is not None]
    assert decodes and all(set(r["query_lens"]) == {1 + K} for r in decodes)
    assert any("q=4" in d["descriptor"] for d in data["top_descriptors"])


# ---- bad configs --------------------------------------------------------------------
BAD = [
    ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens=99"),
    ('{"method": "ngram", "num_speculative_tokens": -1}', "num_speculative_tokens=-1"),
    ('{"method": "bogus", "num_speculative_tokens": 2}', "method='bogus'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookup": 3}', "unknown speculative config keys ['lookup']"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
     "prompt_lookup_min=5"),
    ("{nope", "not valid JSON"),
]


@pytest.mark.parametrize("command", ["table", "explain", "capture"])
@pytest.mark.parametrize("config, match", BAD)
def test_bad_speculative_config_fails_naming_the_value(monkeypatch, command, config, match):
    from graphrunner.runner import ModelRunner

    def no_build(*_a, **_k):
        raise AssertionError("the runner was built although the speculative config is bad")

    monkeypatch.setattr(ModelRunner, "__init__", no_build)
    argv = {"table": TABLE, "explain": [*TABLE, "--query-lens", "4"], "capture": CAPTURE}[command]
    msg = fails(command, *argv, "--speculative-config", config)
    assert "--speculative-config" in msg and match in msg, msg


def test_capture_hands_the_config_on(monkeypatch):
    import graphrunner_tools.inspect.capture_cmd as capture_cmd

    seen = {}

    def fake_run(spec):
        seen["spec"] = spec
        raise ValueError("stop here")

    monkeypatch.setattr(capture_cmd, "run_capture", fake_run)
    assert "stop here" in fails("capture", *CAPTURE, "--speculative-config", NGRAM)
    assert seen["spec"].speculative_config == NGRAM and seen["spec"].speculation.q == 1 + K


# ---- capture ------------------------------------------------------------------------
def test_capture_reports_verifying_graphs_and_the_drafter_on_cpu():
    text = run_text("capture", *CAPTURE, "--mode", "FULL_DECODE_ONLY", "--speculative-config", NGRAM)
    assert f"uniform decode q = 1 + {K} = {1 + K}" in text
    assert "verifying graphs (6, q=4): FULL(t=8,r=2,q=4)[greedy|sampled|all]; FULL(t=4,r=1,q=4)" in text
    assert "drafter: nodes unavailable in FULL(t=4,r=1,q=4)[greedy]" in text and "emulated" in text


def test_capture_attributes_an_eagle_heads_nodes_to_the_drafter_on_cpu():
    text = run_text("capture", *CAPTURE, "--mode", "FULL_DECODE_ONLY", "--speculative-config", EAGLE3)
    assert "eagle3 builtin:eagle3-tiny-llama, k=2" in text and "uniform decode q = 1 + 2 = 3" in text
    assert "drafter: nodes unavailable in FULL(" in text and "emulated" in text


@pytest.fixture(scope="module")
def captured_spec_runner():
    """A FULL_AND_PIECEWISE ngram runner, captured, then measured by `speculative_capture`."""
    from graphrunner_tools.bench.common import resolve_device
    from graphrunner_tools.inspect.capture_cmd import CaptureSpec, build_runner
    from graphrunner_tools.inspect.drafter import speculative_capture

    spec = CaptureSpec(model=MODEL, device="cpu", max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64,
                       capture_sizes=(4, 8), speculative_config=NGRAM)
    runner, _ = build_runner(spec, resolve_device("cpu"))
    try:
        report = runner.capture_model(inspect_nodes=True, progress=False)
        graphs = dict(runner.graphs.full_graphs)
        pool = runner.graphs.pool
        summary = speculative_capture(runner, report, spec.speculation)
        yield types.SimpleNamespace(runner=runner, report=report, graphs_before=graphs, pool_before=pool,
                                    summary=summary, spec=spec)
    finally:
        runner.shutdown()


def test_drafter_capture_leaves_the_runners_graphs_alone(captured_spec_runner):
    c = captured_spec_runner
    graphs, spec_step = c.runner.graphs, c.runner.body.spec
    assert graphs.full_graphs == c.graphs_before and graphs.pool is c.pool_before and graphs.captured
    assert all(g.captured for g in graphs.full_graphs.values())
    assert spec_step.drafting  # the drafter is switched on again
    requests = c.runner.body.buffers.requests
    assert int(requests.num_computed_tokens[requests.scratch_row]) == 0  # the scratch row is neutral again


def test_capture_summary_and_report_name_the_drafter(captured_spec_runner):
    from graphrunner_tools.bench.common import env_info, resolve_device
    from graphrunner_tools.inspect.capture_cmd import CaptureResult, capture_text

    c = captured_spec_runner
    s = c.summary
    assert s["uniform_decode_query_len"] == 1 + K and s["drafter_graph"] == "FULL(t=4,r=1,q=4)[greedy]"
    assert [g["graph"] for g in s["verifying_graphs"]] == [
        f"FULL(t={t},r={r},q=4)[{v}]" for t, r in ((8, 2), (4, 1)) for v in ("greedy", "sampled", "all")]
    (attr,) = c.report.attributions
    assert attr.part == "drafter" and attr.graph == s["drafter_graph"]
    assert attr.num_nodes is None and "emulated" in attr.note  # no node list on a CPU
    result = CaptureResult(c.spec, env_info(resolve_device("cpu"), "auto"), (4, 8), [], 0.0, c.report,
                           speculative=s)
    data = result.to_dict(5)
    assert data["speculative"] == s and data["report"]["attributions"] == [attr.to_dict()]
    assert "drafter: nodes unavailable" in str(c.report)
    text = capture_text(result, 5)
    assert "verifying graphs (6, q=4)" in text and "drafter nodes measured on FULL(t=4,r=1,q=4)[greedy]" in text


def test_drafter_off_switches_drafting_off_and_back():
    """The runner's own switch: inside, `SpeculativeStep.propose` returns before drafting."""
    from graphrunner.spec_decode.step import SpeculativeStep
    from graphrunner_tools.inspect.drafter import drafter_off

    runner = make_runner(speculative={"method": "ngram", "num_speculative_tokens": K})
    step = runner.body.spec
    assert isinstance(step, SpeculativeStep) and step.drafting
    with drafter_off(step):
        assert not step.drafting
        step.propose(None)  # returns before touching the (here absent) batch
    assert step.drafting
    with pytest.raises(RuntimeError), drafter_off(step):
        raise RuntimeError("capture failed")
    assert step.drafting


def test_node_attribution_is_the_difference_of_two_captures():
    with_part = CaptureRecord("G[greedy]", 0.1, 0, 50, {"gemm": 6, "ngram": 1, "copy": 4})
    without = CaptureRecord("G[greedy]", 0.1, 0, 44, {"gemm": 6, "copy": 2})
    attr = NodeAttribution.between("drafter", with_part, without)
    assert (attr.num_nodes, attr.graph_nodes, attr.kernels) == (6, 50, {"copy": 2, "ngram": 1})
    assert str(attr) == "drafter: 6 nodes of G[greedy]'s 50 (kernels: copy x2, ngram)"
    unknown = NodeAttribution.between("drafter", CaptureRecord("G", 0.1, 0), without, "CPU")
    assert unknown.num_nodes is None and str(unknown) == "drafter: nodes unavailable in G (CPU)"


# ---- GPU ----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("config, kernel", [(NGRAM, "_ngram_kernel"), (DRAFT, None), (EAGLE3, None)])
def test_gpu_capture_attributes_nodes_to_the_drafter(config, kernel):
    argv = ["--model", MODEL, "--device", "cuda", "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
            "--max-model-len", "64", "--mode", "FULL_AND_PIECEWISE", "--capture-sizes", "4,8"]
    data = run_json("capture", *argv, "--speculative-config", config)
    spec, report = data["speculative"], data["report"]
    q = spec["uniform_decode_query_len"]
    assert spec["verifying_graphs"] and all(f"q={q})" in g["graph"] for g in spec["verifying_graphs"])
    (attr,) = report["attributions"]
    assert attr["part"] == "drafter" and attr["graph"] == spec["drafter_graph"]
    assert attr["num_nodes"] is not None, attr["note"]
    assert 0 < attr["num_nodes"] < attr["graph_nodes"]
    assert attr["kernels"] and all(n > 0 for n in attr["kernels"].values()), attr["kernels"]
    if kernel is not None:
        assert kernel in attr["kernels"], attr["kernels"]
    # The throwaway capture saw the same step as the runner's own graph of that key.
    (record,) = [r for r in report["records"] if r["key"] == attr["graph"]]
    assert record["num_nodes"] == attr["graph_nodes"]
    text = run_text("capture", *argv, "--speculative-config", config)
    assert f"drafter: {attr['num_nodes']} nodes of {attr['graph']}" in text
