#!/bin/bash
# Usage: tests/launcher_kill.sh BUILD PROVIDER
# Kills a local launcher (SIGKILL: it can clean nothing up; its ranks die
# with it) in the middle of a forced-fabric run on PROVIDER, then starts a
# second job: afterwards no region in /dev/shm may belong to a process
# that is gone (the next job sweeps what the killed one left).
set -u
B=$1; P=$2
gone() {  # regions named ferry.<pid>. or ferry-<pid>- whose pid is gone
  ls /dev/shm 2>/dev/null | grep -E '^ferry[.-][0-9]+[.-]' | while read -r f; do
    pid=$(echo "$f" | sed -E 's/^ferry[.-]([0-9]+)[.-].*/\1/')
    st=$(ps -o stat= -p "$pid" 2>/dev/null)
    case "$st" in ''|Z*|X*) echo "$f";; esac
  done
}
run() { FI_PROVIDER=$P FERRY_TIMEOUT_MS=10000 "$B/bin/ferry-bench" --launcher fork \
          --transport fabric --experts 12 --topk 4 --hidden 256 --tokens 16 "$@"; }
(exec env FI_PROVIDER=$P FERRY_TIMEOUT_MS=10000 "$B/bin/ferry-bench" --launcher fork \
   --transport fabric --experts 12 --topk 4 --hidden 256 --tokens 16 \
   -n 3 --iters 100000 --warmup 0 -q > /dev/null 2>&1) &
launcher=$!
# wait until the ranks have their regions
for i in $(seq 100); do
  n=$(for c in $(pgrep -P "$launcher"); do ls /dev/shm | grep -E "^ferry[.-]$c[.-]"; done | wc -l)
  [ "$n" -ge 3 ] && break
  sleep 0.1
done
sleep 0.5
kill -9 "$launcher"
wait "$launcher" 2>/dev/null
sleep 1  # the ranks die with their launcher (parent-death signal)
if pgrep -f "iters 100000" > /dev/null; then echo "launcher_kill: ranks outlived the launcher"; exit 1; fi
left=$(gone | wc -l)
echo "launcher_kill: killed launcher $launcher; $left region(s) of dead processes in /dev/shm"
run -n 2 --iters 3 --warmup 0 -q || { echo "launcher_kill: second job failed"; exit 1; }
after=$(gone)
if [ -n "$after" ]; then
  echo "launcher_kill: left behind after the next job:"; echo "$after"; exit 1
fi
echo "launcher_kill: the next job removed them (none left)"
