#!/bin/sh
# Forwarding against the flat path in one run each (ferry-bench --forward
# on / off, same workload): both exact, and the bytes a rank wrote to
# fabric peers with forwarding at most RATIO of the flat path's, dispatch
# and combine (the counters, ferry_ep_stats_t.bytes); the rows the routing
# sends over the fabric fewer too.
# usage: tests/fwd_bytes.sh RATIO ferry-bench args...
ratio=$1; shift
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
"$@" --forward on --json "$d/on.json" || { echo "forward on failed"; exit 1; }
"$@" --forward off --json "$d/off.json" -q || { echo "forward off failed"; exit 1; }
key() { sed -n "s/.*\"$1\": \([^,}]*\).*/\1/p" "$2"; }
for f in on off; do
  echo "$f: forward $(key forward $d/$f.json), dispatch $(key fabric_bytes_dispatch $d/$f.json) B, combine $(key fabric_bytes_combine $d/$f.json) B, rows $(key fabric_rows $d/$f.json), wrong $(key wrong $d/$f.json)"
done
[ "$(key forward "$d/on.json")" = true ] || { echo "forward on did not forward"; exit 1; }
[ "$(key forward "$d/off.json")" = false ] || { echo "forward off forwarded"; exit 1; }
awk -v r="$ratio" -v d1="$(key fabric_bytes_dispatch "$d/on.json")" -v d0="$(key fabric_bytes_dispatch "$d/off.json")" \
    -v c1="$(key fabric_bytes_combine "$d/on.json")" -v c0="$(key fabric_bytes_combine "$d/off.json")" \
    -v r1="$(key fabric_rows "$d/on.json")" -v r0="$(key fabric_rows "$d/off.json")" 'BEGIN {
  if (d0 <= 0 || c0 <= 0) { print "no fabric bytes on the flat path"; exit 1 }
  printf "forwarded / flat: dispatch %.3f, combine %.3f, rows %.3f (want <= %s)\n", d1 / d0, c1 / c0, r1 / r0, r
  exit !(d1 / d0 <= r && c1 / c0 <= r && r1 < r0)
}'
