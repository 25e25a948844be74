#!/bin/bash
# The GPU cases on a GPU machine, in one command: MPS started (several
# ranks share a GPU) and stopped at the end, a libfabric built with CUDA
# for the GPU-memory fabric cases (built from a release tarball into
# $LF_PREFIX when LIBFABRIC_TARBALL names one and $LF_PREFIX has none yet),
# then `tests/run.sh BUILD` on the cases matching FILTER.
#
# Usage: scripts/gpu_check.sh [FILTER] [BUILD]     (default '^gpu', build)
#   LIBFABRIC_TARBALL  libfabric-X.Y.Z.tar.gz to build with --with-cuda
#   LF_PREFIX          where that libfabric goes (default /tmp/lf)
#   FERRY_FABRIC_LIB   a folder of a libfabric (and the libraries it needs)
#                      for the other fabric cases, where the machine has
#                      none installed; the machine's own copies of those
#                      libraries win over the folder's, so the CUDA build
#                      does not load the folder's older ones
#   CASE_LIMIT_S       each case's limit (default 120); TOTAL_S the run's (600)
# ferry._torchext is built (make pyext) where torch imports. Case logs:
# BUILD/test-logs. Without a usable GPU every case says SKIP
# and why.
set -u
cd "$(dirname "$0")/.."
FILTER=${1:-^gpu}
B=${2:-build}
LF_PREFIX=${LF_PREFIX:-/tmp/lf}
t0=$(date +%s)
keep="" src="" mps=0
cleanup() {
  [ "$mps" -eq 1 ] && echo quit | nvidia-cuda-mps-control
  rm -rf "$keep" "$src"
}
trap cleanup EXIT
if [ -n "${FERRY_FABRIC_LIB:-}" ]; then
  [ -d "$FERRY_FABRIC_LIB" ] || { echo "gpu_check: FERRY_FABRIC_LIB=$FERRY_FABRIC_LIB: no such folder"; exit 2; }
  keep=$(mktemp -d)
  for f in "$FERRY_FABRIC_LIB"/*; do
    [ -e "$f" ] || continue
    b=$(basename "$f")
    case "$b" in libfabric.so*) cp -a "$f" "$keep/"; continue;; esac
    # the machine's own copy, where the dynamic linker finds one
    ldconfig -p 2>/dev/null | grep -qF "	$b " || cp -a "$f" "$keep/"
  done
  export LD_LIBRARY_PATH=$keep${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
if [ -n "${LIBFABRIC_TARBALL:-}" ] && [ ! -e "$LF_PREFIX/lib/libfabric.so.1" ]; then
  src=$(mktemp -d)
  echo "gpu_check: building libfabric with CUDA into $LF_PREFIX"
  if ! ( tar xzf "$LIBFABRIC_TARBALL" -C "$src" && cd "$src"/libfabric-* &&
         env -u LD_LIBRARY_PATH ./configure --prefix="$LF_PREFIX" --with-cuda="${CUDA_HOME:-/usr/local/cuda}" \
             --disable-psm3 --disable-opx > "$src/configure.log" 2>&1 &&
         env -u LD_LIBRARY_PATH make -j"$(nproc)" install > "$src/make.log" 2>&1 ); then
    echo "gpu_check: the libfabric build failed: the GPU-memory cases will skip"
    tail -n 5 "$src"/configure.log "$src"/make.log 2>/dev/null
  fi
fi
if [ -e "$LF_PREFIX/lib/libfabric.so.1" ]; then
  export FERRY_HMEM_LIBFABRIC=$LF_PREFIX/lib
  # what the CUDA build links against is found on the machine: drop the
  # folder's copies of those (an older libefa there fails to load it)
  if [ -n "$keep" ]; then
    for b in $(env -u LD_LIBRARY_PATH ldd "$LF_PREFIX/lib/libfabric.so.1" | awk '/=> \//{print $1}'); do
      rm -f "$keep/$b"
    done
  fi
fi
if command -v nvidia-cuda-mps-control > /dev/null && nvidia-cuda-mps-control -d 2>/dev/null; then
  mps=1
fi
"$B/bin/ferry-info" --cuda 2>&1 | head -1
# ferry._torchext against this machine's torch (the Python cases run
# through it; gpu_python_torchext checks it against the Python path)
if python3 -c "import torch" 2>/dev/null; then
  make pyext > /tmp/ferry-pyext.log 2>&1 && echo "gpu_check: ferry._torchext built" ||
    { tail -n 20 /tmp/ferry-pyext.log; echo "gpu_check: ferry._torchext did not build"; }
fi
FERRY_TEST_LIMIT_S=${CASE_LIMIT_S:-120} FERRY_TEST_FILTER="$FILTER" \
  timeout -k 5 "${TOTAL_S:-600}" tests/run.sh "$B" < /dev/null
rc=$?
echo "gpu_check: $(( $(date +%s) - t0 )) s, exit $rc"
exit $rc
