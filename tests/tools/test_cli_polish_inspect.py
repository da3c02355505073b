"""CLI polish found by trying the commands as a new user would, on a CPU.

`inspect table/explain/simulate` refuse a model that `generate` refuses, with the loader's
message; `--help` shows each default once; `generate` says that builtin weights are random.
"""

from __future__ import annotations

import re

import pytest

from graphrunner.cli import main
from graphrunner.models.loader import load_model_config

# Each dispatch-side subcommand with the least it needs besides --model.
DISPATCH_COMMANDS = {
    "table": [],
    "explain": ["--query-lens", "1,1,7"],
    "simulate": ["--workload", "mixed", "--num-requests", "4"],
}


def _loader_message(model: str) -> str:
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        load_model_config(model)
    return str(info.value)


# ------------------------------------------------------------------ inspect --model
@pytest.mark.parametrize("command", sorted(DISPATCH_COMMANDS))
@pytest.mark.parametrize("model", ["builtin:no-such-model", "missing-folder"])
def test_inspect_refuses_an_unknown_model(command, model, tmp_path):
    if model == "missing-folder":
        model = str(tmp_path / "no-such-folder")
    with pytest.raises(SystemExit) as info:
        main(["inspect", command, "--model", model, *DISPATCH_COMMANDS[command]])
    msg = info.value.code
    assert isinstance(msg, str), msg  # a message exits with status 1
    assert "\n" not in msg
    assert msg == f"graphrunner inspect {command}: {_loader_message(model)}"
    assert model in msg


def test_unknown_builtin_lists_the_builtins():
    with pytest.raises(SystemExit) as info:
        main(["inspect", "table", "--model", "builtin:nope"])
    assert "builtin:tiny-llama" in str(info.value.code)


@pytest.mark.parametrize("command", sorted(DISPATCH_COMMANDS))
def test_inspect_accepts_a_known_builtin(command, capsys):
    assert main(["inspect", command, "--model", "builtin:tiny-llama", *DISPATCH_COMMANDS[command]]) == 0
    assert "builtin:tiny-llama" in capsys.readouterr().out


# ------------------------------------------------------------------ --help defaults
def _help_entries(argv: list[str], capsys, monkeypatch) -> dict[str, str]:
    """Each option's help in `argv --help`, keyed by its first flag, on one line."""
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out.split("options:", 1)[1]
    entries: dict[str, str] = {}
    for chunk in re.split(r"\n(?=  -)", text):
        chunk = " ".join(chunk.split())
        if chunk.startswith("-"):
            entries[chunk.split()[0].rstrip(",")] = chunk
    return entries


@pytest.mark.parametrize("argv", [["generate"], ["bench", "latency"], ["inspect", "table"]])
def test_help_shows_each_default_once(argv, capsys, monkeypatch):
    entries = _help_entries(argv, capsys, monkeypatch)
    assert "--device" in entries and "--model" in entries
    for flag, entry in entries.items():
        assert entry.count("(default:") <= 1, entry
        assert "(default: None)" not in entry and "(default: False)" not in entry, entry
        if entry.endswith(")") and "(default: " in entry:
            said = entry[: entry.rindex("(default: ")]
            assert not re.search(r"\bunset\b|\bdefault: ", said), f"{flag} says its default twice: {entry}"
    assert entries["--device"].endswith("default: cuda if available, else cpu")


def test_generate_help_keeps_the_defaults_it_does_not_say(capsys, monkeypatch):
    entries = _help_entries(["generate"], capsys, monkeypatch)
    assert entries["--model"].endswith("(default: builtin:tiny-llama)")
    assert entries["--max-tokens"].endswith("(default: 32)")
    assert entries["--warmup"].endswith("(default: True)")
    assert entries["--enforce-eager"].endswith("(default: graphs on CUDA, eager on CPU)")


# ------------------------------------------------------------------ generate summary
def test_generate_says_builtin_weights_are_random(capsys):
    pytest.importorskip("graphrunner.runner")
    assert main(["generate", "--device", "cpu", "--num-prompts", "2", "--prompt-len", "4", "--max-tokens", "2",
                 "--num-kv-blocks", "16", "--max-model-len", "64", "--no-warmup"]) == 0
    out = capsys.readouterr().out
    assert "weights:          random (builtin:tiny-llama has no checkpoint; tokens are meaningless)" in out
