#!/bin/bash
# Run a GPU case, or exit 77 (skip) saying why it cannot run here.
# Usage: tests/gpu.sh COMMAND...   ($B: the build folder)
why=$("$B/bin/ferry-info" --cuda 2>&1)
if [ $? -ne 0 ]; then
  echo "skipped: no usable GPU here: $why"
  exit 77
fi
exec "$@"
