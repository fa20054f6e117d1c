#!/usr/bin/env bash
# accel::zero's benchmark (issue 21): per-rank memory and step time of the
# ZeRO stages none / optimizer / gradients / full on N ranks (real
# processes under `accel launch`), on the digits demo's MLP shape and on a
# 25 MB MLP of 7 units. Prints the Markdown tables of docs/benchmarks.md.
#
#   scripts/zero_bench.sh                       # 4 ranks, cpu-gloo, both models
#   MODELS=large STEPS=8 ROUNDS=5 scripts/zero_bench.sh
#   N=2 BACKEND=mpi scripts/zero_bench.sh        # launcher built with --features mpi
#
# Variables: N (4), BACKEND (cpu-gloo), MODELS ("small large"), STEPS (5
# timed steps per stage and round), ROUNDS (3), BATCH (16 samples per rank),
# ARGS (more zero-bench flags), LIMIT (seconds per run, 900),
# CARGO_TARGET_DIR. See examples/zero-bench for what each column is.
set -euo pipefail
cd "$(dirname "$0")/.."

N=${N:-4}
BACKEND=${BACKEND:-cpu-gloo}
MODELS=${MODELS:-small large}
STEPS=${STEPS:-5}
ROUNDS=${ROUNDS:-3}
BATCH=${BATCH:-16}
LIMIT=${LIMIT:-900}
CARGO=${CARGO:-cargo}
TARGET=${CARGO_TARGET_DIR:-target}

# A fixed glibc mmap threshold returns every freed block to the system at
# once, so the resident-set column follows the heap (glibc's default raises
# the threshold after the first large free and keeps later blocks).
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-131072}

nice -n 10 "$CARGO" build --release -p accel-launcher -p accel-example-zero-bench >&2

echo "load before: $(uptime)"
echo
for model in $MODELS; do
  echo "### $model model"
  echo
  # Rank 0 prints the tables; the launcher prefixes its lines.
  # shellcheck disable=SC2086
  timeout "$LIMIT" "$TARGET/release/accel" launch -n "$N" --backend "$BACKEND" --quiet-ranks -- \
    "$TARGET/release/zero-bench" --model "$model" --steps "$STEPS" --rounds "$ROUNDS" \
    --batch "$BATCH" ${ARGS:-} | sed -e 's/^\[rank 0\] //'
  echo
done
echo "load after: $(uptime)"
echo
echo "command: N=$N BACKEND=$BACKEND MODELS=\"$MODELS\" STEPS=$STEPS ROUNDS=$ROUNDS BATCH=$BATCH scripts/zero_bench.sh"
