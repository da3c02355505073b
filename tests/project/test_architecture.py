"""The layout rules of docs/architecture.md, checked on the source and on one traced step.

- No import circle among the modules of `graphrunner` and `capture` (every import
  statement counts: module level, inside functions, and under TYPE_CHECKING).
- `capture` imports nothing of `graphrunner`; neither imports the tools (`graphrunner_tools`).
- One steady decode step stays in a few modules: at most 20 files of `graphrunner` and
  `capture` run (traced with `sys.setprofile`), so the step can be read in one sitting.
- At most six `GRAPHRUNNER_*` environment variables are read: kernel choices are
  configuration (`KernelConfig`), not the environment.
- The repository speaks of the product: no record of how work was done.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("graphrunner", "capture")


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


def test_the_library_never_imports_the_tools():
    graph = _graph()  # project modules only: look at the raw import statements instead
    bad = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{name} imports {m}" for m in mods if m.split(".")[0] in ("graphrunner_tools", "tools")]
    assert graph and bad == []


def _steady_decode_files() -> set[str]:
    """The graphrunner / capture files one steady greedy decode step of tiny-llama runs (CPU, eager)."""
    import sys

    from graphrunner.config import CacheConfig, CompilationConfig, LoadConfig, RunnerConfig, SchedulerConfig
    from graphrunner.models.loader import load_model_config
    from graphrunner.protocol import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
    from graphrunner.runner import ModelRunner

    config = RunnerConfig(
        model=load_model_config("builtin:tiny-llama"), load=LoadConfig(model="builtin:tiny-llama", load_format="dummy"),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64),
        cache=CacheConfig(block_size=16, num_blocks=8), compilation=CompilationConfig(enforce_eager=True),
    )
    runner = ModelRunner(config, "cpu")
    runner.load_model()
    runner.initialize_kv_cache(8)
    runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("r", [1, 2, 3], SamplingParams(temperature=0), block_ids=[0])],
        num_scheduled_tokens={"r": 3}, total_num_scheduled_tokens=3,
    ))
    runner.sample_tokens()

    def decode(computed: int) -> SchedulerOutput:
        cached = CachedRequestData(req_ids=["r"], new_block_ids=[None], num_computed_tokens=[computed])
        return SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={"r": 1},
                               total_num_scheduled_tokens=1)

    for computed in (3, 4):  # the second decode step already reuses the decode plan
        runner.execute_model(decode(computed))
        runner.sample_tokens()
    roots = tuple(str(ROOT / pkg) + "/" for pkg in PACKAGES)
    seen: set[str] = set()

    def profile(frame, event, arg) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(roots):
            seen.add(Path(frame.f_code.co_filename).relative_to(ROOT).as_posix())

    sys.setprofile(profile)
    try:
        runner.execute_model(decode(5))
        runner.sample_tokens()
    finally:
        sys.setprofile(None)
    return seen


def test_a_steady_decode_step_stays_in_a_few_files():
    files = _steady_decode_files()
    assert "graphrunner/runner.py" in files and "graphrunner/models/llama.py" in files  # the tracer sees the step
    assert len(files) <= 20, f"{len(files)} files run one steady decode step (at most 20): {sorted(files)}"


def _env_names() -> set[str]:
    """Every GRAPHRUNNER_* name the library's code spells out as a string (the variables it can read)."""
    import re

    pattern = re.compile("^GRAPHRUNNER_[A-Z0-9_]+$")
    names = set()
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.match(node.value):
                names.add(node.value)
    return names


def test_few_environment_variables():
    names = _env_names()
    assert "GRAPHRUNNER_LOGGING_LEVEL" in names  # the scan finds the one every install has
    assert len(names) <= 6, f"{len(names)} GRAPHRUNNER_* variables (at most 6): {sorted(names)}"


# A record of how the work went is not product text. Spelled in pieces so that this file passes.
_PROCESS_WORDS = [
    r"\bsess" + r"ions? \d", r"\bdevice " + r"calls?\b", r"\bcall" + r" \d+\b(?! \w+ args)", r"\bissue" + r" #?\d",
    r"docs/" + r"bench\b", r"\bhel" + r"per agent",
]


def test_no_record_of_the_work_in_the_tree():
    import re

    words = re.compile("|".join(_PROCESS_WORDS), re.IGNORECASE)
    found = []
    for top in (*PACKAGES, "tools", "tests", "docs"):
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in (".py", ".md", ".sh", ".toml", ".txt") and path.is_file():
                for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                    if words.search(line):
                        found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    for name in ("README.md", "pyproject.toml", ".ci/run"):
        for n, line in enumerate((ROOT / name).read_text().splitlines(), 1):
            if words.search(line):
                found.append(f"{name}:{n}: {line.strip()[:100]}")
    assert found == [], f"{len(found)} lines:\n" + "\n".join(found[:40])
