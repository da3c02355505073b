"""`graphrunner bench soak` on a CPU: tiny-llama under churn with a tiny KV cache.

End to end: the soak passes (rows, preemptions, aborts, no recapture, probe equal to a
fresh engine's) and a forced failure (a perturbed soaked engine, a negative memory
tolerance) exits non-zero naming each reason. The workload generator and the output
checks are tested on their own.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from graphrunner.cli import main
from graphrunner.engine.request import SequenceOutput
from graphrunner.protocol import SamplingParams
from graphrunner_tools.bench import soak

SMALL = ["--model", "builtin:tiny-llama", "--device", "cpu", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
         "--max-model-len", "64", "--num-kv-blocks", "8"]
LIMITS = soak._Limits(vocab=2048, max_model_len=64, eos_ids=(2,), max_logit_bias=300, max_stop_ids=16,
                      max_logprobs=20)


def test_soak_passes_with_preemptions_aborts_and_matching_probe(tmp_path, capsys):
    out, md = tmp_path / "soak.json", tmp_path / "soak.md"
    # A high abort fraction: aborts happen within the first steps even on a loaded 2-core machine.
    argv = ["bench", "soak", "--minutes", "0.04", "--report-every-s", "1", "--abort-fraction", "0.6", *SMALL,
            "--json", str(out), "--markdown", str(md)]
    rc = main(argv)
    data = json.loads(out.read_text())
    assert rc == 0, (data["failures"], data["warnings"])
    assert data["kind"] == "soak" and data["passed"] and data["failures"] == [] and data["error"] is None
    rows = data["rows"]
    assert len(rows) >= 2, rows
    assert rows[-1]["preemptions"] > 0 and rows[-1]["aborted"] > 0 and rows[-1]["finished"] > 0, rows[-1]
    assert all(r["recaptures"] == 0 and r["recompiles"] == 0 and r["graphs"] == rows[0]["graphs"] > 0 for r in rows)
    assert [r["elapsed_s"] for r in rows] == sorted(r["elapsed_s"] for r in rows)
    assert all(r["tok_per_s"] > 0 for r in rows) and data["num_output_errors"] == 0
    assert data["probe_matched"] and data["probe_soaked"] == data["probe_fresh"]
    assert all(len(tokens) > 0 for tokens in data["probe_soaked"])
    assert data["memory_growth_mib"] == 0.0  # CPU: no device memory to grow
    printed = capsys.readouterr().out
    assert "preemptions" in printed and "PASS" in printed
    assert "| elapsed_s |" in md.read_text()


def test_soak_fails_on_perturbed_engine_and_memory_growth(tmp_path, monkeypatch, capsys):
    loop = soak.soak_loop

    def loop_then_perturb(llm, *args, **kwargs):
        counters = loop(llm, *args, **kwargs)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in llm.runner.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
        return counters

    monkeypatch.setattr(soak, "soak_loop", loop_then_perturb)
    out = tmp_path / "soak.json"
    argv = ["bench", "soak", "--minutes", "0.02", "--report-every-s", "0.4", "--max-growth-mib", "-1", *SMALL,
            "--json", str(out)]
    assert main(argv) == 1
    data = json.loads(out.read_text())
    assert not data["passed"] and not data["probe_matched"]
    reasons = " ".join(data["failures"])
    assert "probe mismatch" in reasons and "allocated memory grew" in reasons
    err = capsys.readouterr().err
    assert "graphrunner bench soak: probe mismatch" in err and "--max-growth-mib -1" in err


def test_random_params_are_valid_and_mix_every_feature():
    rng = np.random.default_rng(0)
    params = [soak.random_params(rng, int(rng.integers(1, 40)), LIMITS) for _ in range(400)]
    assert all(isinstance(p, SamplingParams) for p in params)  # construction validates
    seen = {
        "greedy": any(p.temperature == 0 for p in params), "top_k": any(p.top_k > 0 for p in params),
        "top_p": any(p.top_p < 1 for p in params), "min_p": any(p.min_p > 0 for p in params),
        "penalties": any(p.uses_penalties for p in params), "logit_bias": any(p.logit_bias for p in params),
        "allowed": any(p.allowed_token_ids for p in params), "min_tokens": any(p.min_tokens > 0 for p in params),
        "stop": any(p.stop_token_ids for p in params), "logprobs": any(p.logprobs is not None for p in params),
        "prompt_logprobs": any(p.prompt_logprobs is not None for p in params),
        "seeded": any(p.seed is not None for p in params), "unseeded": any(p.seed is None for p in params),
    }
    assert all(seen.values()), seen


def test_check_output_flags_broken_outputs():
    params = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=(7,), allowed_token_ids=(5, 6, 7))

    def output(tokens, reason):
        return SequenceOutput("r", [1, 2], tokens, reason)

    assert soak.check_output(output([5, 6, 7], "stop"), params, LIMITS) is None
    assert soak.check_output(output([5, 6, 5], "abort"), params, LIMITS) is None
    assert "stop/EOS token at position 0" in soak.check_output(output([7], "stop"), params, LIMITS)
    assert "not allowed" in soak.check_output(output([5, 9, 6, 5], "length"), params, LIMITS)
    assert "max_tokens" in soak.check_output(output([5, 6, 5, 6, 5], "length"), params, LIMITS)
    assert "finish 'length'" in soak.check_output(output([5, 6], "length"), params, LIMITS)


def test_a_variant_captured_on_first_use_is_not_counted_as_a_recapture():
    """The all-features graphs are captured by the first step that needs one: the soak's graph count
    (what `capture()` made) and generation stay, while the lazy capture itself is counted."""
    from graphrunner import LLM

    llm = LLM("builtin:tiny-llama", device="cpu", enforce_eager=False, cudagraph_mode="FULL_DECODE_ONLY",
              compile_backend="eager", cudagraph_capture_sizes=(1, 2), max_num_seqs=2, num_kv_blocks=32,
              max_model_len=64)
    before = soak._graph_state(llm)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2))
    assert llm.runner.graphs.captured_on_first_use == 1
    assert soak._graph_state(llm) == before
