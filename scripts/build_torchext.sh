#!/bin/bash
# Builds ferry._torchext (python/ferry/_torchext.cpp) against the torch that
# `python3` imports: the high-throughput calls' outputs made in C++ (the
# Python package takes its own path without it). `make pyext` runs this.
# Usage: scripts/build_torchext.sh [PYTHON] [DEST]
#   PYTHON  the interpreter whose torch it is built for (default python3)
#   DEST    the folder of the ferry package it goes into (default
#           python/ferry; an installed one: the folder of ferry.__file__)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-${PYTHON:-python3}}
read -r TI SUF ABI PI TL < <("$PY" - <<'PYEOF'
import os, sysconfig, torch
t = os.path.dirname(torch.__file__)
print(os.path.join(t, "include"), sysconfig.get_config_var("EXT_SUFFIX"),
      int(torch._C._GLIBCXX_USE_CXX11_ABI), sysconfig.get_paths()["include"], os.path.join(t, "lib"))
PYEOF
) || { echo "build_torchext: $PY cannot import torch: ferry._torchext not built"; exit 1; }
DEST=${2:-python/ferry}
[ -d "$DEST" ] || { echo "build_torchext: $DEST: no such folder"; exit 1; }
OUT=$DEST/_torchext$SUF
${CXX:-g++} -O2 -std=c++20 -shared -fPIC -fvisibility=hidden -D_GLIBCXX_USE_CXX11_ABI="$ABI" \
    -Iinclude -I"$TI" -I"$TI/torch/csrc/api/include" -I"$PI" python/ferry/_torchext.cpp \
    -o "$OUT.tmp" -L"$TL" -ltorch -ltorch_cpu -lc10 -ltorch_python -Wl,-rpath,"$TL"
mv "$OUT.tmp" "$OUT"
echo "build_torchext: $OUT"
