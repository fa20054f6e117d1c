#!/usr/bin/env bash
# accel's cpu-gloo all-reduce against raw Gloo (and torch.distributed's gloo
# when a Python with torch is installed), side by side in one run, 2 ranks.
#
#   scripts/bench_gloo.sh                       # 4K:64M, 20 iters, 3 rounds
#   SIZES=4K:256M ITERS=50 ROUNDS=5 scripts/bench_gloo.sh
#
# The three programs time the same way: per size, WARMUP untimed
# all-reduces (f32, sum, zero-filled buffer), then ITERS times { barrier;
# t0; all-reduce; t1 }; an iteration's time is the slowest rank's, a run's
# time per size is the median over iterations. The programs run
# interleaved, ROUNDS times each (accel, raw, torch, accel, raw, ...), so
# that background load hits all of them alike; the table shows the median
# over rounds of each run's median, and the ratio accel / raw per size.
#
#   (1) accel:  accel bench --backend cpu-gloo -n 2 --op all_reduce (release)
#   (2) raw:    benches/raw_gloo/raw_gloo_bench.cc, g++ -O3 against Debian's
#               libgloo: Gloo's FileStore rendezvous, TCP on 127.0.0.1,
#               gloo::allreduce (ring) with gloo::sum<float>; no accel
#   (3) torch:  benches/torch_gloo/torch_gloo_bench.py (init_process_group
#               "gloo" with a file:// store)
#
# Prints a Markdown table for docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."

SIZES=${SIZES:-4K:64M}
ITERS=${ITERS:-20}
WARMUP=${WARMUP:-5}
ROUNDS=${ROUNDS:-3}
CARGO=${CARGO:-cargo}
TARGET=${CARGO_TARGET_DIR:-target}
PY=${PYTHON:-python3}
MIN=${SIZES%%:*}
MAX=${SIZES##*:}

# shellcheck disable=SC2086
$CARGO build --release -q -p accel-launcher ${CARGO_FLAGS:-}
ACCEL="$TARGET/release/accel"
RAW="$TARGET/release/raw_gloo_bench"
mkdir -p "$TARGET/release"
g++ -std=c++17 -O3 -o "$RAW" benches/raw_gloo/raw_gloo_bench.cc -lgloo -pthread

HAVE_TORCH=0
if command -v "$PY" >/dev/null && "$PY" -c 'import torch, torch.distributed' 2>/dev/null; then
  HAVE_TORCH=1
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# Each runner appends "size median_us min_us" lines to $WORK/<name>.<round>.
run_accel() {
  "$ACCEL" bench --backend cpu-gloo -n 2 --op all_reduce --dtype f32 \
    --sizes "$SIZES" --iters "$ITERS" --warmup "$WARMUP" --json |
    if command -v jq >/dev/null; then
      jq -r '.rows[] | "\(.size) \(.time_us) \(.min_us)"'
    else
      "$PY" -c 'import json,sys; [print(r["size"], r["time_us"], r["min_us"]) for r in json.load(sys.stdin)["rows"]]'
    fi >"$WORK/accel.$1"
}

# two_ranks OUT CMD... : run CMD with "--rank 0" and "--rank 1" appended,
# keep rank 0's stdout as "size median min".
two_ranks() {
  local out=$1
  shift
  "$@" --rank 1 >/dev/null &
  local pid=$!
  "$@" --rank 0 | awk '{ print $1, $3, $4 }' >"$out"
  wait "$pid"
}

run_raw() {
  local store="$WORK/raw-store.$1"
  mkdir -p "$store"
  two_ranks "$WORK/raw.$1" "$RAW" --size 2 --store "$store" --min "$MIN" --max "$MAX" \
    --iters "$ITERS" --warmup "$WARMUP"
}

run_torch() {
  two_ranks "$WORK/torch.$1" "$PY" benches/torch_gloo/torch_gloo_bench.py --size 2 \
    --init-file "$WORK/torch-init.$1" --min "$MIN" --max "$MAX" --iters "$ITERS" --warmup "$WARMUP"
}

for ((r = 0; r < ROUNDS; r++)); do
  echo "bench_gloo: round $((r + 1))/$ROUNDS" >&2
  run_accel "$r"
  run_raw "$r"
  if [ "$HAVE_TORCH" = 1 ]; then run_torch "$r"; fi
done

# agg NAME -> "size median-of-medians min-of-mins" per size
agg() {
  cat "$WORK/$1".* | sort -k1,1n -k2,2g | awk '
    { s = $1; n[s]++; v[s, n[s]] = $2; if (!(s in mn) || $3 < mn[s]) mn[s] = $3;
      if (!(s in seen)) { seen[s] = 1; order[++k] = s } }
    END { for (i = 1; i <= k; i++) { s = order[i]; c = n[s];
            med = (c % 2) ? v[s, (c + 1) / 2] : (v[s, c / 2] + v[s, c / 2 + 1]) / 2;
            printf "%s %.1f %.1f\n", s, med, mn[s] } }'
}

agg accel >"$WORK/accel.agg"
agg raw >"$WORK/raw.agg"
if [ "$HAVE_TORCH" = 1 ]; then agg torch >"$WORK/torch.agg"; else : >"$WORK/torch.agg"; fi

human() {
  awk -v b="$1" 'BEGIN { if (b >= 1048576) printf "%d MiB", b / 1048576;
                         else if (b >= 1024) printf "%d KiB", b / 1024; else printf "%d B", b }'
}

echo "| size | accel (µs) | raw Gloo (µs) | torch gloo (µs) | accel / raw | accel − raw (µs) | best accel / best raw |"
echo "|---:|---:|---:|---:|---:|---:|---:|"
while read -r size amed amin; do
  read -r _ rmed rmin < <(awk -v s="$size" '$1 == s' "$WORK/raw.agg")
  tmed=$(awk -v s="$size" '$1 == s { print $2 }' "$WORK/torch.agg")
  if [ "$HAVE_TORCH" = 1 ]; then tcol=${tmed:-n/a}; else tcol="torch not installed"; fi
  ratio=$(awk -v a="$amed" -v r="$rmed" 'BEGIN { printf "%.2f", a / r }')
  diff=$(awk -v a="$amed" -v r="$rmed" 'BEGIN { printf "%+.0f", a - r }')
  best=$(awk -v a="$amin" -v r="$rmin" 'BEGIN { printf "%.2f", a / r }')
  echo "| $(human "$size") | $amed | $rmed | $tcol | $ratio | $diff | $best |"
done <"$WORK/accel.agg"
echo
echo "2 ranks, f32 sum, iters $ITERS, warmup $WARMUP, rounds $ROUNDS; host: $(nproc) cores, $(uname -sr), load average $(cut -d' ' -f1-3 /proc/loadavg)"
