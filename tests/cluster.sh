#!/bin/bash
# A test cluster on one machine: hosts are network namespaces (own UTS name,
# a veth into a bridge, addresses in 10.199.0.0/16), and ranks meet through
# ferry's normal start-up (TCP rendezvous at rank 0's address). Needs root.
#
#   tests/cluster.sh [options] -- COMMAND [ARGS...]
#     -H N            hosts (default 2)
#     -R N            ranks per host (default 4)
#     -t SECONDS      kill everything still running after this (default 300)
#     --nics 2        give every host a second link (eth1, its own bridge
#                     and subnet 10.200.x.0/24); byte counts of every link
#                     are written to DIR/links.txt at the end
#     --nic1-down H   host H's second link is down before the ranks start
#     --down H:SECS   take host H's link down SECS seconds after the start
#     --absent RANK   that rank never starts
#     -o DIR          keep per-rank logs and exit codes there (rank.N.log,
#                     rank.N.rc); default: a temporary folder, removed
#
# Every rank runs COMMAND with FERRY_RANK, FERRY_WORLD_SIZE, FERRY_ROOT and
# FERRY_SECRET (a fresh one per run unless set) set (and FI_PROVIDER=tcp
# unless set). The script always removes what it
# created (namespaces, veths, bridge), also on failure or interrupt, and
# exits with the highest rank exit status (124 when it had to kill ranks).
set -u
H=2; R=4; LIMIT=300; DOWN=""; ABSENT=-1; OUTDIR=""; NICS=1; NIC1DOWN=-1
while [ $# -gt 0 ]; do
  case "$1" in
    -H) H=$2; shift 2;;
    -R) R=$2; shift 2;;
    -t) LIMIT=$2; shift 2;;
    --down) DOWN=$2; shift 2;;
    --absent) ABSENT=$2; shift 2;;
    --nics) NICS=$2; shift 2;;
    --nic1-down) NIC1DOWN=$2; shift 2;;
    -o) OUTDIR=$2; shift 2;;
    --) shift; break;;
    *) echo "cluster.sh: unknown option $1" >&2; exit 2;;
  esac
