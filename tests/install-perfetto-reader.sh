#!/usr/bin/env bash
# Installs what tests/perfetto_reader.py needs, the tests' independent reader of
# `--perfetto FILE` traces: Perfetto's own generated trace protos (the `perfetto` PyPI
# package ships perfetto_trace_pb2) and Google's protobuf runtime, in a virtualenv in
# hvprobe's cache (tests/integration/perfetto.rs finds it there; HVPROBE_PYTHON overrides). Nothing
# in it downloads at run time: the reader never starts Perfetto's trace processor.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=../guest/cache.sh
. "$here/../guest/cache.sh"
PERFETTO_VERSION=0.59.1
venv="$hvprobe_cache/perfetto-reader"
python="$venv/bin/python"
installed() {
    [ -x "$python" ] && "$python" -c "
import importlib.metadata as m, sys
from perfetto.protos.perfetto.trace import perfetto_trace_pb2
sys.exit(m.version('perfetto') != '$PERFETTO_VERSION')" 2>/dev/null
}
if installed; then
    echo "hvprobe: the Perfetto reader is installed in $venv" >&2
    exit 0
fi
# A virtualenv names its own path in its scripts, so it cannot be built elsewhere and
# renamed: one installer at a time, and the reader's check above (an import of the
# generated protos and the pinned version) stands in for the rename.
cache_lock "$hvprobe_cache/.perfetto-reader.lock" 9 "the Perfetto reader"
if installed; then
    exit 0
fi
echo "hvprobe: installing the Perfetto reader (perfetto==$PERFETTO_VERSION, protobuf) in $venv" >&2
rm -rf "$venv"
python3 -m venv "$venv"
"$python" -m pip install --quiet --disable-pip-version-check "perfetto==$PERFETTO_VERSION" "protobuf>=6.31.1"
installed || { echo "hvprobe: the Perfetto reader in $venv does not import" >&2; exit 1; }
