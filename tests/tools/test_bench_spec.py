"""`graphrunner bench spec` on a CPU: the outputs' structure and invariants, never golden timings.

Runs the command end to end on builtin:tiny-llama (dummy weights, emulated FULL graphs),
which drafts for itself in the draft-model runs; the synthetic acceptance rate pins the
tokens per step (> 1 at 0.8, exactly 1 at 0.0) for the n-gram and the draft-model drafter.
"""

from __future__ import annotations

import json

import pytest

from graphrunner.cli import main
from graphrunner_tools.bench.spec_bench import (
    Run,
    SpecBenchSpec,
    SpecRow,
    add_ratios,
    choose_draft_model,
    max_model_len,
    prompts_of,
    runs_of,
    targets,
)

MODEL = "builtin:tiny-llama"
DRAFT_RUN = "draft tiny-llama synth 0.8, k=2"
HEAD = "builtin:eagle3-tiny-llama"  # --heads auto: the target's built-in EAGLE-3 head
HEAD_RUN = "eagle3 eagle3-tiny-llama synth 0.8, k=2"
# Small settings: the command builds four runners (plain, synthetic, draft, strict) on 2 CI cores.
CPU_ARGS = ["--models", MODEL, "--batch-sizes", "1,2", "--num-spec", "2", "--steps", "4", "--device", "cpu",
            "--prompt-len", "64", "--warmup", "2", "--drafter-repeats", "5"]


def _run(tmp_path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "spec.json"
    assert main(["bench", "spec", *CPU_ARGS, "--out", str(out), *extra]) == 0
    return json.loads(out.read_text()), (tmp_path / "spec.md").read_text()


def _rows(data: dict, method: str) -> dict[int, dict]:
    return {r["batch_size"]: r for r in data["rows"] if r["method"] == method}


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("spec"))


def test_every_runner_and_batch_is_measured(default_run):
    data, _ = default_run
    assert data["kind"] == "spec" and data["env"]["device"] == "cpu"
    assert [(r["run"], r["error"]) for r in data["runners"]] == [
        ("plain", None), ("synthetic 0.8, k=2", None), (DRAFT_RUN, None), (HEAD_RUN, None),
        ("n-gram strict, k=4", None)]
    assert sorted((r["method"], r["batch_size"]) for r in data["rows"]) == [
        ("draft", 1), ("draft", 2), ("eagle3", 1), ("eagle3", 2), ("plain", 1), ("plain", 2), ("strict", 1),
        ("strict", 2), ("synthetic", 1), ("synthetic", 2)]
    for r in data["rows"]:
        q = 1 + r["k"]
        # Decode steps replay the uniform-decode FULL graph of exactly the batch (no padding).
        assert r["descriptor"] == f"FULL(t={r['batch_size'] * q},r={r['batch_size']},q={q})"
        assert 0 < r["step"]["min"] <= r["step_ms"] == r["step"]["median"] <= r["step"]["max"]
        assert r["step"]["n"] == 4
        assert r["gpu_step"] is None and r["gpu_step_ms"] is None  # no CUDA events on a CPU
        assert 1 <= r["tokens_per_step"] <= q
        assert r["tokens_per_s"] > 0 and r["mean_context"] > 64
        assert r["step_vs_plain"] > 0 and r["tokens_per_s_vs_plain"] > 0
        assert (r["drafter"] is None) == (r["k"] == 0)
        assert (r["proposed_per_step"] is None) == (r["k"] == 0)
        assert r["draft_model"] == {"draft": MODEL, "eagle3": HEAD}.get(r["method"])


def test_plain_decode_emits_one_token_per_step(default_run):
    for r in _rows(default_run[0], "plain").values():
        assert r["tokens_per_step"] == r["expected_tokens_per_step"] == 1.0
        assert r["step_vs_plain"] == r["tokens_per_s_vs_plain"] == 1.0
        assert r["drafts_per_step"] is None and r["acceptance_rate"] is None


