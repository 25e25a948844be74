#!/bin/bash
# Fault scenarios on the namespace cluster (tests/cluster.sh), with their
# assertions. Usage: tests/cluster_check.sh kill|linkdown|absent|nics|nicdown
# ($B: the build folder)
set -u
B=${B:-build}
cd "$(dirname "$0")/.."
mode=$1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export FERRY_TIMEOUT_MS=3000 FERRY_BOOTSTRAP_TIMEOUT_MS=3000
fail=0
bad() { echo "FAILED: $*"; fail=1; }
# the cluster, or this case's skip (exit 77, the reason printed) where it
# cannot be built here (not root, no iproute2): no rank ran then (a rank
# that exits 77 is a failure like any other)
cluster() {
  tests/cluster.sh "$@"
  local rc=$?
  if [ $rc -eq 77 ] && ! ls "$out"/rank.*.rc > /dev/null 2>&1; then exit 77; fi
  return $rc
}
case "$mode" in
kill)   # rank 5 (host 2 of 4) dies in round 5; everyone else names it
  mkdir -p "$out/v"
  FERRY_TEST_DIR="$out/v" cluster -H 4 -R 2 -t 60 -o "$out" -- \
    "$PWD/$B/tests/mp/test_ep" -n 8 kill 5 dispatch
  for r in $(seq 0 7); do
    rc=$(cat "$out/rank.$r.rc" 2>/dev/null || echo none)
    if [ $r -eq 5 ]; then [ "$rc" = 137 ] || bad "victim rank 5 exited $rc"
    else
      [ "$rc" = 0 ] || bad "rank $r exited $rc"
      [ "$(cat "$out/v/rank.$r" 2>/dev/null)" = ok ] || bad "rank $r verdict: $(cat "$out/v/rank.$r" 2>/dev/null)"
    fi
  done;;
linkdown)  # host 1's link goes down mid-run: host 0 names ranks 2,3
  cluster -H 2 -R 2 -t 60 -o "$out" --down 1:2 -- \
    "$PWD/$B/bin/ferry-bench" --experts 16 --topk 4 --hidden 256 --tokens 16 \
    --iters 1000000 --warmup 0
  for r in 0 1 2 3; do
    rc=$(cat "$out/rank.$r.rc" 2>/dev/null || echo none)
    secs=$(cat "$out/rank.$r.secs" 2>/dev/null || echo 999)
    { [ "$rc" != 0 ] && [ "$rc" != 124 ] && [ "$rc" != none ]; } || bad "rank $r exited $rc"
    # link down at 2 s; a wait, then the closing handshake, each bounded
    [ "$secs" -le $((2 + 2 * FERRY_TIMEOUT_MS / 1000 + 4)) ] || bad "rank $r took ${secs}s"
  done
  for r in 0 1; do
    grep -qE "ranks? ([0-9]+,)*[23]([^0-9]|$)" "$out/rank.$r.log" || bad "rank $r does not name rank 2 or 3"
  done;;
absent)  # rank 3 never starts: the others fail at start-up naming it
  cluster -H 2 -R 2 -t 60 -o "$out" --absent 3 -- \
    "$PWD/$B/bin/ferry-bench" --experts 16 --topk 4 --hidden 256 --tokens 16 --iters 5
  for r in 0 1 2; do
    rc=$(cat "$out/rank.$r.rc" 2>/dev/null || echo none)
    { [ "$rc" != 0 ] && [ "$rc" != 124 ]; } || bad "rank $r exited $rc"
  done
  grep -q "rank 3" "$out/rank.0.log" || bad "rank 0 does not name rank 3";;
nics)  # two links per host: peers sharded across both, both carry data
  cluster -H 2 -R 2 -t 60 -o "$out" --nics 2 -- \
    "$PWD/$B/bin/ferry-bench" --experts 16 --topk 4 --hidden 1024 --tokens 32 \
    --dtype mixed --routing zipf:1.2 --iters 30 --warmup 0 || bad "ranks failed"
  for l in eth0 eth1; do
    tx=$(awk -v l=$l '$1 == "host0" && $2 == l {print $6}' "$out/links.txt")
    [ "${tx:-0}" -gt 100000 ] || bad "host0 $l carried ${tx:-0} bytes"
  done;;
nicdown)  # host 1's second link is down before start-up: all on eth0, exact
  cluster -H 2 -R 2 -t 60 -o "$out" --nics 2 --nic1-down 1 -- \
    "$PWD/$B/bin/ferry-bench" --experts 16 --topk 4 --hidden 1024 --tokens 32 \
    --dtype mixed --routing zipf:1.2 --iters 30 --warmup 0 || bad "ranks failed"
  tx=$(awk '$1 == "host0" && $2 == "eth0" {print $6}' "$out/links.txt")
  [ "${tx:-0}" -gt 100000 ] || bad "host0 eth0 carried ${tx:-0} bytes"
  tx=$(awk '$1 == "host1" && $2 == "eth1" {print $6}' "$out/links.txt")
  [ "${tx:-1}" -lt 10000 ] || bad "host1's downed eth1 carried ${tx} bytes";;
*) echo "usage: $0 kill|linkdown|absent|nics|nicdown"; exit 2;;
esac
for r in $(ls "$out" | sed -n 's/^rank\.\([0-9]*\)\.log$/\1/p' | sort -n); do
  echo "--- rank $r (exit $(cat "$out/rank.$r.rc" 2>/dev/null))"; tail -n 3 "$out/rank.$r.log"
done
[ $fail -eq 0 ] && echo "cluster $mode: passed"
exit $fail
