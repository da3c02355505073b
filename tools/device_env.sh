# Sourced by tools/gpu_suite.sh and tools/sanitize.sh, which run from a source checkout without
# installing it: PYTHONPATH gives graphrunner and capture, and a link in a temporary folder gives
# tools/ under its installed name, graphrunner_tools. Logs go under $OUT (default ./out).
links="$(mktemp -d)"
ln -s "$PWD/tools" "$links/graphrunner_tools"
export PYTHONPATH="$PWD:$links" PYTHONUNBUFFERED=1
OUT="${OUT:-out}"; mkdir -p "$OUT"
