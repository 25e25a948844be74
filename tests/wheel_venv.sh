#!/bin/bash
# Install WHEEL into a fresh virtual environment VENV (numpy from the
# system) and check, from outside the tree with no FERRY_LIB or
# PYTHONPATH, that ferry imports from the venv and loads its own
# libferry. Used by tests/wheel.sh, sdist.sh and wheel_bare.sh.
# Usage: tests/wheel_venv.sh WHEEL VENV
set -euo pipefail
whl=$1 venv=$2
python3 -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install -q --no-deps --force-reinstall "$whl"
cd "$(dirname "$venv")"
env -u FERRY_LIB -u PYTHONPATH "$venv/bin/python" - "$venv" <<'PY'
import os, sys, ferry
here = os.path.realpath(ferry.__file__)
assert here.startswith(os.path.realpath(sys.argv[1])), f"ferry imported from {here}, not the venv"
print(f"ferry {ferry._lib_handle().ferry_version_string().decode()} from {os.path.dirname(here)}")
PY
