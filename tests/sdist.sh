#!/bin/bash
# The sdist builds from itself: `setup.py sdist` of python/ carries
# libferry's sources (native/: Makefile, include/, src/, the symbol map)
# and LICENSE; unpacked alone in a temporary folder, far from the
# repository, pip builds a wheel from it (FERRY_CUDA=0: CPU ranks only, to
# keep the case short), the build happening inside the unpacked tree; the
# wheel, installed into a fresh virtual environment, loads its own
# libferry and passes the native tests over 1 and 3 ranks.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
(cd "$ROOT/python" && python3 setup.py -q sdist -d "$W/dist" > "$W/sdist.log" 2>&1) ||
  { tail -n 20 "$W/sdist.log"; echo "FAIL: setup.py sdist"; exit 1; }
sd=$(ls "$W"/dist/ferry_ep-*.tar.gz)
python3 - "$sd" <<'PY'
import sys, tarfile
names = tarfile.open(sys.argv[1]).getnames()
top = names[0].split("/")[0]
rel = [n[len(top) + 1:] for n in names if n.startswith(top + "/")]
need = ["native/Makefile", "native/include/ferry.h", "native/scripts/libferry.map",
        "native/src/api/create.c", "LICENSE", "setup.py", "pyproject.toml",
        "ferry/__init__.py"]
missing = [n for n in need if n not in rel]
assert not missing, f"missing from the sdist: {missing}"
nc = sum(n.endswith(".c") for n in rel)
ncu = sum(n.endswith(".cu") for n in rel)
objs = [n for n in rel if n.endswith((".o", ".so", ".d"))]
assert nc > 20 and ncu > 0, f"{nc} .c and {ncu} .cu files in the sdist"
assert not objs, f"build outputs in the sdist: {objs[:5]}"
print(f"sdist {top}: {len(rel)} files, {nc} .c and {ncu} .cu")
PY
mkdir -p "$W/x"
tar xzf "$sd" -C "$W/x"
src=$(ls -d "$W"/x/ferry_ep-*)
(cd "$src" && FERRY_CUDA=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w "$W/whl" . \
   > "$W/wheel.log" 2>&1) || { tail -n 30 "$W/wheel.log"; echo "FAIL: pip wheel from the sdist"; exit 1; }
[ -e "$src/native/build/libferry.so" ] ||
  { echo "FAIL: libferry was not built inside the unpacked sdist ($src/native/build)"; exit 1; }
whl=$(ls "$W"/whl/ferry_ep-*.whl)
python3 -c "import sys, zipfile; n = zipfile.ZipFile(sys.argv[1]).namelist(); assert 'ferry/libferry.so' in n, n" "$whl"
"$ROOT/tests/wheel_venv.sh" "$whl" "$W/venv"
cd "$W"
env -u FERRY_LIB -u PYTHONPATH "$W/venv/bin/python" "$ROOT/python/tests/test_native.py" 1 3
echo "sdist $(basename "$sd"): built from itself, installed and tested"
