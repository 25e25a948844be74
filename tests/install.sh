#!/bin/bash
# make install into a fresh prefix, then the C example (examples/hello_ep.c)
# built against it twice, through pkg-config and through CMake's
# find_package(ferry), each run on one rank and on three (the rendezvous
# over loopback), every output checked by the example (#wrong 0).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
[ "$B" = build ] || { echo "skipped: installs the release build only (a sanitizer build needs its runtime in every program)"; exit 77; }
P=$(mktemp -d)
trap 'rm -rf "$P"' EXIT
make -s BUILD="$B" install PREFIX="$P/prefix" > "$P/install.log" 2>&1 || { tail -20 "$P/install.log"; exit 1; }
for f in include/ferry.h lib/libferry.so lib/libferry.so.0 lib/libferry.a bin/ferry-bench \
         lib/pkgconfig/ferry.pc lib/cmake/ferry/ferryConfig.cmake; do
  [ -e "$P/prefix/$f" ] || { echo "FAIL: make install left no $f"; exit 1; }
done
run() { # run BINARY: one rank, then three
  LD_LIBRARY_PATH=$P/prefix/lib FERRY_RANK=0 FERRY_WORLD_SIZE=1 "$1" || return 1
  port=$(python3 "$ROOT/tools/free_port.py")
  pids=""
  for r in 0 1 2; do
    LD_LIBRARY_PATH=$P/prefix/lib FERRY_RANK=$r FERRY_WORLD_SIZE=3 FERRY_ROOT=127.0.0.1:$port \
      FERRY_SECRET=install-test-secret-0123456789 "$1" & pids="$pids $!"
  done
  rc=0; for p in $pids; do wait "$p" || rc=1; done
  return $rc
}
export PKG_CONFIG_PATH=$P/prefix/lib/pkgconfig
cc -std=c11 examples/hello_ep.c $(pkg-config --cflags --libs ferry) -lm -o "$P/hello_pc" ||
  { echo "FAIL: the example did not build through pkg-config"; exit 1; }
readelf -d "$P/hello_pc" | grep -q "NEEDED.*\[libferry.so.0\]" || { echo "FAIL: not linked to libferry.so.0"; exit 1; }
run "$P/hello_pc" || { echo "FAIL: the pkg-config build failed its checks"; exit 1; }
echo "pkg-config: built, linked to libferry.so.0, #wrong 0 on 1 and 3 ranks"
if ! command -v cmake > /dev/null; then
  echo "FAIL: cmake is not installed (scripts/setup.sh installs it)"; exit 1
fi
mkdir -p "$P/cm"
cat > "$P/cm/CMakeLists.txt" <<CM
cmake_minimum_required(VERSION 3.16)
project(hello_ep C)
find_package(ferry 0.1 REQUIRED)
add_executable(hello_ep $ROOT/examples/hello_ep.c)
target_link_libraries(hello_ep PRIVATE ferry::ferry m)
CM
cmake -S "$P/cm" -B "$P/cm/b" -DCMAKE_PREFIX_PATH="$P/prefix" > "$P/cmake.log" 2>&1 &&
  cmake --build "$P/cm/b" >> "$P/cmake.log" 2>&1 || { tail -20 "$P/cmake.log"; echo "FAIL: the CMake build"; exit 1; }
run "$P/cm/b/hello_ep" || { echo "FAIL: the CMake build failed its checks"; exit 1; }
echo "CMake find_package(ferry): built, #wrong 0 on 1 and 3 ranks"
