"""docs/environment.md lists exactly the environment variables the package reads.

The package's variables are the `GRAPHRUNNER_*` names written in the source of `graphrunner/`
and `capture/` (code, docstrings and comments alike: a name a user is told about must be
documented too). The test-only variables named in `tests/` must appear in the document's
"Tests only" section.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bGRAPHRUNNER_[A-Z0-9_]*[A-Z0-9]\b")
DOC = ROOT / "docs" / "environment.md"


def _names_in(*folders: str) -> set[str]:
    paths = [path for folder in folders for path in (ROOT / folder).rglob("*.py")]
    return {name for path in paths for name in NAME.findall(path.read_text())}


def test_every_variable_the_package_reads_is_documented_and_nothing_else():
    package = _names_in("graphrunner", "capture")
    doc_text = DOC.read_text()
    package_section, _, tests_section = doc_text.partition("## Tests only")
    documented = set(NAME.findall(package_section))
    assert package - documented == set(), "read by the package, missing from docs/environment.md"
    assert documented - package == set(), "in docs/environment.md, read nowhere in the package"
    test_only = _names_in("tests") - package
    assert test_only <= set(NAME.findall(tests_section)), "read by the tests, missing from 'Tests only'"
