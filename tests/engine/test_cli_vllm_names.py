"""`graphrunner generate` / `serve` take vLLM's flag names; refusals and unknown flags say why."""

from __future__ import annotations

import json

import pytest

from graphrunner.cli import build_parser, main


def test_vllm_flag_names_parse():
    args = build_parser().parse_args(["serve", "builtin:tiny-llama", "-tp", "2", "-pp", "1", "-dp", "1", "-pcp", "1",
                                      "-dcp", "1", "--gpu-memory-utilization", "0.5", "--max-model-len", "256",
                                      "--enforce-eager", "--api-key", "k", "--port", "0"])
    assert (args.model_tag, args.tp, args.gpu_memory_utilization, args.max_model_len) == \
        ("builtin:tiny-llama", 2, 0.5, 256)
    assert args.enforce_eager is True and args.async_scheduling is True and args.api_key == "k"


@pytest.mark.parametrize("layout", [["-pcp", "2"], ["-dp", "2", "-pp", "2", "--data-parallel-lockstep"]])
def test_serve_turns_its_async_default_off_for_layouts_that_cannot_run_it(monkeypatch, capsys, layout):
    import graphrunner.engine.llm as llm_module
    from graphrunner.engine import serve_cli

    taken: dict = {}

    def fake_llm(**kwargs):
        taken.update(kwargs)
        raise ValueError("stop here")

    monkeypatch.setattr(llm_module, "LLM", fake_llm)
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    args = build_parser().parse_args(["serve", "builtin:tiny-llama", "--device", "cpu", *layout])
    with pytest.raises(SystemExit, match="stop here"):
        serve_cli.run(args)
    assert taken["async_scheduling"] is False and "async scheduling off" in capsys.readouterr().err


def test_unknown_flag_prints_the_subcommand_usage(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--bogus"])
    err = capsys.readouterr().err
    assert "usage: graphrunner generate" in err and "unrecognized arguments: --bogus" in err


def test_trust_remote_code_is_refused_with_the_reason():
    with pytest.raises(SystemExit, match="--trust-remote-code is refused: graphrunner runs no Python code"):
        main(["generate", "--trust-remote-code", "--device", "cpu"])


def test_generate_json_with_stop_ids_logprobs_and_n(capsys):
    pytest.importorskip("graphrunner.runner")
    assert main(["generate", "--device", "cpu", "--num-prompts", "2", "--prompt-len", "4", "--max-tokens", "3",
                 "--n", "2", "--logprobs", "1", "--stop-token-ids", "7", "--max-num-seqs", "4",
                 "--max-num-batched-tokens", "32", "--max-model-len", "32", "--num-kv-blocks", "16", "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["kind"] == "generate" and data["num_prompts"] == 2 and data["max_model_len"] == 32
    assert set(data["startup_seconds"]) == {"load", "compile", "capture"} and data["startup_seconds"]["load"] > 0
    assert [len(o["completions"]) for o in data["outputs"]] == [2, 2]
    assert all(c["cumulative_logprob"] is not None for o in data["outputs"] for c in o["completions"])
    assert "warm-up run (untimed" in captured.err and "timed run: 2 prompts" in captured.err
