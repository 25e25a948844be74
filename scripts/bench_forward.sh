#!/bin/bash
# Forwarding through one rank per node against the flat path, in one run:
# for each workload, ferry-bench --forward on and --forward off back to
# back (REPS times, alternating), one markdown row each: time p50 of
# dispatch and combine, MB a rank wrote to fabric peers per call (the
# largest rank's mean, counters), rows the routing sends over the fabric,
# #wrong. Usage: scripts/bench_forward.sh BUILD [ferry-bench args...]
#   REPS (default 1); the args describe the workload (--nodes, -n, ...)
set -u
B=$1; shift
REPS=${REPS:-1}
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
for r in $(seq 1 "$REPS"); do
  for f in on off; do
    if ! "$B/bin/ferry-bench" "$@" --forward $f --json "$d/$f.json" -q > "$d/$f.out" 2>&1; then
      echo "| forward $f failed: $(tail -n 2 "$d/$f.out" | tr '\n' ' ') |"; continue
    fi
    python3 - "$d/$f.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
print(f"| {j['ranks']} | {j['device']} | {j['routing']} | {'on' if j['forward'] else 'off'} | "
      f"{j['dispatch_p50_us']:.0f} | {j['combine_p50_us']:.0f} | "
      f"{j['fabric_bytes_dispatch'] / 1e6:.2f} | {j['fabric_bytes_combine'] / 1e6:.2f} | "
      f"{j['fabric_rows']:.0f} | {j['wrong']} |")
PY
  done
done
