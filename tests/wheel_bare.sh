#!/bin/bash
# The wheel on a bare machine, simulated in a mount namespace (unshare -m,
# root): installed into a fresh virtual environment, it runs with no
# compiler to be found (cc, gcc, c++, clang, nvcc, make hidden behind
# /dev/null) and passes the native tests over 1 and 3 ranks; with
# libfabric.so.1 hidden as well, `import ferry` still works and the first
# use of libferry raises an OSError that names libfabric.so.1 and how to
# install it (what `import deep_ep` turns into its ImportError).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
unshare -m true 2>/dev/null || { echo "skipped: no mount namespace here (unshare -m needs root)"; exit 77; }
lf=$(ldconfig -p | awk '/libfabric\.so\.1 / && !f {print $NF; f = 1}')  # no early exit: ldconfig would die of SIGPIPE (pipefail)
[ -n "$lf" ] || { echo "skipped: no system libfabric.so.1 to hide"; exit 77; }
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
"$ROOT/scripts/wheel.sh" "$W/dist" > "$W/wheel.log" 2>&1 || { cat "$W/wheel.log"; exit 1; }
whl=$(ls "$W"/dist/ferry_ep-*.whl)
"$ROOT/tests/wheel_venv.sh" "$whl" "$W/venv"
# what to hide: every compiler on PATH (the files they resolve to) and make
hide=""
for c in cc gcc g++ c++ clang nvcc make; do
  p=$(command -v "$c" 2>/dev/null) && hide="$hide $(readlink -f "$p")"
done
[ -x /usr/local/cuda/bin/nvcc ] && hide="$hide $(readlink -f /usr/local/cuda/bin/nvcc)"
cat > "$W/bare.sh" <<'SH'
set -eu
W=$1 ROOT=$2 LF=$3; shift 3
for f in "$@"; do mount --bind /dev/null "$f"; done
for c in cc gcc nvcc make; do
  if "$c" --version > /dev/null 2>&1; then echo "FAIL: $c still runs"; exit 1; fi
done
cd "$W"
env -u FERRY_LIB -u PYTHONPATH "$W/venv/bin/python" "$ROOT/python/tests/test_native.py" 1 3
mount --bind /dev/null "$(readlink -f "$LF")"
env -u FERRY_LIB -u PYTHONPATH "$W/venv/bin/python" - <<'PY'
import ferry
try:
    ferry._lib_handle()
except OSError as e:
    msg = str(e)
    assert "needs libfabric (libfabric.so.1)" in msg and "apt install libfabric1" in msg, msg
    print("without libfabric: import ferry works; first use: " + msg[:110] + "...")
else:
    raise SystemExit("FAIL: libferry loaded with libfabric hidden")
PY
SH
unshare -m bash "$W/bare.sh" "$W" "$ROOT" "$lf" $hide
echo "wheel $(basename "$whl"): ran with no compiler, and without libfabric named it"
