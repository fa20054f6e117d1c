#!/usr/bin/env bash
# The cost of the call check (docs/adr/0016-call-check.md): `accel bench`
# all-reduce on 2 ranks with ACCEL_CHECK_CALLS=1 (the default) and
# ACCEL_CHECK_CALLS=0, interleaved ROUNDS times per backend (cpu-gloo on,
# cpu-gloo off, mpi on, mpi off, cpu-gloo on, ...) so that background load
# hits both alike.
#
#   scripts/call_check_cost.sh                      # 4K and 1M, 50 iters, 5 rounds
#   ROUNDS=7 ITERS=100 BACKENDS=cpu-gloo scripts/call_check_cost.sh
#
# Each run reports, per size, the median over iterations of the slowest
# rank's time and the fastest iteration. The table shows, per backend and
# size, the median over rounds of those medians (on / off and their ratio)
# and the best iteration over all rounds (on / off and their ratio).
# Release build (`cargo build --release -p accel-launcher --features mpi`).
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-5}
ITERS=${ITERS:-50}
WARMUP=${WARMUP:-10}
SIZES=${SIZES:-4K 1M}
BACKENDS=${BACKENDS:-cpu-gloo mpi}
ACCEL=${ACCEL:-target/release/accel}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

if [ ! -x "$ACCEL" ]; then
    cargo build --release -p accel-launcher --features mpi >&2
fi

for round in $(seq "$ROUNDS"); do
    for b in $BACKENDS; do
        for check in 1 0; do
            for size in $SIZES; do
                ACCEL_CHECK_CALLS=$check "$ACCEL" bench --backend "$b" -n 2 --op all_reduce \
                    --sizes "$size" --iters "$ITERS" --warmup "$WARMUP" --json \
                    >"$OUT/$b.$check.$size.$round.json"
            done
        done
    done
    echo "round $round done" >&2
done

python3 - "$OUT" "$ROUNDS" "$BACKENDS" "$SIZES" <<'EOF'
import json, statistics, sys
out, rounds, backends, sizes = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split()
print("| backend | size | median on (µs) | median off (µs) | on / off | best on (µs) | best off (µs) | best on / best off |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for b in backends:
    for size in sizes:
        med, best = {}, {}
        for check in ("1", "0"):
            rows = [json.load(open(f"{out}/{b}.{check}.{size}.{r}.json"))["rows"][0] for r in range(1, rounds + 1)]
            med[check] = statistics.median(r["time_us"] for r in rows)
            best[check] = min(r["min_us"] for r in rows)
        print(f"| {b} | {size} | {med['1']:.1f} | {med['0']:.1f} | {med['1'] / med['0']:.3f} "
              f"| {best['1']:.1f} | {best['0']:.1f} | {best['1'] / best['0']:.3f} |")
EOF
