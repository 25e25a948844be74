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
# the compat wheel: the hook at the top of site-packages, the module in
# ferry_deep_ep/; installed beside ferry-ep, `import deep_ep` is ferry's
cw=$(ls "$W"/dist/ferry_deep_ep-*-py3-none-any.whl)
python3 - "$cw" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
need = ["ferry-deep-ep.pth", "ferry_deep_ep/deep_ep/__init__.py", "ferry_deep_ep/_hook.py"]
missing = [n for n in need if n not in names]
assert not missing, f"missing from the compat wheel: {missing}"
assert not any(n.startswith("deep_ep/") for n in names), "the compat wheel installs a deep_ep/ folder"
PY
"$W/venv/bin/python" -m pip install -q --no-deps --force-reinstall "$cw"
if env -u FERRY_LIB -u PYTHONPATH "$W/venv/bin/python" -c "import torch" 2>/dev/null; then
  env -u FERRY_LIB -u PYTHONPATH "$W/venv/bin/python" -c "
import deep_ep, ferry_deep_ep
assert deep_ep.backend == 'ferry' and deep_ep.__version__ == '1.2.1', deep_ep
print('compat wheel $(basename "$cw"): import deep_ep gives ferry\'s (DeepEP API', deep_ep.__version__ + ')')"
else
  echo "compat wheel $(basename "$cw"): installed; import deep_ep not tried (no torch here)"
fi
