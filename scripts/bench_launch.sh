#!/usr/bin/env bash
# Launch latency of `accel launch` (and of torchrun when a Python with torch
# is installed): wall time from starting the launcher until it exits, for a
# program that reads its rank, connects to the rendezvous store with the run
# token, runs a store barrier over every rank and exits.
#
#   scripts/bench_launch.sh                 # 2 and 8 processes, 20 runs each
#   RUNS=50 SIZES="2 8 16" scripts/bench_launch.sh
#   CARGO_FLAGS=--no-default-features scripts/bench_launch.sh
#   TORCH_RUNS=5 TORCHRUN_ARGS="--monitor_interval 0.1" scripts/bench_launch.sh
#
# Prints a Markdown table (median, min, p90 in milliseconds) for
# docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS=${RUNS:-20}
TORCH_RUNS=${TORCH_RUNS:-10}
SIZES=${SIZES:-"2 8"}
CARGO=${CARGO:-cargo}
TARGET=${CARGO_TARGET_DIR:-target}

# shellcheck disable=SC2086
$CARGO build --release -q -p accel-launcher ${CARGO_FLAGS:-}
ACCEL="$TARGET/release/accel"

now_ns() { date +%s%N; }

# stats FILE -> "median min p90" in ms with one decimal
stats() {
  sort -n "$1" | awk '{ v[NR] = $1 } END {
    n = NR; med = (n % 2) ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2;
    p90 = v[int(0.9 * n + 0.999)]; if (p90 == "") p90 = v[n];
    printf "%.1f %.1f %.1f\n", med / 1e6, v[1] / 1e6, p90 / 1e6 }'
}

# measure NAME N CMD... : run CMD RUNS times, check it succeeds, print stats
measure() {
  shift 2
  local out; out=$(mktemp)
  local i t0 t1
  for ((i = 0; i < RUNS; i++)); do
    t0=$(now_ns)
    if ! "$@" >/dev/null 2>&1; then
      echo "bench_launch: run failed: $*" >&2
      "$@" >&2 || true
      exit 1
    fi
    t1=$(now_ns)
    echo $((t1 - t0)) >>"$out"
  done
  stats "$out"
  rm -f "$out"
}

# The first Python that imports torch (PYTHON, python3 on PATH, the system's).
HAVE_TORCH=0
for PY in ${PYTHON:-} python3 /usr/bin/python3; do
  if command -v "$PY" >/dev/null && "$PY" -c 'import torch.distributed' 2>/dev/null; then
    HAVE_TORCH=1
    break
  fi
done
TORCHRUN_ARGS=${TORCHRUN_ARGS:-}
if [ "$HAVE_TORCH" = 1 ]; then
  TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__)')
  # torch 1.x on Python >= 3.11 cannot parse the default --redirects/--tee
  # ("0": IntFlag iteration skips it) and crashes; stdout redirection with
  # tee is the closest working setting.
  if "$PY" -c 'import sys, torch; sys.exit(not (torch.__version__ < "2" and sys.version_info >= (3, 11)))'; then
    TORCHRUN_ARGS="--redirects 1 --tee 1 $TORCHRUN_ARGS"
  fi
  TORCH_PROG=$(mktemp --suffix=.py)
  cat >"$TORCH_PROG" <<'EOF'
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
EOF
fi

echo "| processes | accel launch median (ms) | min | p90 | torchrun median (ms) | ratio torchrun / accel |"
echo "|---:|---:|---:|---:|---:|---:|"
for n in $SIZES; do
  read -r med min p90 < <(measure accel "$n" "$ACCEL" launch -n "$n" -- "$ACCEL" probe-worker)
  if [ "$HAVE_TORCH" = 1 ]; then
    read -r tmed _ _ < <(RUNS=$TORCH_RUNS measure torchrun "$n" "$PY" -m torch.distributed.run --standalone --nproc_per_node "$n" $TORCHRUN_ARGS "$TORCH_PROG")
    ratio=$(awk -v a="$med" -v t="$tmed" 'BEGIN { printf "%.0fx", t / a }')
    echo "| $n | $med | $min | $p90 | $tmed | $ratio |"
  else
    echo "| $n | $med | $min | $p90 | n/a (no torch) | n/a |"
  fi
done
echo
echo "runs per cell: $RUNS accel, $TORCH_RUNS torchrun; host: $(nproc) cores, $(uname -sr)"
[ "$HAVE_TORCH" = 1 ] && echo "torchrun: $PY -m torch.distributed.run --standalone --nproc_per_node N $TORCHRUN_ARGS (torch $TORCH_VERSION)"
[ "$HAVE_TORCH" = 1 ] && rm -f "$TORCH_PROG"
exit 0
