# Sourced by tools/gpu_suite.sh and tools/sanitize.sh, which run from a source checkout without
# installing it. PYTHONPATH gives graphrunner and capture; a temporary folder gives tools/ under its
# installed name, graphrunner_tools, and the distribution's metadata, whose `graphrunner.commands`
# entry points add `bench` and `inspect` to the `graphrunner` command (read from pyproject.toml).
# Logs go under $OUT (default ./out).
links="$(mktemp -d)"
ln -s "$PWD/tools" "$links/graphrunner_tools"
python3 - "$PWD/pyproject.toml" "$links" <<'PY'
import pathlib, sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: rely on an installed distribution's entry points
    sys.exit(0)
project = tomllib.loads(pathlib.Path(sys.argv[1]).read_text())["project"]
info = pathlib.Path(sys.argv[2]) / f"{project['name']}-{project['version']}.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
groups = project.get("entry-points", {})
(info / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in eps.items()) + "\n"
    for group, eps in groups.items()))
PY
export PYTHONPATH="$PWD:$links" PYTHONUNBUFFERED=1
OUT="${OUT:-out}"; mkdir -p "$OUT"
