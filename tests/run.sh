#!/bin/bash
# Run every test case listed in tests/cases/*.txt against the build folder
# given as $1 (default: build). A case line is:   name | command
# The command runs from the repository root with $B set to the build folder.
# Each case gets a hard time limit (FERRY_TEST_LIMIT_S, default 240 s; a
# command that starts with LIMIT_S=N gets N instead); a case that exceeds
# it fails.
# Prints one line per case and closes with "N passed, N failed".
set -u
B=${1:-build}
export B
cd "$(dirname "$0")/.."
LIMIT=${FERRY_TEST_LIMIT_S:-240}
FILTER=${FERRY_TEST_FILTER:-}
pass=0; fail=0; skip=0; ran=0; failed=()
logdir=$B/test-logs; mkdir -p "$logdir"
while IFS= read -r line; do
  case "$line" in ''|'#'*) continue;; esac
  name=$(echo "${line%%|*}" | xargs)
  cmd=${line#*|}
  limit=$LIMIT
  if [[ "$cmd" =~ ^[[:space:]]*LIMIT_S=([0-9]+)[[:space:]]+(.*)$ ]]; then
    limit=${BASH_REMATCH[1]}; cmd=${BASH_REMATCH[2]}
  fi
  if [ -n "$FILTER" ] && ! echo "$name" | grep -qE "$FILTER"; then continue; fi
  start=$(date +%s%N)
  # Each case runs in its own session, so whatever it leaves behind can be
  # found (and killed) without touching anything else on the machine.
  sidfile=$(mktemp)
  CMD="$cmd" LIMIT="$limit" SIDFILE="$sidfile" setsid -w bash -c \
    'echo $$ > "$SIDFILE"; exec timeout -k 5 "$LIMIT" bash -c "$CMD"' \
    > "$logdir/$name.log" 2>&1 < /dev/null
  rc=$?
  sid=$(cat "$sidfile"); rm -f "$sidfile"
  ms=$(( ($(date +%s%N) - start) / 1000000 )); t="$((ms/1000)).$(( (ms%1000)/100 ))"
  if [ $rc -eq 77 ]; then
    # exit 77: the case cannot run here (no GPU); it says why
    skip=$((skip+1)); echo "SKIP  $name  ($(tail -n 1 "$logdir/$name.log"))"
  elif [ $rc -eq 0 ]; then
    pass=$((pass+1)); echo "PASS  $name  (${t}s)"
  else
    fail=$((fail+1)); failed+=("$name"); echo "FAIL  $name  (rc=$rc, ${t}s)"
    tail -n 30 "$logdir/$name.log" | sed 's/^/    | /'
  fi
  # no ranks may be left behind by any case
  # processes of the case's session still alive (zombies are already dead);
  # one that is just exiting gets a second to finish
  ran=$((ran+1))
  for nap in 0 0.1 0.2 0.5 1; do
    sleep "$nap"
    left=$(ps -e -o pid=,sid=,stat= 2>/dev/null | awk -v s="$sid" '$2 == s && $3 !~ /^Z/ {print $1}' | xargs)
    [ -z "$left" ] && break
  done
  if [ -n "$sid" ] && [ -n "$left" ]; then
    echo "    left-over processes after $name: $(ps -o pid=,args= -p $(echo $left | tr ' ' ,) | head -5)"
    pkill -9 -s "$sid" || true
    # the case counts once: a pass with left-overs is a failure
    if [ $rc -eq 0 ]; then pass=$((pass-1)); fail=$((fail+1));
    elif [ $rc -eq 77 ]; then skip=$((skip-1)); fail=$((fail+1)); fi
    failed+=("$name(leftover)")
  fi
done < <(cat tests/cases/*.txt)
# every selected case ran (a case that read stdin once ate the rest)
want=$(cat tests/cases/*.txt | grep -v '^[[:space:]]*#' | grep -c '|' )
if [ -z "${FERRY_TEST_FILTER:-}" ] && [ "$ran" -ne "$want" ]; then
  echo "ran $ran cases, tests/cases lists $want"
  fail=$((fail+1)); failed+=("(cases not run)")
fi
[ ${#failed[@]} -gt 0 ] && echo "failed: ${failed[*]}"
if [ $skip -gt 0 ]; then echo "$pass passed, $fail failed, $skip skipped"
else echo "$pass passed, $fail failed"; fi
[ $fail -eq 0 ]
