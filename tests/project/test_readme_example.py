"""README.md's `ModelRunner` example runs as written on any device (here: the CPU).

The first python block of "## Using it from an engine" is executed with the builtin model
swapped for builtin:tiny-llama, so that the test stays fast; nothing else is changed.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
from pathlib import Path

import pytest

pytest.importorskip("graphrunner.runner")

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## Using it from an engine"
EXAMPLE_MODEL = "builtin:qwen2.5-0.5b"
TEST_MODEL = "builtin:tiny-llama"


def _example() -> str:
    text = README.read_text()
    assert SECTION in text, f"README.md has no {SECTION!r} section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, f"no python code block in README.md's {SECTION!r}"
    return match.group(1)


def test_example_is_device_independent():
    code = _example()
    assert '"cuda")' not in code and "ModelRunner(config, device)" in code
    assert EXAMPLE_MODEL in code


def test_example_runs_on_this_machine():
    code = _example().replace(EXAMPLE_MODEL, TEST_MODEL)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"{README}:{SECTION}", "exec"), {"__name__": "readme_example"})
    sampled = ast.literal_eval(out.getvalue().strip().splitlines()[-1])  # [[token]]
    assert len(sampled) == 1 and len(sampled[0]) == 1 and isinstance(sampled[0][0], int)
