#!/usr/bin/env bash
# A cluster of N "nodes" on this machine: one network namespace per node, joined through a
# switch namespace (a bridge) by veth links limited with tc tbf to a bandwidth per direction.
# Inside a node, ranks talk over loopback (their own address routes through lo), so the
# machine looks like real clusters do: a fast link inside a node, a slower one between nodes.
#
#   scripts/netcluster.sh run NODES [--rate 1gbit] [--latency 0.5ms] -- COMMAND [ARGS...]
#       Creates the cluster, runs COMMAND once per node, inside that node's namespace and at
#       once, with NODE_RANK, NNODES, MASTER_ADDR (node 0's address), GLOO_SOCKET_IFNAME and
#       MONARCH_NETCLUSTER set; waits for all of them; tears everything down on exit, failure
#       and interruption included. Exit status: the first non-zero status of a node, else 0.
#   scripts/netcluster.sh up NODES [--rate R] [--latency L] [--prefix P]   (prints the prefix)
#   scripts/netcluster.sh down PREFIX
#
# Addresses (10.77.0.1 for node 0, 10.77.0.2 for node 1, ...) live only on interfaces
# inside the namespaces made here; nothing is added to the machine's own namespace, and a
# cluster's traffic reaches only its own namespaces (each cluster has its own switch, so
# clusters made at the same time do not see each other).
#
# --latency needs the kernel's netem qdisc; where it is missing (this machine's kernel has
# tbf but not netem) the script says so on stderr and the links add no delay beyond the
# bandwidth limit. Needs root (CAP_NET_ADMIN) and iproute2.
set -Eeuo pipefail

SUBNET=10.77.0
BURST=64kb

usage() {
  sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

die() {
  echo "netcluster: $*" >&2
  exit 1
}

node_ns() { echo "$1-node$2"; }
switch_ns() { echo "$1-switch"; }

down() {
  local prefix=$1
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${prefix}-(node[0-9]+|switch|probe)$" || true); do
    ip netns del "$ns" 2>/dev/null || true
  done
}

has_netem() {
  local probe="$1-probe"
  ip netns add "$probe"
  local ok=1
  ip netns exec "$probe" tc qdisc add dev lo root netem delay 1ms 2>/dev/null || ok=0
  ip netns del "$probe"
  [ "$ok" -eq 1 ]
}

# shape NS DEV: the egress of DEV in NS limited to RATE (and delayed by LATENCY with netem).
shape() {
  local ns=$1 dev=$2
  if [ -n "$LATENCY" ] && [ "$NETEM" -eq 1 ]; then
    ip netns exec "$ns" tc qdisc add dev "$dev" root handle 1: netem delay "$LATENCY"
    ip netns exec "$ns" tc qdisc add dev "$dev" parent 1: handle 2: tbf rate "$RATE" burst "$BURST" latency 100ms
  else
    ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "$RATE" burst "$BURST" latency 100ms
  fi
}

up() {
  local prefix=$1 nodes=$2
  [ "$(id -u)" -eq 0 ] || die "needs root (network namespaces and tc); run as root"
  command -v ip >/dev/null && command -v tc >/dev/null || die "needs iproute2 (ip, tc)"
  [ "$nodes" -ge 1 ] && [ "$nodes" -le 200 ] || die "NODES must be 1..200, got $nodes"
  NETEM=0
  if [ -n "$LATENCY" ]; then
    if has_netem "$prefix"; then
      NETEM=1
    else
      echo "netcluster: this kernel has no netem qdisc: --latency $LATENCY adds no delay (links are limited to $RATE only)" >&2
    fi
  fi
  local sw
  sw=$(switch_ns "$prefix")
  ip netns add "$sw"
  ip netns exec "$sw" ip link set lo up
  ip netns exec "$sw" ip link add br0 type bridge
  ip netns exec "$sw" ip link set br0 up
  for ((k = 0; k < nodes; k++)); do
    local ns
    ns=$(node_ns "$prefix" "$k")
    ip netns add "$ns"
    ip netns exec "$ns" ip link set lo up
    # Both ends are born inside namespaces: the port in the switch, eth0 in the node.
    ip netns exec "$sw" ip link add "p$k" type veth peer name eth0 netns "$ns"
    ip netns exec "$sw" ip link set "p$k" master br0
    ip netns exec "$sw" ip link set "p$k" up
    ip netns exec "$ns" ip addr add "$SUBNET.$((k + 1))/24" dev eth0
    ip netns exec "$ns" ip link set eth0 up
    shape "$ns" eth0       # node -> switch
    shape "$sw" "p$k"      # switch -> node
  done
}

[ $# -ge 1 ] || usage
cmd=$1
shift
RATE=1gbit
LATENCY=""
PREFIX="mnc$$"
case "$cmd" in
  down)
    [ $# -eq 1 ] || usage
    down "$1"
    exit 0
    ;;
  up | run)
    [ $# -ge 1 ] || usage
    NODES=$1
    shift
    [[ "$NODES" =~ ^[0-9]+$ ]] || die "NODES must be a number, got '$NODES'"
    while [ $# -gt 0 ]; do
      case "$1" in
        --rate) RATE=$2; shift 2 ;;
        --latency) LATENCY=$2; shift 2 ;;
        --prefix) PREFIX=$2; shift 2 ;;
        --) shift; break ;;
        *) die "unknown option '$1'" ;;
      esac
    done
    ;;
  *) usage ;;
esac

if [ "$cmd" = up ]; then
  # Whatever stops `up` half-way (a failing command, die) removes what it made.
  made=0
  trap '[ "$made" -eq 1 ] || down "$PREFIX"' EXIT
  up "$PREFIX" "$NODES"
  made=1
  echo "$PREFIX"
  exit 0
fi

[ $# -ge 1 ] || die "run needs a command after --"
pids=()
# On any exit (the commands done, a failure, SIGINT or SIGTERM): stop the node commands
# still running (background jobs of a script ignore SIGINT, so they are killed by name of
# their process group), wait for them, then remove the namespaces.
cleanup() {
  for pid in "${pids[@]}"; do
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  down "$PREFIX"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
set -m  # each node's command in its own process group, so cleanup reaches its children
up "$PREFIX" "$NODES"
for ((k = 0; k < NODES; k++)); do
  ip netns exec "$(node_ns "$PREFIX" "$k")" env NODE_RANK="$k" NNODES="$NODES" MASTER_ADDR="$SUBNET.1" \
    GLOO_SOCKET_IFNAME=eth0 MONARCH_NETCLUSTER="$PREFIX" "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  rc=0
  wait "$pid" || rc=$?
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
done
exit "$status"
