"""The layout rules of docs/architecture.md, checked on the source (no imports run).

- No import circle among the modules of `graphrunner` and `capture` (every import
  statement counts: module level, inside functions, and under TYPE_CHECKING).
- `capture` imports nothing of `graphrunner`.
- `graphrunner/runner.py` is the engine API only: at most 350 lines.
- No module over 500 lines and no function over 60 lines, except Triton kernel files
  (their kernels and launchers) and the tests.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("graphrunner", "capture")
# Files whose size comes from Triton kernels (a kernel is one long function by nature).
KERNEL_FILES = {
    "graphrunner/kernels/input_prep.py", "graphrunner/kernels/block_table.py",
    "graphrunner/attention/triton_attn.py", "graphrunner/attention/kv_write.py",
    "graphrunner/sample/triton_sampling.py",
}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (a `from pkg import sub` names the submodule)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from pkg import sub` imports the submodule, else names of pkg
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_capture_imports_nothing_of_graphrunner():
    graph = _graph()
    bad = {m: sorted(d for d in deps if d.startswith("graphrunner")) for m, deps in graph.items()
           if m.startswith("capture")}
    assert {m: d for m, d in bad.items() if d} == {}


def _sources():
    for pkg in (*PACKAGES, "tools"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text()


def test_runner_is_the_engine_api_only():
    lines = (ROOT / "graphrunner/runner.py").read_text().count("\n")
    assert lines <= 350, f"graphrunner/runner.py has {lines} lines (at most 350)"


def test_module_and_function_sizes():
    too_long = []
    for rel, src in _sources():
        if rel in KERNEL_FILES:
            continue
        if src.count("\n") > 500:
            too_long.append(f"{rel}: {src.count(chr(10))} lines (at most 500)")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    too_long.append(f"{rel}:{node.lineno} {node.name}() has {length} lines (at most 60)")
    assert too_long == []
