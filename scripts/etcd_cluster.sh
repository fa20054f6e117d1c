#!/usr/bin/env bash
# A test etcd cluster on this machine's loopback (Debian's etcd-server,
# installed by `make setup`): N members (3 by default), each with its data,
# log and pid under DIR.
#
#   scripts/etcd_cluster.sh start DIR [N]   start, wait until healthy, print the endpoints
#   scripts/etcd_cluster.sh kill DIR K      SIGKILL member K (0-based)
#   scripts/etcd_cluster.sh restart DIR K   start member K again on its data
#   scripts/etcd_cluster.sh stop DIR        stop every member, remove DIR
#
# Ports: 23790 + 2K (client) and 23791 + 2K (peer); ETCD_BASE_PORT moves them.
set -euo pipefail

cmd=${1:-}
dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || { sed -n '2,12p' "$0"; exit 2; }
base=${ETCD_BASE_PORT:-23790}
command -v etcd >/dev/null || { echo "etcd_cluster: no etcd binary: apt-get install etcd-server (make setup)" >&2; exit 1; }

client() { echo $((base + 2 * $1)); }
peer() { echo $((base + 2 * $1 + 1)); }

members() { cat "$dir/members" 2>/dev/null || echo 0; }

initial() {
  local n=$1 out="" k
  for ((k = 0; k < n; k++)); do
    out+="${out:+,}m$k=http://127.0.0.1:$(peer "$k")"
  done
  echo "$out"
}

spawn() {
  local k=$1 state=$2 n
  n=$(members)
  etcd --name "m$k" --data-dir "$dir/m$k" \
    --listen-client-urls "http://127.0.0.1:$(client "$k")" \
    --advertise-client-urls "http://127.0.0.1:$(client "$k")" \
    --listen-peer-urls "http://127.0.0.1:$(peer "$k")" \
    --initial-advertise-peer-urls "http://127.0.0.1:$(peer "$k")" \
    --initial-cluster "$(initial "$n")" --initial-cluster-state "$state" \
    --initial-cluster-token accel-test \
    --heartbeat-interval 50 --election-timeout 500 \
    >"$dir/m$k.log" 2>&1 &
  echo $! >"$dir/m$k.pid"
}

healthy() {
  local k=$1 i
  for ((i = 0; i < 300; i++)); do
    if { exec 3<>"/dev/tcp/127.0.0.1/$(client "$k")"; } 2>/dev/null; then
      printf 'GET /health HTTP/1.0\r\n\r\n' >&3
      if grep -q '"health":"true"' <&3; then exec 3>&-; return 0; fi
      exec 3>&-
    fi
    sleep 0.1
  done
  echo "etcd_cluster: member $k is not healthy after 30 s (log: $dir/m$k.log)" >&2
  return 1
}

case $cmd in
  start)
    n=${3:-3}
    mkdir -p "$dir"
    echo "$n" >"$dir/members"
    for ((k = 0; k < n; k++)); do spawn "$k" new; done
    for ((k = 0; k < n; k++)); do healthy "$k"; done
    eps=""
    for ((k = 0; k < n; k++)); do eps+="${eps:+,}127.0.0.1:$(client "$k")"; done
    echo "$eps"
    ;;
  kill)
    k=${3:?member}
    kill -9 "$(cat "$dir/m$k.pid")" 2>/dev/null || true
    ;;
  restart)
    k=${3:?member}
    spawn "$k" existing
    healthy "$k"
    ;;
  stop)
    for p in "$dir"/m*.pid; do
      [ -e "$p" ] && kill -9 "$(cat "$p")" 2>/dev/null || true
    done
    rm -rf "$dir"
    ;;
  *)
    sed -n '2,12p' "$0"
    exit 2
    ;;
esac
