#!/usr/bin/env bash
# accel::zero's benchmark (issue 21): per-rank memory and step time of the
# ZeRO stages none / optimizer / gradients / full on N ranks (real
# processes under `accel launch`), on the digits demo's MLP shape and on a
# 24 MiB MLP of 7 units. Prints the Markdown tables of docs/benchmarks.md.
#
#   scripts/zero_bench.sh                       # 4 ranks, cpu-gloo, both models
#   MODELS=large STEPS=8 ROUNDS=5 scripts/zero_bench.sh
#   N=2 BACKEND=mpi scripts/zero_bench.sh        # launcher built with --features mpi
#
# Variables: N (4), BACKEND (cpu-gloo), MODELS ("small large"), STEPS (5
# timed steps per stage and round), ROUNDS (3), BATCH (16 samples per
# rank), ARGS (more zero-bench flags), LIMIT (seconds per run, 900),
# CARGO_TARGET_DIR. examples/zero-bench's docs and docs/benchmarks.md say
# what each column is.
#
# Two runs per model:
# * memory: 2 timed steps, with glibc's mmap threshold fixed at 128 KiB, so
#   that every freed block goes back to the system at once and the
#   resident-set column is each stage's own (glibc's default raises the
#   threshold after the first large free and keeps later blocks in its
#   heap: a stage would show the peak of the stages before it). The heap
#   and element columns do not depend on it.
# * time: STEPS x ROUNDS, stages interleaved, glibc as a default process
#   has it (a fixed threshold makes every unit gathered at stage 3 fresh
#   pages from the kernel, which doubled its step time here).
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

nice -n 10 "$CARGO" build --release -p accel-launcher -p accel-example-zero-bench >&2

bench() {
  # Rank 0 prints the tables; the launcher prefixes its lines.
  # shellcheck disable=SC2086
  timeout "$LIMIT" "$TARGET/release/accel" launch -n "$N" --backend "$BACKEND" --quiet-ranks -- \
    "$TARGET/release/zero-bench" --batch "$BATCH" "$@" ${ARGS:-} | sed -e 's/^\[rank 0\] //'
}

for model in $MODELS; do
  echo "### $model model"
  echo
  MALLOC_MMAP_THRESHOLD_=131072 bench --model "$model" --steps 2 --rounds 1 --tables memory
  echo "load before the timed run: $(uptime)"
  echo
  bench --model "$model" --steps "$STEPS" --rounds "$ROUNDS" --tables time
  echo "load after: $(uptime)"
  echo
done
echo "command: N=$N BACKEND=$BACKEND MODELS=\"$MODELS\" STEPS=$STEPS ROUNDS=$ROUNDS BATCH=$BATCH scripts/zero_bench.sh"
