#!/usr/bin/env bash
# The cost of the call check (docs/adr/0016-call-check.md): `accel bench`
# all-reduce on 2 ranks with ACCEL_CHECK_CALLS=1 (the default) and
# ACCEL_CHECK_CALLS=0, interleaved ROUNDS times per backend (cpu-gloo on,
# cpu-gloo off, mpi on, mpi off, cpu-gloo on, ...) so that background load
# hits both alike.
#
#   scripts/call_check_cost.sh                      # 4K and 1M, 50 iters, 5 rounds
#   ROUNDS=7 ITERS=100 BACKENDS=cpu-gloo scripts/call_check_cost.sh
#   BEFORE_SHIM=/tmp/old/libaccel_gloo_private.so scripts/call_check_cost.sh
#
# BEFORE_SHIM adds two cpu-gloo runs per round, check on and off, with
# that build of the Gloo shim loaded instead (ACCEL_GLOO_SHIM_LIB), e.g.
# one compiled from an earlier commit's backends/cpu-gloo/shim: the table
# then shows it beside this build's ("before" columns).
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

BEFORE_SHIM=${BEFORE_SHIM:-}
for round in $(seq "$ROUNDS"); do
    for b in $BACKENDS; do
        variants="1 0"
        if [ -n "$BEFORE_SHIM" ] && [ "$b" = cpu-gloo ]; then variants="1 0 before1 before0"; fi
        for v in $variants; do
            for size in $SIZES; do
                env=(ACCEL_CHECK_CALLS="${v#before}")
                if [ "$v" != "${v#before}" ]; then env+=(ACCEL_GLOO_SHIM_LIB="$BEFORE_SHIM"); fi
                env "${env[@]}" "$ACCEL" bench --backend "$b" -n 2 --op all_reduce \
                    --sizes "$size" --iters "$ITERS" --warmup "$WARMUP" --json \
                    >"$OUT/$b.$v.$size.$round.json"
            done
        done
    done
    echo "round $round done (load average $(cut -d' ' -f1 /proc/loadavg))" >&2
done

python3 - "$OUT" "$ROUNDS" "$BACKENDS" "$SIZES" "$BEFORE_SHIM" <<'EOF'
import json, os, statistics, sys
out, rounds, backends, sizes = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split()
before = bool(sys.argv[5])
head = "| backend | size | median on (µs) | median off (µs) | on / off | best on (µs) | best off (µs) | best on / best off |"
if before:
    head += " before: median on (µs) | before: median off (µs) | before: best on (µs) | before: best off (µs) | before: best on / best off |"
print(head)
print("|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|---:|---:|" if before else ""))
for b in backends:
    for size in sizes:
        med, best = {}, {}
        for v in ("1", "0", "before1", "before0"):
            files = [f"{out}/{b}.{v}.{size}.{r}.json" for r in range(1, rounds + 1)]
            if not all(os.path.exists(f) for f in files):
                continue
            rows = [json.load(open(f))["rows"][0] for f in files]
            med[v] = statistics.median(r["time_us"] for r in rows)
            best[v] = min(r["min_us"] for r in rows)
        line = (f"| {b} | {size} | {med['1']:.1f} | {med['0']:.1f} | {med['1'] / med['0']:.3f} "
                f"| {best['1']:.1f} | {best['0']:.1f} | {best['1'] / best['0']:.3f} |")
        if before:
            line += (f" {med['before1']:.1f} | {med['before0']:.1f} | {best['before1']:.1f} | {best['before0']:.1f} "
                     f"| {best['before1'] / best['before0']:.3f} |"
                     if "before1" in med else " - | - | - | - | - |")
        print(line)
EOF
