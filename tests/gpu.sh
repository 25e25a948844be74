#!/bin/bash
# Run a GPU case, or exit 77 (skip) saying why it cannot run here.
# FERRY_GPU_EXPECT=PATTERN: the case also fails unless its output (stdout
# and stderr) has a line matching PATTERN (grep -E).
# Usage: tests/gpu.sh COMMAND...   ($B: the build folder)
why=$("$B/bin/ferry-info" --cuda 2>&1)
if [ $? -ne 0 ]; then
  echo "skipped: no usable GPU here: $why"
  exit 77
fi
if [ -z "${FERRY_GPU_EXPECT:-}" ]; then
  exec "$@"
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$@" >> "$log" 2>&1  # O_APPEND: ranks append whole lines
rc=$?
tail -n 25 "$log"
[ $rc -eq 0 ] || exit $rc
if ! grep -qE "$FERRY_GPU_EXPECT" "$log"; then
  echo "gpu.sh: no line matches '$FERRY_GPU_EXPECT'"
  exit 1
fi
echo "gpu.sh: found: $(grep -m1 -E "$FERRY_GPU_EXPECT" "$log")"
