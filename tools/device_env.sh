# Sourced by the device suites (gpu_suite.sh, gpu_dist.sh, host_suite.sh), which run from
# the repository root without installing it: PYTHONPATH gives graphrunner and capture, and
# a link in a temporary folder gives tools/ under its installed name, graphrunner_tools.
links="$(mktemp -d)"
ln -s "$PWD/tools" "$links/graphrunner_tools"
export PYTHONPATH="$PWD:$links" PYTHONUNBUFFERED=1
OUT="${OUT:-out}"; mkdir -p "$OUT"
