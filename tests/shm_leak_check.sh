#!/bin/bash
# Usage: tests/shm_leak_check.sh COMMAND...
# Runs COMMAND (a run in which a rank is killed) and fails when it leaves
# shm provider regions (/dev/shm/ferry.<pid>.*) of processes that are gone:
# the launcher must remove a dead rank's regions.
set -u
list() { ls /dev/shm 2>/dev/null | grep '^ferry\.' | sort; }
before=$(list)
"$@"
rc=$?
after=$(list)
leaked=0
for f in $(comm -13 <(echo "$before") <(echo "$after")); do
  pid=$(echo "$f" | cut -d. -f2)
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "shm_leak_check: /dev/shm/$f left by pid $pid, which is gone"
    leaked=$((leaked+1))
  fi
done
[ $rc -ne 0 ] && exit $rc
[ $leaked -ne 0 ] && { echo "shm_leak_check: $leaked region(s) leaked"; exit 1; }
echo "shm_leak_check: no regions left by dead ranks"
exit 0
