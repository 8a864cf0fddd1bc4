#!/usr/bin/env bash
# The test suite under another torch, in its own venv:
#
#     bash bench/compat.sh 2.11.0                 # the GPU machine's torch
#     bash bench/compat.sh 2.15.0 -m "not slow"   # extra arguments go to pytest
#
# The registry's wheels for most versions are CUDA builds (several GB); they run on a CPU.
# The venv is kept at ${COMPAT_DIR:-/tmp/compiletune-compat}/torch-VERSION (reused when it
# exists). The last lines of the log and pytest's outcome are written to
# bench/results/compat-torch-VERSION.txt; the README's compatibility line quotes them.
set -euo pipefail
version="${1:?usage: bench/compat.sh TORCH_VERSION [pytest args...]}"
shift
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${COMPAT_DIR:-/tmp/compiletune-compat}/torch-$version"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet "torch==$version"
    # the project and its test extras against that torch (pip keeps the installed torch)
    "$venv/bin/python" -m pip install --quiet -e "$root[dev]"
fi
installed="$("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
log="$venv/pytest.log"
cd "$root"
set +e
# its own temporary folder: two versions can run side by side
"$venv/bin/python" -m pytest -q -p no:cacheprovider --basetemp "$venv/pytest-tmp" "$@" >"$log" 2>&1
status=$?
set -e
out="$root/bench/results/compat-torch-$version.txt"
{
    echo "torch $installed, $(date -u +%Y-%m-%d), commit $(git rev-parse --short HEAD), pytest $*"
    echo "exit status $status"
    grep -E "^(FAILED|ERROR) " "$log" || true
    tail -n 1 "$log"
} >"$out"
cat "$out"
exit "$status"