@pytest.mark.parametrize("method", ["synthetic", "draft", "eagle3"])
def test_synthetic_acceptance_emits_more_than_one_token_per_step(default_run, method):
    plain = _rows(default_run[0], "plain")
    rows = _rows(default_run[0], method)
    assert sorted(rows) == [1, 2]
    for bs, r in rows.items():
        assert r["k"] == 2 and r["acceptance"] == 0.8
        assert r["tokens_per_step"] > 1
        assert r["expected_tokens_per_step"] == pytest.approx(1 + 0.8 + 0.64)
        # Synthetic verification checks every draft slot; each emitted token past the first is an accepted draft.
        assert r["drafts_per_step"] == 2
        assert r["accepted_per_step"] == pytest.approx(r["tokens_per_step"] - 1)
        assert r["acceptance_rate"] == pytest.approx(r["accepted_per_step"] / 2)
        assert r["drafter_ms"] > 0 and r["drafter"]["n"] == 5
        assert r["step_vs_plain"] == pytest.approx(r["step_ms"] / plain[bs]["step_ms"])
        assert r["tokens_per_s_vs_plain"] == pytest.approx(r["tokens_per_s"] / plain[bs]["tokens_per_s"])


@pytest.mark.parametrize("method,run,model", [("draft", DRAFT_RUN, MODEL), ("eagle3", HEAD_RUN, HEAD)])
def test_draft_model_and_head_propose_k_drafts_every_step(default_run, method, run, model):
    """Each request holds KV blocks past its new token (the lookahead), so the draft model or
    EAGLE head proposes all k drafts at every step; its rows say which model drafted."""
    for r in _rows(default_run[0], method).values():
        assert r["run"] == run and r["draft_model"] == model
        assert r["proposed_per_step"] == 2


def test_strict_ngram_acceptance_is_counted_from_the_drafts(default_run):
    for r in _rows(default_run[0], "strict").values():
        assert r["k"] == 4 and r["expected_tokens_per_step"] is None
        assert 0 <= r["accepted_per_step"] <= r["drafts_per_step"] <= 4
        assert r["tokens_per_step"] == pytest.approx(1 + r["accepted_per_step"])
        if r["drafts_per_step"]:
            assert r["acceptance_rate"] == pytest.approx(r["accepted_per_step"] / r["drafts_per_step"])


def test_report_names_targets_and_the_draft_model(default_run):
    data, markdown = default_run
    assert data["draft_models"] == {MODEL: {"model": MODEL, "note": f"{MODEL} (the default)"}}
    assert [t["met"] for t in data["targets"]] == [None, None, None]  # the 8B was not run
    assert "builtin:llama-3.2-1b" in data["targets"][2]["name"] and "not measured" in data["targets"][2]["note"]
    assert data["notes"] and all(isinstance(n, str) for n in data["notes"])
    assert f"## {MODEL}" in markdown and "| bs | run | graph | step ms | GPU step ms |" in markdown
    assert markdown.count("\n| 1 | ") == 5 and markdown.count("\n| 2 | ") == 5  # five runners
    assert f"Draft model: {MODEL} (the default)" in markdown and "not measured in this run" in markdown


def test_zero_acceptance_emits_exactly_one_token_per_step(tmp_path):
    data, _ = _run(tmp_path, "--acceptance", "0", "--ngram-k", "0")
    for method in ("synthetic", "draft", "eagle3"):
        rows = _rows(data, method)
        assert sorted(rows) == [1, 2]
        for r in rows.values():
            assert r["tokens_per_step"] == r["expected_tokens_per_step"] == 1.0
            assert r["accepted_per_step"] == 0 and r["acceptance_rate"] == 0
    assert not _rows(data, "strict")


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--batch-sizes", "1,x"], "--batch-sizes"),
        (["--num-spec", "0"], "--num-spec"),
        (["--num-spec", "17"], "num_speculative_tokens=17"),
        (["--acceptance", "1.5"], "acceptance rate 1.5"),
        (["--acceptance", "a"], "--acceptance"),
        (["--mode", "NONE"], "captures nothing"),
        (["--mode", "PIECEWISE"], "FULL graphs"),
        (["--steps", "0"], "steps=0"),
        (["--draft-model", "builtin:nope"], "unknown builtin model 'builtin:nope'"),
        (["--draft-model", "/no/such/folder"], "/no/such/folder"),
    ],
)
def test_bad_arguments_exit_with_a_named_error(argv, needle):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "spec", "--models", MODEL, "--device", "cpu", *argv])
    assert needle in str(exc.value)


