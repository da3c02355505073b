"""The reference-engine benchmark (tools/bench/engine_bench.py) on the tiny model: its two
workloads run on a CPU and their counters say what the benchmark measures."""

from __future__ import annotations

import json

import numpy as np
import pytest

from graphrunner.models.registry import get_builtin
from graphrunner_tools.bench import engine_bench

SMALL = ["--model", "builtin:tiny-llama", "--device", "cpu", "--num-requests", "6", "--max-model-len", "256"]


def test_prefix_caching_executes_fewer_tokens_and_keeps_the_outputs(tmp_path, capsys):
    """Requests admitted after the shared prefix was computed hit it: the runner executes fewer
    tokens with caching on, and the greedy outputs are the same."""
    out = tmp_path / "prefix.json"
    engine_bench.main(["prefix", *SMALL, "--prefix-len", "64", "--suffix-len", "8", "--max-tokens", "4",
                       "--max-num-batched-tokens", "96", "--json", str(out)])
    assert "greedy outputs equal with and without caching: 6/6" in capsys.readouterr().out
    off, on = json.loads(out.read_text())["results"]
    assert off["output_tokens"] == on["output_tokens"] == 6 * 4
    assert on["hit_rate"] > 0 and on["tokens_executed"] < off["tokens_executed"]
    # What a hit saves is whole prefix blocks (16 tokens), never a request's last token.
    assert (off["tokens_executed"] - on["tokens_executed"]) % 16 == 0


def _recorded_structured_run(tmp_path, *extra: str) -> tuple[list[dict], list[list[int]]]:
    """engine_bench structured on the tiny model: (its results, the constrained run's outputs)."""
    import graphrunner.engine.llm as llm_module

    seen: list[list[int]] = []
    generate = llm_module.LLM.generate

    def recording(self, prompts, params=None, **kw):
        outs = generate(self, prompts, params, **kw)
        seen.extend(list(o.token_ids) for o in outs)
        return outs

    llm_module.LLM.generate = recording
    try:
        out = tmp_path / "structured.json"
        engine_bench.main(["structured", *SMALL, "--prompt-len", "8", *extra, "--json", str(out)])
    finally:
        llm_module.LLM.generate = generate
    return json.loads(out.read_text())["results"], seen[-6:]  # the last generate call is the constrained run


def test_structured_workload_follows_its_grammar(tmp_path):
    """The token-id grammar: every constrained output token obeys it (the parity rule), and both
    runs emit every requested token."""
    (free, constrained), outputs = _recorded_structured_run(tmp_path, "--max-tokens", "6", "--grammar", "token-id")
    assert free["output_tokens"] == constrained["output_tokens"] == 6 * 6
    for tokens in outputs:
        prev = np.array([0] + tokens[:-1])
        assert ((np.array(tokens) + prev) % 2 == 0).all(), tokens


def test_structured_repeats_alternate_and_report_the_median_runs(tmp_path, capsys):
    """--repeats 3: each variant runs three times (ABBA order), the table holds each variant's
    median run and the ratio line lists the three pairs."""
    out = tmp_path / "structured.json"
    engine_bench.main(["structured", *SMALL, "--prompt-len", "8", "--max-tokens", "3", "--grammar", "token-id",
                       "--repeats", "3", "--json", str(out)])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("constrained / unconstrained"))
    assert "medians of 3 runs each" in line and line.count(", ") == 2, line
    free, constrained = json.loads(out.read_text())["results"]
    assert free["label"] == "unconstrained" and constrained["label"] == "constrained"
    assert free["output_tokens"] == constrained["output_tokens"] == 6 * 3
    runs = [engine_bench.RunResult("r", s, 0, 1) for s in (3.0, 1.0, 2.0, 5.0)]
    assert engine_bench.median_run(runs).seconds == 3.0 and engine_bench.median_run(runs[:3]).seconds == 2.0


def test_structured_json_workload_is_accepted_by_the_schema_matcher(tmp_path):
    """xgrammar JSON over the synthetic tokenizer: a fresh matcher of the same schema accepts every
    constrained output token in order, and an output shorter than max_tokens completed the JSON."""
    pytest.importorskip("xgrammar")
    from graphrunner.engine.structured import XGrammarBackend
    from graphrunner.structured_outputs import StructuredOutputsParams

    (free, constrained), outputs = _recorded_structured_run(tmp_path, "--max-tokens", "24", "--grammar", "json")
    assert free["output_tokens"] == 6 * 24 and 0 < constrained["output_tokens"] <= 6 * 24
    vocab = get_builtin("builtin:tiny-llama").vocab_size
    backend = XGrammarBackend(engine_bench.synthetic_tokenizer(vocab), vocab)
    for tokens in outputs:
        matcher = backend.compile(StructuredOutputsParams(json=json.dumps(engine_bench.JSON_SCHEMA)))
        assert all(matcher.accept_token(t) for t in tokens), tokens
        assert len(tokens) == 24 or matcher.is_terminated(), tokens



def test_structured_host_times_each_call_and_the_fill_threads_agree(capsys):
    """structured_host at a small vocabulary: one row per fill-thread count, every call timed (the
    tool itself asserts the masks of both thread counts agree at every step)."""
    pytest.importorskip("xgrammar")
    from graphrunner_tools.bench import structured_host

    assert structured_host.main(["--requests", "4", "--steps", "6", "--vocab", "2048", "--threads", "1,2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert len(rows) == 2 and all(float(cell) > 0 for row in rows for cell in row.strip("|").split("|")[1:])
