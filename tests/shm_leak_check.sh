#!/bin/bash
# Usage: tests/shm_leak_check.sh COMMAND...
# Runs COMMAND (a run in which a rank is killed) and fails when it leaves
# /dev/shm entries of processes that are gone: EP segments
# (ferry-<pid>-...) and shm provider regions (ferry.<pid>....), the names
# runtime/rt.h lists: the launcher must remove a dead rank's entries.
set -u
list() { ls /dev/shm 2>/dev/null | grep -E '^ferry[.-][0-9]+[.-]' | sort; }
before=$(list)
"$@"
rc=$?
after=$(list)
leaked=0
for f in $(comm -13 <(echo "$before") <(echo "$after")); do
  pid=$(echo "$f" | sed -E 's/^ferry[.-]([0-9]+)[.-].*/\1/')
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "shm_leak_check: /dev/shm/$f left by pid $pid, which is gone"
    leaked=$((leaked+1))
  fi
done
[ $rc -ne 0 ] && exit $rc
[ $leaked -ne 0 ] && { echo "shm_leak_check: $leaked region(s) leaked"; exit 1; }
echo "shm_leak_check: no regions left by dead ranks"
exit 0
