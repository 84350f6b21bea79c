#!/bin/bash
# Drill: two "nodes" on one Linux machine, each in its own network namespace with its own
# address on a real (virtual) Ethernet link: node A 10.77.0.1, node B 10.77.0.2. One torchrun
# agent per node, c10d rendezvous hosted on node A, lab01 on gloo. Needs root (ip netns).
#
# As on many real nodes (Debian and Ubuntu write this by default), each node's /etc/hosts maps
# the machine's hostname to 127.0.1.1, so "what does my hostname resolve to" says loopback.
# Three launch settings then matter; --omit drops one and shows its symptom:
#
#   runbooks/drills/two_node_netns.sh                       # all three: trains, exit 0
#   runbooks/drills/two_node_netns.sh --omit is-host        # nobody hosts the rendezvous store
#   runbooks/drills/two_node_netns.sh --omit local-addr     # workers told to meet at 127.0.1.1
#   runbooks/drills/two_node_netns.sh --omit gloo-ifname    # gloo binds loopback
#
# Page: runbooks/startup-hang.md (cause E). Logs: $LOG_DIR (default: a new temporary folder).
# TIMEOUT_S (default 15): every wait (store connect, process group); LAB_ARGS: the lab's flags.
set -euo pipefail

usage="usage: two_node_netns.sh [--omit is-host|local-addr|gloo-ifname]"
omit=none
while (( $# )); do
    case $1 in
        --omit) omit=${2:-}; shift 2 || { echo "$usage" >&2; exit 2; } ;;
        *) echo "$usage" >&2; exit 2 ;;
    esac
done
case $omit in
    none | is-host | local-addr | gloo-ifname) ;;
    *) echo "--omit: unknown setting '$omit' (is-host, local-addr, gloo-ifname)" >&2; exit 2 ;;
esac
(( EUID == 0 )) || { echo "two_node_netns.sh: needs root (ip netns add)" >&2; exit 2; }
command -v ip >/dev/null || { echo "two_node_netns.sh: needs ip (iproute2)" >&2; exit 2; }

repo=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-python3}
LAB=${LAB:-$repo/labs/lab01_ddp.py}
LAB_ARGS=${LAB_ARGS:---steps 4}
LOG_DIR=${LOG_DIR:-$(mktemp -d)}
TIMEOUT_S=${TIMEOUT_S:-15}
tag=$$  # unique names, so drills can run side by side
names=("cnA$tag" "cnB$tag")
links=("veA$tag" "veB$tag")
addrs=(10.77.0.1 10.77.0.2)

cleanup() {
    for ns in "${names[@]}"; do
        ip netns del "$ns" 2>/dev/null || true  # takes its end of the veth pair with it
        rm -rf "/etc/netns/$ns"
    done
}
trap cleanup EXIT

ip link add "${links[0]}" type veth peer name "${links[1]}"
for i in 0 1; do
    ip netns add "${names[i]}"
    ip link set "${links[i]}" netns "${names[i]}"
    ip -n "${names[i]}" addr add "${addrs[i]}/24" dev "${links[i]}"
    ip -n "${names[i]}" link set lo up
    ip -n "${names[i]}" link set "${links[i]}" up
    # `ip netns exec` mounts /etc/netns/<name>/hosts over /etc/hosts for that node.
    mkdir -p "/etc/netns/${names[i]}"
    printf '127.0.0.1 localhost\n127.0.1.1 %s\n' "$(hostname)" > "/etc/netns/${names[i]}/hosts"
done

# The three settings. is_host=1: the endpoint 10.77.0.1 is not what node A's hostname
# resolves to, so torchrun's guess (_matches_machine_hostname) says "not me" on every node.
# --local-addr: the address an agent gives its workers and peers (default: the FQDN of its
# hostname, here 127.0.1.1). GLOO_SOCKET_IFNAME: the interface gloo binds (default: the
# address the hostname resolves to, here loopback).
read -r -a lab_args <<< "$LAB_ARGS"
pids=()
for i in 0 1; do
    conf="join_timeout=30,read_timeout=$TIMEOUT_S"
    [[ $i == 0 && $omit != is-host ]] && conf+=",is_host=1"
    args=(--nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint "${addrs[0]}:29400"
          --rdzv-id netns-drill --rdzv-conf "$conf")
    [[ $omit != local-addr ]] && args+=(--local-addr "${addrs[i]}")
    node_env=(OMP_NUM_THREADS=1)
    [[ $omit != gloo-ifname ]] && node_env+=("GLOO_SOCKET_IFNAME=${links[i]}")
    echo "node $i (${addrs[i]}): ${node_env[*]} torchrun ${args[*]} $(basename "$LAB")"
    ip netns exec "${names[i]}" env "${node_env[@]}" timeout 120 "$PYTHON" -m torch.distributed.run \
        "${args[@]}" "$LAB" "${lab_args[@]}" --timeout-s "$TIMEOUT_S" > "$LOG_DIR/node$i.log" 2>&1 &
    pids+=($!)
done
codes=()
for pid in "${pids[@]}"; do
    rc=0
    wait "$pid" || rc=$?
    codes+=("$rc")
done

for i in 0 1; do
    echo "--- node $i: first error lines, then the last line ($LOG_DIR/node$i.log)"
    grep -m 3 -E "Error|failed|timed out" "$LOG_DIR/node$i.log" | cut -c 1-300 || true
    tail -n 1 "$LOG_DIR/node$i.log"
done
if [[ ${codes[*]} == "0 0" ]]; then
    echo "two_node_netns: OK | 2 nodes | ${addrs[*]} | omitted: $omit"
else
    echo "two_node_netns: FAILED | exit codes ${codes[*]} | omitted: $omit"
    exit 1
fi