def test_requests_never_reach_max_model_len():
    spec = SpecBenchSpec(prompt_len=100, warmup=2, steps=10, gpu_steps=3, block_size=16)
    # Each decode step advances a request by at most 1 + k tokens.
    assert max_model_len(spec, 4) >= 100 + (2 + 10 + 3) * 5
    assert max_model_len(spec, 4) % 16 == 0


def test_repetitive_prompts_repeat_one_pattern():
    spec = SpecBenchSpec(prompt_len=37, pattern_len=5)
    for p in prompts_of(spec, 3, 1000, repetitive=True):
        assert len(p) == 37 and all(p[i] == p[i % 5] for i in range(37))
    assert all(len(p) == 37 for p in prompts_of(spec, 3, 1000, repetitive=False))


@pytest.mark.parametrize(
    "target, option, draft, note",
    [
        ("builtin:llama-3.1-8b", "auto", "builtin:llama-3.2-1b", "(the default)"),
        ("builtin:tiny-llama", "auto", "builtin:tiny-llama", "(the default)"),
        ("builtin:qwen2.5-0.5b", "auto", None, "no default draft model"),
        ("builtin:llama-3.1-8b", "none", None, "--draft-model none"),
        ("builtin:llama-3.1-8b", "builtin:llama-3.1-8b", "builtin:llama-3.1-8b", "(--draft-model)"),
        ("builtin:qwen2.5-0.5b", "builtin:llama-3.2-1b", None, "vocab_size 128256 is not the target's 151936"),
    ],
)
def test_draft_model_choice_needs_the_targets_vocabulary(target, option, draft, note):
    choice = choose_draft_model(target, option)
    assert choice.model == draft and note in choice.note


def test_draft_runs_follow_the_synthetic_ones():
    spec = SpecBenchSpec(num_spec=(2, 4), acceptance=(0.8,), ngram_k=4)
    runs = runs_of(spec, "builtin:llama-3.2-1b")
    assert [r.label for r in runs] == [
        "plain", "synthetic 0.8, k=2", "synthetic 0.8, k=4", "draft llama-3.2-1b synth 0.8, k=2",
        "draft llama-3.2-1b synth 0.8, k=4", "n-gram strict, k=4"]
    assert runs[4].speculative() == {
        "method": "draft_model", "model": "builtin:llama-3.2-1b", "num_speculative_tokens": 4,
        "rejection_sample_method": "synthetic", "synthetic_acceptance_rate": 0.8}
    assert runs[4].expected_tokens_per_step() == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096)
    assert [r.method for r in runs_of(spec)] == ["plain", "synthetic", "synthetic", "strict"]


def _row(run: Run, step_ms: float, tokens_per_step: float) -> SpecRow:
    stats = {"median": step_ms}
    return SpecRow(model="builtin:llama-3.1-8b", batch_size=1, run=run.label, method=run.method, k=run.k,
                   acceptance=run.acceptance, draft_model=run.draft, descriptor="", mean_context=0.0, step=stats,
                   gpu_step=None, gpu_clean_fraction=None, drafter=None, tokens_per_step=tokens_per_step,
                   expected_tokens_per_step=None, tokens_per_s=tokens_per_step / step_ms * 1e3, drafts_per_step=None,
                   accepted_per_step=None, acceptance_rate=None, proposed_per_step=None)


def test_targets_read_the_8b_rows_at_batch_1():
    rows = [_row(Run("plain"), 10.0, 1.0), _row(Run("synthetic", 4, 0.8), 11.0, 3.36),
            _row(Run("draft", 4, 0.8, "builtin:llama-3.2-1b"), 16.0, 3.36)]
    add_ratios(rows)
    step, ngram, draft = targets(rows)
    assert (step.measured, step.met) == (pytest.approx(1.1), True)
    assert (ngram.measured, ngram.met) == (pytest.approx(3.36 / 1.1), True)
    assert draft.name == "draft model builtin:llama-3.2-1b, synthetic 0.8, k = 4: tokens/s / plain"
    assert (draft.measured, draft.met, draft.note) == (pytest.approx(3.36 / 1.6), True, "step 1.60x plain")
    # Another draft model does not stand in for the 1B.
    other = targets([*rows[:2], _row(Run("draft", 4, 0.8, "builtin:tiny-llama"), 16.0, 3.36)])[2]
    assert other.measured is None and other.met is None and "not measured" in other.note
