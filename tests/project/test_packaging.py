"""pyproject.toml lists every package folder, installs tools/ as `graphrunner_tools`, and
ships graphrunner's `py.typed` marker.

setuptools' find cannot install tools/ under another name, so the packages are listed by
hand; this test fails when a folder with an __init__.py is added without its entry.
"""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[2]


def _setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_tools_installs_as_graphrunner_tools():
    config = _setuptools_config()
    assert config["package-dir"] == {"graphrunner_tools": "tools"}
    assert not [p for p in config["packages"] if p == "tools" or p.startswith("tools.")]


def test_every_package_folder_is_listed():
    package_dir = _setuptools_config()["package-dir"]
    on_disk = set()
    for top in ("graphrunner", "capture", "graphrunner_tools"):
        folder = ROOT / package_dir.get(top, top)
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            on_disk.add(".".join((top, *parts)))
    assert sorted(_setuptools_config()["packages"]) == sorted(on_disk)


def test_py_typed_ships_in_the_package():
    assert (ROOT / "graphrunner" / "py.typed").is_file()
    assert "py.typed" in _setuptools_config().get("package-data", {}).get("graphrunner", [])
