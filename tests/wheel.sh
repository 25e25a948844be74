#!/bin/bash
# The wheel: scripts/wheel.sh builds a manylinux wheel carrying libferry;
# installed into a fresh virtual environment (numpy from the system), the
# package loads its own libferry (no FERRY_LIB, no PYTHONPATH, run from
# outside the tree) and passes the native tests over 1 and 3 ranks.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
"$ROOT/scripts/wheel.sh" "$W/dist"
whl=$(ls "$W"/dist/ferry_ep-*.whl)
case "$(basename "$whl")" in
ferry_ep-*-py3-none-manylinux_*_$(uname -m).whl) ;;
*) echo "FAIL: wheel name $(basename "$whl"): want ferry_ep-<v>-py3-none-manylinux_*_$(uname -m).whl"; exit 1 ;;
esac
python3 - "$whl" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
need = ["ferry/libferry.so", "ferry/__init__.py", "ferry/_lib.py", "ferry/deep_ep.py"]
missing = [n for n in need if n not in names]
grafted = [n for n in names if ".libs/" in n]
assert not missing, f"missing from the wheel: {missing}"
assert not grafted, f"libraries grafted into the wheel (libfabric must stay the system's): {grafted}"
print(f"wheel holds {len(names)} files, libferry.so included, nothing grafted")
PY
"$ROOT/tests/wheel_venv.sh" "$whl" "$W/venv"
cd "$W"
env -u FERRY_LIB -u PYTHONPATH "$W/venv/bin/python" "$ROOT/python/tests/test_native.py" 1 3
echo "wheel $(basename "$whl"): installed and tested"
