#!/usr/bin/env bash
# The workspace's tests in two lanes at once (make unit). `cargo test` runs its
# test binaries one after another; the launcher's cluster tests (Slurm, network
# namespace machines, elastic membership, lost machines) spend nearly all their
# time waiting on timeouts, heartbeats and daemons (tests/elastic.rs: 26 s wall,
# 0.8 s CPU), so they run in a lane of their own beside everything else.
#
#   scripts/test_lanes.sh CARGO_ARGS...     (e.g. --workspace --features accel-launcher/mpi)
#
# Both lanes use the same package and feature selection, so the one build
# (`--no-run`, first) serves both; cargo holds its build lock only while it
# builds. The waiting lane's output is printed whole when it ends; the exit
# status is non-zero when any lane failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
CARGO=${CARGO:-cargo}
waiting=(slurm cluster elastic machines)
args=("$@" --no-fail-fast)

"$CARGO" test "${args[@]}" --no-run || exit $?

# Every other test target of the selected packages, by name.
mapfile -t others < <("$CARGO" metadata --no-deps --format-version 1 | python3 -c '
import json, sys
m = json.load(sys.stdin)
members = set(m["workspace_members"])
skip = set(sys.argv[1:])
names = {t["name"] for p in m["packages"] if p["id"] in members
         for t in p["targets"] if "test" in t["kind"]}
print("\n".join(sorted(names - skip)))
' "${waiting[@]}")
[ "${#others[@]}" -gt 0 ] || { echo "test_lanes: no test targets found (cargo metadata failed?)" >&2; exit 1; }

log=$(mktemp -t accel-lane-XXXXXX.log)
trap 'rm -f "$log"' EXIT
start=$(date +%s)
waiting_args=()
for t in "${waiting[@]}"; do waiting_args+=(--test "$t"); done
other_args=()
for t in "${others[@]}"; do other_args+=(--test "$t"); done
( "$CARGO" test "${args[@]}" "${waiting_args[@]}" > "$log" 2>&1 ) &
lane=$!

"$CARGO" test "${args[@]}" --lib --bins "${other_args[@]}"
main_rc=$?
"$CARGO" test "${args[@]}" --doc
doc_rc=$?
main_end=$(date +%s)

wait "$lane"
lane_rc=$?
echo "==== the waiting lane (${waiting[*]}): exit $lane_rc, $(( $(date +%s) - start )) s; the other lane took $(( main_end - start )) s ===="
cat "$log"
echo "test_lanes: main lane exit $main_rc, doc tests exit $doc_rc, waiting lane exit $lane_rc"
[ "$main_rc" = 0 ] && [ "$doc_rc" = 0 ] && [ "$lane_rc" = 0 ]
