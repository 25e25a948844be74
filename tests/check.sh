#!/bin/bash
# The whole test suite: build and run every case, then build again with
# AddressSanitizer + UndefinedBehaviorSanitizer and run every case again.
# Closes with one line "N passed, N failed" over both runs.
set -u
cd "$(dirname "$0")/.."
J=${JOBS:-2}
total_pass=0; total_fail=0; total_skip=0
for variant in "build:" "build-san:SAN=1"; do
  B=${variant%%:*}; FLAGS=${variant#*:}
  echo "== building $B ${FLAGS:-(release)}"
  if ! make -j"$J" BUILD="$B" $FLAGS all > "/tmp/ferry-make-$B.log" 2>&1; then
    tail -n 40 "/tmp/ferry-make-$B.log"; echo "build of $B failed"
    total_fail=$((total_fail+1)); continue
  fi
  # CUDA sources must compile wherever nvcc exists, GPU or not.
  if command -v nvcc >/dev/null 2>&1 && [ -z "$FLAGS" ]; then
    if [ -n "$(find src -name '*.cu')" ]; then
      if make BUILD="$B" cuda > "/tmp/ferry-nvcc.log" 2>&1; then echo "nvcc: CUDA kernels compiled"
      else tail -n 30 /tmp/ferry-nvcc.log; total_fail=$((total_fail+1)); fi
    fi
  fi
  # ferry._torchext against the torch installed (the Python cases then
  # run through it; python_torch_cpu_pyonly runs without it)
  if [ -z "$FLAGS" ]; then
    if python3 -c "import torch" 2>/dev/null; then
      if make pyext > /tmp/ferry-pyext.log 2>&1; then echo "pyext: ferry._torchext built"
      else tail -n 30 /tmp/ferry-pyext.log; echo "pyext: the build failed"; total_fail=$((total_fail+1)); fi
    else echo "pyext: torch is not installed: ferry._torchext not built (its cases skip)"; fi
  fi
  echo "== running tests against $B"
  log=$(mktemp)
  tests/run.sh "$B" > "$log" 2>&1
  cat "$log"
  out=$(tail -n 1 "$log"); rm -f "$log"
  p=$(echo "$out" | sed -n 's/^\([0-9]*\) passed, \([0-9]*\) failed.*$/\1/p')
  f=$(echo "$out" | sed -n 's/^\([0-9]*\) passed, \([0-9]*\) failed.*$/\2/p')
  k=$(echo "$out" | sed -n 's/^.* failed, \([0-9]*\) skipped$/\1/p')
  total_pass=$((total_pass+${p:-0})); total_fail=$((total_fail+${f:-1})); total_skip=$((total_skip+${k:-0}))
done
[ $total_skip -gt 0 ] && echo "($total_skip cases skipped; each SKIP line above says why)"
echo "$total_pass passed, $total_fail failed"
[ "$total_fail" -eq 0 ] && [ "$total_pass" -gt 0 ]
