#!/bin/bash
# EP8 as 2 hosts x 4 ranks (network namespaces standing in for nodes, tcp
# between them, shared memory inside), ferry vs the MPI baseline in the
# same mpirun job, without and with injected delay per write.
# Needs root. Usage: scripts/bench_cluster.sh [ferry-bench options]
set -u
cd "$(dirname "$0")/.."
BIN=$PWD/${BIN:-build/bin/ferry-bench}
H=2; R=4
ID=$(( $$ % 1000 )); S=$(( 10 + ID % 200 ))
BR=fb${ID}b; AGENT=$(mktemp); HOSTS_BAK=$(mktemp)
cp /etc/hosts "$HOSTS_BAK"
cleanup() {
  for h in $(seq 0 $((H - 1))); do ip netns del fb${ID}h$h 2>/dev/null; ip link del fb${ID}v$h 2>/dev/null; done
  ip link del $BR 2>/dev/null
  cat "$HOSTS_BAK" > /etc/hosts; rm -f "$HOSTS_BAK" "$AGENT"
}
trap cleanup EXIT
ip link add $BR type bridge && ip link set $BR up && ip addr add 10.198.$S.1/24 dev $BR || exit 1
for h in $(seq 0 $((H - 1))); do
  ip netns add fb${ID}h$h
  ip link add fb${ID}v$h type veth peer name fb${ID}p$h
  ip link set fb${ID}v$h master $BR up
  ip link set fb${ID}p$h netns fb${ID}h$h
  ip -n fb${ID}h$h link set fb${ID}p$h name eth0
  ip -n fb${ID}h$h addr add 10.198.$S.$((10 + h))/24 dev eth0
  ip -n fb${ID}h$h link set eth0 up; ip -n fb${ID}h$h link set lo up
  echo "10.198.$S.$((10 + h)) fbhost$h" >> /etc/hosts
done
# mpirun starts its daemons through this "remote shell": into the host's
# namespace, with the host's name
cat > "$AGENT" <<AG
#!/bin/bash
host=\$1; shift
exec ip netns exec fb${ID}h\${host#fbhost} unshare --uts sh -c "hostname \$host; \$*"
AG
chmod +x "$AGENT"
hosts=$(for h in $(seq 0 $((H - 1))); do printf "fbhost$h:$R,"; done); hosts=${hosts%,}
first=1
for delay in 0 20; do
  q=-q; [ $first -eq 1 ] && q= && first=0
  echo "# FERRY_FAULT_DELAY_US=$delay"
  mpirun --allow-run-as-root --oversubscribe -n $((H * R)) --host "$hosts" \
    --mca plm_rsh_agent "$AGENT" --mca oob_tcp_if_include 10.198.$S.0/24 \
    --mca btl_tcp_if_include 10.198.$S.0/24 --mca btl self,vader,tcp \
    --mca mpi_yield_when_idle 1 --bind-to none \
    -x FI_PROVIDER=tcp -x FERRY_FAULT_DELAY_US=$delay -x FERRY_TIMEOUT_MS=60000 \
    "$BIN" $q "$@" 2>&1 | grep -vE "^ferry-bench: round|fault injection"
done
