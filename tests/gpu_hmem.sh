#!/bin/bash
# A GPU case on the fabric path with the receive segment and send region in
# GPU memory, registered with the provider (FI_HMEM), against a libfabric
# built with CUDA: FERRY_HMEM_LIBFABRIC names its lib folder (see
# docs/benchmarks.md, "GPU memory on the fabric path"). The case fails
# unless every rank says its regions are GPU memory registered with
# FI_HMEM (FERRY_HMEM_BOTH, FERRY_HMEM_FWD: see below). Exits 77 (skip) saying why where there is no GPU or no such
# libfabric. Usage: tests/gpu_hmem.sh COMMAND...   ($B: the build folder)
why=$("$B/bin/ferry-info" --cuda 2>&1)
if [ $? -ne 0 ]; then
  echo "skipped: no usable GPU here: $why"
  exit 77
fi
lf=${FERRY_HMEM_LIBFABRIC:-}
if [ -z "$lf" ] || [ ! -e "$lf/libfabric.so.1" ]; then
  echo "skipped: FERRY_HMEM_LIBFABRIC='$lf' names no libfabric built with CUDA" \
       "(Debian's libfabric 1.17 cannot register GPU memory)"
  exit 77
fi
export LD_LIBRARY_PATH="$lf${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
expect=${FERRY_HMEM_EXPECT:-gpu}
export FERRY_TRANSPORT=fabric
if [ "$expect" = host ]; then export FERRY_FABRIC_HMEM=auto; else export FERRY_FABRIC_HMEM=on; fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
FERRY_LOG=INFO FERRY_LOG_SUBSYS=INIT "$@" >> "$log" 2>&1  # O_APPEND: ranks append whole lines
rc=$?
grep -v "INFO" "$log" | tail -25
n=$(grep -o "in GPU [0-9]* memory, registered with FI_HMEM" "$log" | wc -l)
h=$(grep -o "in pinned host memory" "$log" | wc -l)
echo "gpu_hmem: $n rank(s) with GPU memory registered with FI_HMEM, $h with host memory"
grep -m1 -E "registered with FI_HMEM|in pinned host memory" "$log"
[ $rc -eq 0 ] || exit $rc
# FERRY_HMEM_BOTH=N: exactly N processes must also have peers on both paths
# (IPC inside a node, the fabric between nodes; a log line starts
# host:pid:rank)
if [ -n "${FERRY_HMEM_BOTH:-}" ]; then
  b=$(grep -o "[^ ]*:[0-9]*:[0-9]* ferry INFO peers on both paths" "$log" | cut -d' ' -f1 | sort -u | wc -l)
  echo "gpu_hmem: $b rank(s) with peers on both paths (want $FERRY_HMEM_BOTH)"
  grep -m1 "peers on both paths" "$log"
  [ "$b" -eq "$FERRY_HMEM_BOTH" ] || exit 1
fi
# FERRY_HMEM_FWD=N: exactly N processes must forward between nodes (the
# CUDA engine's "forwarding between" line; each process says it once per
# context)
if [ -n "${FERRY_HMEM_FWD:-}" ]; then
  f=$(grep -o "[^ ]*:[0-9]*:[0-9]* ferry INFO cuda_ht: forwarding between" "$log" | cut -d' ' -f1 | sort -u | wc -l)
  echo "gpu_hmem: $f rank(s) forwarding between nodes (want $FERRY_HMEM_FWD)"
  grep -m1 "forwarding between" "$log"
  [ "$f" -eq "$FERRY_HMEM_FWD" ] || exit 1
fi
if [ "$expect" = host ]; then
  [ "$h" -ge 1 ] && [ "$n" -eq 0 ] && exit 0
  echo "FAIL: expected every rank to fall back to pinned host memory"
  exit 1
fi
if [ "$n" -lt 1 ] || [ "$h" -gt 0 ]; then
  echo "FAIL: a rank kept its fabric regions in host memory"
  exit 1
fi
