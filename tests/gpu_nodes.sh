#!/bin/bash
# A GPU case whose ranks have peers on both paths (IPC inside a node, the
# fabric between nodes): runs COMMAND and fails unless it succeeds and
# exactly N processes report both paths ("peers on both paths", the CUDA
# engine's set-up line); N 0 takes the command's status alone (a case
# whose ranks fail on purpose). FERRY_NODES_LINE: another set-up line to
# count instead (e.g. the staged engine's, for high-throughput contexts).
# Exits 77 (skip) saying why where no GPU is usable.
# Usage: tests/gpu_nodes.sh N COMMAND...   ($B: the build folder)
"$(dirname "$0")/gpu.sh" true || exit $? # 77, saying why, without a usable GPU
want=$1
shift
log=$(mktemp)
trap 'rm -f "$log"' EXIT
FERRY_LOG=INFO FERRY_LOG_SUBSYS=INIT "$@" >> "$log" 2>&1  # O_APPEND: ranks append whole lines
rc=$?
grep -v "INFO" "$log" | tail -25
[ "$want" -eq 0 ] && exit $rc
# distinct processes (a log line starts host:pid:rank)
line=${FERRY_NODES_LINE:-peers on both paths}
n=$(grep -o "[^ ]*:[0-9]*:[0-9]* ferry INFO $line" "$log" | cut -d' ' -f1 | sort -u | wc -l)
echo "ranks saying '$line': $n (want $want)"
[ $rc -ne 0 ] && exit $rc
[ "$n" -eq "$want" ] || exit 1
exit 0
