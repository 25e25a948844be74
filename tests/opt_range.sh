#!/bin/bash
# Usage: tests/opt_range.sh BUILD
# Every integer option of ferry-bench and ferry-signal-bench is a whole
# number in range or refused, exit status 2, naming the option: a cast of
# strtol's long wrapped (-n 4294967298 ran 2 ranks, --experts 4294967304
# ran 8, --peers 4294967297 ran 1) and atoi took "2x" as 2. Each run is
# small and bounded, so one that is not refused ends soon and fails here.
set -u
B=$1
bad=0
# expect TEXT COMMAND...: exit status 2 and TEXT in the last line
expect() {
  local want=$1; shift
  local out rc
  out=$(timeout 60 "$@" 2>&1 < /dev/null); rc=$?
  if [ $rc -eq 2 ] && echo "$out" | tail -1 | grep -qF -- "$want"; then
    echo "ok    ${*:2}: $(echo "$out" | tail -1)"
  else
    echo "FAIL  ${*:2}: exit $rc, want 2 and '$want'; got: $(echo "$out" | tail -2)"
    bad=1
  fi
}
FB=("$B/bin/ferry-bench" --launcher fork -q)
SMALL=(--experts 8 --topk 2 --hidden 256 --tokens 4 --iters 1 --warmup 0)
expect "--ranks 4294967298: a whole number, 1..4096" "${FB[@]}" -n 4294967298 "${SMALL[@]}"
expect "--ranks 2x: a whole number" "${FB[@]}" -n 2x "${SMALL[@]}"
expect "--ranks 4097: a whole number, 1..4096" "${FB[@]}" -n 4097 "${SMALL[@]}"
expect "--experts 4294967304: a whole number" "${FB[@]}" -n 2 --topk 2 --hidden 256 \
  --tokens 4 --iters 1 --warmup 0 --experts 4294967304
expect "--peers 4294967297: a whole number" "$B/bin/ferry-bench" --transport null \
  --peers 4294967297 --iters 1 --warmup 0
expect "--topk 4294967298: a whole number" "${FB[@]}" -n 2 "${SMALL[@]}" --topk 4294967298
expect "--hidden 4294967552: a whole number" "${FB[@]}" -n 2 "${SMALL[@]}" --hidden 4294967552
expect "--tokens 4,4294967297: numbers, separated by commas" "${FB[@]}" -n 2 "${SMALL[@]}" \
  --tokens 4,4294967297
expect "--iters 4294967297: a whole number" "${FB[@]}" -n 2 "${SMALL[@]}" --iters 4294967297
expect "--warmup 4294967296: a whole number" "${FB[@]}" -n 2 "${SMALL[@]}" --warmup 4294967296
expect "--seed -1: a whole number" "${FB[@]}" -n 2 "${SMALL[@]}" --seed -1
expect "--seed 18446744073709551616: a whole number" "${FB[@]}" -n 2 "${SMALL[@]}" \
  --seed 18446744073709551616
expect "--sms 4294967312: a whole number" "${FB[@]}" -n 2 "${SMALL[@]}" --sms 4294967312
expect "--ring 4294967297: a whole number" "${FB[@]}" -n 2 "${SMALL[@]}" --mode ht \
  --ring 4294967297
expect "--nodes 4294967298: a whole number" "${FB[@]}" -n 2 "${SMALL[@]}" --nodes 4294967298
expect "--hosts 4294967298: a whole number" "${FB[@]}" -n 2 "${SMALL[@]}" --hosts 4294967298
expect "--dp 4294967298: a whole number" "${FB[@]}" -n 2 "${SMALL[@]}" --dp 4294967298
expect "--routing groups:4294967300:2: use uniform" "${FB[@]}" -n 2 "${SMALL[@]}" \
  --routing groups:4294967300:2
expect "--mask 2: a probability, 0..1" "${FB[@]}" -n 2 "${SMALL[@]}" --mask 2
SB=("$B/bin/ferry-signal-bench" --sizes 4K --iters 1 --warmup 0 -P 2 -M 1)
expect "--ranks 4294967298: a whole number, 2..4096" "${SB[@]}" -n 4294967298
expect "--peers 4294967297: a whole number" "${SB[@]}" -n 2 -P 4294967297
expect "--per-peer 4294967297: a whole number" "${SB[@]}" -n 2 -M 4294967297
expect "--per-peer 2x: a whole number" "${SB[@]}" -n 2 -M 2x
expect "--iters 4294967297: a whole number" "${SB[@]}" -n 2 -i 4294967297
expect "--sizes 1e30: a list like 4K,16K,1M" "${SB[@]}" -n 2 -s 1e30
# the values in range still run
"${FB[@]}" -n 2 "${SMALL[@]}" --seed 18446744073709551615 --mask 0.5 > /dev/null 2>&1 \
  || { echo "FAIL  a run with values in range"; bad=1; }
exit $bad
