#!/usr/bin/env bash
# Two builds of `accel` timing the same collective, interleaved round by
# round on one machine, with per-size ratios (medians over rounds and
# best against best). For before/after comparisons of a backend change:
#
#   git worktree add /tmp/base <old commit>
#   (cd /tmp/base && cargo build --release -p accel-launcher)
#   cargo build --release -p accel-launcher
#   A=/tmp/base/target/release/accel B=target/release/accel \
#     OP=reduce_scatter N=4 SIZES=256K:16M ROUNDS=5 scripts/bench_ab.sh
#
# One build under two environments (the flight recorder off against on):
#
#   A=target/release/accel B=target/release/accel ENV_A=ACCEL_FLIGHT_RECORDER=0 \
#     OP=all_reduce BACKEND=mpi N=2 SIZES=4K ITERS=200 ROUNDS=7 scripts/bench_ab.sh
#
# Variables: A, B (the two binaries), ENV_A, ENV_B (space-separated
# VAR=value settings for each side's runs, empty by default), OP
# (reduce_scatter), BACKEND (cpu-gloo), N (4), SIZES (256K:16M), ITERS (20),
# ROUNDS (5).
set -euo pipefail
: "${A:?A=path of the first accel binary}" "${B:?B=path of the second accel binary}"
OP=${OP:-reduce_scatter}
BACKEND=${BACKEND:-cpu-gloo}
N=${N:-4}
SIZES=${SIZES:-256K:16M}
ITERS=${ITERS:-20}
ROUNDS=${ROUNDS:-5}
ENV_A=${ENV_A:-}
ENV_B=${ENV_B:-}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
echo "# $OP on $N ranks, $BACKEND, $ROUNDS rounds x $ITERS iterations; A: $A ${ENV_A:+($ENV_A)}; B: $B ${ENV_B:+($ENV_B)}; load: $(cut -d' ' -f1-3 /proc/loadavg)"
for _ in $(seq 1 "$ROUNDS"); do
  for v in A B; do
    bin=${!v}
    envs=ENV_$v
    # shellcheck disable=SC2086 # the settings are words on purpose
    env ${!envs} "$bin" bench --backend "$BACKEND" -n "$N" --op "$OP" --sizes "$SIZES" --iters "$ITERS" 2>&1 |
      awk -v v="$v" '/^ +[0-9]/ {print v, $1, $4}' >> "$out"
  done
done
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$out" <<'PY'
import collections, statistics, sys
t = collections.defaultdict(list)
for line in open(sys.argv[1]):
    v, size, us = line.split()
    t[(v, int(size))].append(float(us))
print("| size (B) | A median (us) | B median (us) | B/A median | B/A best |")
print("|---:|---:|---:|---:|---:|")
for s in sorted({s for _, s in t}):
    a, b = t[("A", s)], t[("B", s)]
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"| {s} | {ma:.1f} | {mb:.1f} | {mb / ma:.3f} | {min(b) / min(a):.3f} |")
PY