done
[ $# -gt 0 ] || { echo "cluster.sh: no command" >&2; exit 2; }
if [ "$(id -u)" -ne 0 ]; then echo "cluster.sh: needs root (network namespaces)"; exit 77; fi
command -v ip >/dev/null || { echo "cluster.sh: needs iproute2"; exit 77; }

ID=$(( $$ % 10000 ))
PFX="fr${ID}"
BR="${PFX}b"
SUBNET=$(( 100 + ID % 100 ))         # 10.199.SUBNET.0/24, per run
KEEP=1
if [ -z "$OUTDIR" ]; then OUTDIR=$(mktemp -d); KEEP=0; fi
mkdir -p "$OUTDIR"
PIDS=()

cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill -9 -- -"$p" 2>/dev/null; done
  for h in $(seq 0 $((H - 1))); do
    ip netns del "${PFX}h$h" 2>/dev/null
    ip link del "${PFX}v$h" 2>/dev/null
    ip link del "${PFX}w$h" 2>/dev/null
  done
  ip link del "$BR" 2>/dev/null
  ip link del "${BR}2" 2>/dev/null
  [ $KEEP -eq 0 ] && rm -rf "$OUTDIR"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ip link add "$BR" type bridge || exit 1
ip link set "$BR" up
for h in $(seq 0 $((H - 1))); do
  ns="${PFX}h$h"
  ip netns add "$ns" || exit 1
  ip link add "${PFX}v$h" type veth peer name "${PFX}p$h" || exit 1
  ip link set "${PFX}v$h" master "$BR" up
  ip link set "${PFX}p$h" netns "$ns"
  ip -n "$ns" link set "${PFX}p$h" name eth0
  ip -n "$ns" addr add "10.199.$SUBNET.$((10 + h))/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  if [ "$NICS" -ge 2 ]; then
    [ $h -eq 0 ] && { ip link add "${BR}2" type bridge; ip link set "${BR}2" up; }
    ip link add "${PFX}w$h" type veth peer name "${PFX}q$h" || exit 1
    ip link set "${PFX}w$h" master "${BR}2"
    [ "$h" -ne "$NIC1DOWN" ] && ip link set "${PFX}w$h" up
    ip link set "${PFX}q$h" netns "$ns"
    ip -n "$ns" link set "${PFX}q$h" name eth1
    ip -n "$ns" addr add "10.200.$SUBNET.$((10 + h))/24" dev eth1
    ip -n "$ns" link set eth1 up
  fi
done

PORT=$(( 10000 + RANDOM % 20000 )) # below the kernel's ephemeral range (32768..)
# ranks span hosts: the rendezvous wants a job secret
# (exported, not on a command line, where other users could read it)
export FERRY_SECRET=${FERRY_SECRET:-$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')}
ROOT="10.199.$SUBNET.10:$PORT"
N=$((H * R))
echo "cluster: $H hosts x $R ranks, root $ROOT, logs in $OUTDIR"
start=$(date +%s)
for r in $(seq 0 $((N - 1))); do
  h=$((r / R))
  if [ "$r" -eq "$ABSENT" ]; then echo "cluster: rank $r left out"; continue; fi
  setsid ip netns exec "${PFX}h$h" unshare --uts sh -c \
    'hostname "$0"; exec "$@"' "host$h" \
    env FERRY_RANK=$r FERRY_WORLD_SIZE=$N FERRY_ROOT=$ROOT \
        FI_PROVIDER=${FI_PROVIDER:-tcp} "$@" \
    > "$OUTDIR/rank.$r.log" 2>&1 &
  PIDS+=($!)
  RANKOF[$!]=$r
done

if [ -n "$DOWN" ]; then
  (sleep "${DOWN#*:}"; echo "cluster: taking host ${DOWN%%:*}'s link down";
   ip link set "${PFX}v${DOWN%%:*}" down) &
fi

status=0
for p in "${PIDS[@]}"; do
  left=$(( LIMIT - ($(date +%s) - start) ))
  [ $left -lt 1 ] && left=1
  # wait with a deadline
  for _ in $(seq 1 $((left * 10))); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$p" 2>/dev/null; then
    echo "cluster: rank ${RANKOF[$p]} still running after ${LIMIT}s: killing"
    kill -9 -- -"$p" 2>/dev/null; wait "$p" 2>/dev/null; rc=124
  else
    wait "$p"; rc=$?
  fi
  echo "$rc" > "$OUTDIR/rank.${RANKOF[$p]}.rc"
  echo "$(( $(date +%s) - start ))" > "$OUTDIR/rank.${RANKOF[$p]}.secs"
  [ $rc -gt $status ] && status=$rc
done
: > "$OUTDIR/links.txt"
for h in $(seq 0 $((H - 1))); do
  for l in v w; do
    [ -e "/sys/class/net/${PFX}$l$h" ] || continue
    echo "host$h $([ $l = v ] && echo eth0 || echo eth1) rx $(cat /sys/class/net/${PFX}$l$h/statistics/rx_bytes) tx $(cat /sys/class/net/${PFX}$l$h/statistics/tx_bytes)" >> "$OUTDIR/links.txt"
  done
done
[ "$NICS" -ge 2 ] && cat "$OUTDIR/links.txt"
for r in $(seq 0 $((N - 1))); do
  [ -f "$OUTDIR/rank.$r.rc" ] || continue
  rc=$(cat "$OUTDIR/rank.$r.rc")
  if [ "$rc" != 0 ]; then
    echo "cluster: rank $r exited $rc after $(cat "$OUTDIR/rank.$r.secs")s:"
    tail -n 4 "$OUTDIR/rank.$r.log" | sed 's/^/    /'
  fi
done
tail -n 3 "$OUTDIR/rank.0.log" 2>/dev/null
exit $status
