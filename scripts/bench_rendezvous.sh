#!/usr/bin/env bash
# Rendezvous time of 3 machines (3 launchers on loopback, one `true` worker
# each): accel's TCP store on machine 0 against a 3-member etcd cluster
# (scripts/etcd_cluster.sh), interleaved, ROUNDS rounds (default 7). Prints
# each round, then the medians, the best of each, and the ratios etcd/tcp;
# then the stores' round-trip latency (set then get: rendezvous/examples/
# store_latency.rs), TCP and etcd interleaved, three rounds.
#
#   scripts/bench_rendezvous.sh [ROUNDS]      (ACCEL=path/to/accel, default target/release/accel)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-7}
accel=${ACCEL:-target/release/accel}
[ -x "$accel" ] || { echo "bench_rendezvous: no $accel (cargo build --release -p accel-launcher)" >&2; exit 1; }
dir=$(mktemp -d)
trap 'scripts/etcd_cluster.sh stop "$dir/etcd" >/dev/null 2>&1 || true; rm -rf "$dir"' EXIT
eps=$(scripts/etcd_cluster.sh start "$dir/etcd" 3)

now() { date +%s%N; }

# Wait for every launcher of a round; a failed one ends the benchmark.
wait_all() {
  local p
  for p in "$@"; do
    wait "$p" || { echo "bench_rendezvous: a launcher failed (rerun one by hand to see why)" >&2; exit 1; }
  done
}

tcp_round() {
  local port=$((30000 + RANDOM % 20000)) k pids=()
  for k in 0 1 2; do
    "$accel" launch --nnodes 3 --node-rank "$k" --master-addr 127.0.0.1 --master-port "$port" \
      --token bench -- true >/dev/null 2>&1 &
    pids+=($!)
  done
  wait_all "${pids[@]}"
}

etcd_round() {
  local id=$1 k pids=()
  for k in 0 1 2; do
    "$accel" launch --nnodes 3 --rdzv-backend etcd --rdzv-endpoint "$eps" --rdzv-id "$id" \
      -- true >/dev/null 2>&1 &
    pids+=($!)
  done
  wait_all "${pids[@]}"
}

tcp=() etcd=()
for ((r = 0; r < rounds; r++)); do
  t0=$(now); tcp_round; t1=$(now)
  etcd_round "bench-$$-$r"; t2=$(now)
  a=$(((t1 - t0) / 1000000)); b=$(((t2 - t1) / 1000000))
  tcp+=("$a"); etcd+=("$b")
  echo "round $r: tcp $a ms, etcd $b ms"
done
python3 - "${tcp[*]}" "${etcd[*]}" <<'EOF'
import statistics, sys
tcp = [float(x) / 1000 for x in sys.argv[1].split()]
etcd = [float(x) / 1000 for x in sys.argv[2].split()]
mt, me = statistics.median(tcp), statistics.median(etcd)
print(f"median: tcp {mt:.3f} s, etcd {me:.3f} s, etcd/tcp {me / mt:.2f}")
print(f"best:   tcp {min(tcp):.3f} s, etcd {min(etcd):.3f} s, etcd/tcp {min(etcd) / min(tcp):.2f}")
EOF
# The stores' round-trip latency (set then get), TCP and etcd interleaved.
cargo build -q --release -p accel-rendezvous --features etcd --example store_latency
latency=target/release/examples/store_latency
first=${eps%%,*}
for ((r = 0; r < 3; r++)); do
  "$latency" tcp 2000
  "$latency" "etcd://$first/bench-$$" 2000
done
