#!/bin/bash
# Run a case that needs the libfabric provider FI_PROVIDER names, or exit
# 77 (skip) saying why it cannot run here: libfabric on this machine has
# no such provider offering RDM endpoints with RMA writes.
# Usage: FI_PROVIDER=NAME tests/prov.sh COMMAND...   ($B: the build folder)
prov=${FI_PROVIDER:-}
if [ -z "$prov" ]; then
  echo "prov.sh: set FI_PROVIDER to the provider the case needs"
  exit 2
fi
out=$("$B/bin/ferry-info" 2>&1)
if ! printf '%s\n' "$out" | grep -qF "  $prov (fabric "; then
  lib=$(printf '%s\n' "$out" | grep -m1 '^libfabric' | cut -d' ' -f1-2)
  echo "skipped: ${lib:-libfabric} here has no provider $prov offering RDM endpoints with RMA writes (ferry-info lists what it has)"
  exit 77
fi
exec "$@"
