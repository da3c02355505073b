#!/usr/bin/env bash
# Host time per decode step, before vs after a change, in one device call: `bench host`
# runs alternately on a baseline tree and on this one (A B B A ...), so that the host's
# drift over minutes hits both alike. The baseline is any older checkout of the project,
# e.g. `git archive <rev> | tar -x -C .baseline` (carried to the device as an ignored folder).
#   tools/host_ab.sh BASELINE_DIR [ROUNDS]      (writes JSON and markdown under $OUT)
set -uo pipefail
BASE="$(cd "${1:?usage: tools/host_ab.sh BASELINE_DIR [ROUNDS]}" && pwd)"
ROUNDS="${2:-2}"
HERE="$PWD"
OUT="$(mkdir -p "${OUT:-out}" && cd "${OUT:-out}" && pwd)"
export PYTHONUNBUFFERED=1
# The command-line tools import as `graphrunner_tools` (the folder tools/ installed under
# that name); for an uninstalled tree a link in a scratch folder stands in for the install.
SHIM="$(mktemp -d)"
bench() {  # bench TREE LABEL
  local path="$1"
  if [ -f "$1/tools/__init__.py" ] && grep -q graphrunner_tools "$1/pyproject.toml"; then
    mkdir -p "$SHIM/$2" && ln -sfn "$1/tools" "$SHIM/$2/graphrunner_tools" && path="$1:$SHIM/$2"
  fi
  (cd "$1" && PYTHONPATH="$path" timeout 200 python3 -c \
    'import sys; from graphrunner.cli import main; sys.exit(main(sys.argv[1:]))' \
    bench host --batch-sizes 1,64,256 --settle-s 10 --markdown "$OUT/host_$2.md" 2>&1 \
    | grep -v "capturing graphs" | tail -9)
}
# Odd rounds run the baseline first, even rounds this tree first: neither always goes second.
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) -eq 1 ]; then
    echo "== round $r: before (baseline)"; bench "$BASE" "before_$r"
    echo "== round $r: after (this tree)"; bench "$HERE" "after_$r"
  else
    echo "== round $r: after (this tree)"; bench "$HERE" "after_$r"
    echo "== round $r: before (baseline)"; bench "$BASE" "before_$r"
  fi
done
