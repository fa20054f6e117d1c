#!/usr/bin/env bash
# accel's all-reduce against the raw libraries under it, side by side in one
# run, 2 ranks: cpu-gloo against raw Gloo (and torch.distributed's gloo when
# a Python with torch is installed), mpi against raw Open MPI.
#
#   scripts/bench_collectives.sh                 # 4K:64M, 20 iters, 3 rounds
#   SIZES=4K:256M ITERS=50 ROUNDS=5 scripts/bench_collectives.sh
#   GLOO=0 scripts/bench_collectives.sh          # the MPI columns only
#   CHECK_OFF=0 scripts/bench_collectives.sh     # without the check-off runs
#   MPI=0 scripts/bench_collectives.sh           # the Gloo columns only
#                                                # (= scripts/bench_gloo.sh)
#   BASE=/path/to/old/accel scripts/bench_collectives.sh
#                                                # also an older build's accel
#                                                # bench, same rounds: a table
#                                                # of now / before per size
#
# Every program times the same way: per size, WARMUP untimed all-reduces
# (f32, sum, zero-filled buffer), then ITERS times { barrier; t0;
# all-reduce; t1 }; an iteration's time is the slowest rank's, a run's time
# per size is the median over iterations. The programs run interleaved,
# ROUNDS times each (accel-gloo, accel-gloo check off, raw-gloo, torch,
# accel-mpi, accel-mpi check off, raw-mpi, raw-mpi-mt, raw-mpi-nb,
# accel-gloo, ...), so that background load hits all of them alike; the
# tables show the median over rounds of each run's median, "best" the
# fastest iteration over all rounds, and the ratios per size. The load
# average is sampled before every program and printed as a range.
#
#   accel gloo:  accel bench --backend cpu-gloo -n 2 --op all_reduce (release),
#                with the call check (ADR 0016) on, as by default
#   check off:   the same with ACCEL_CHECK_CALLS=0 (only the first
#                collective is checked): the engine path's own cost
#   raw Gloo:    benches/raw_gloo/raw_gloo_bench.cc, g++ -O3 against Debian's
#                libgloo: Gloo's FileStore rendezvous, TCP on 127.0.0.1,
#                gloo::allreduce (ring) with gloo::sum<float>; no accel
#   torch gloo:  benches/torch_gloo/torch_gloo_bench.py (init_process_group
#                "gloo" with a file:// store)
#   accel mpi:   accel bench -n 2 --op all_reduce with no --backend
#                (release): the default CPU engine of `accel launch -n 2`
#                for a program that links MPI (ADR 0017), which the script
#                checks is mpi; accel launch runs the system mpirun. Its
#                check-off run is the same with ACCEL_CHECK_CALLS=0.
#   raw MPI:     benches/raw_mpi/raw_mpi_bench.c, mpicc -O2, under the same
#                mpirun with the flags accel launch gives it: blocking
#                MPI_Allreduce(MPI_IN_PLACE) and MPI_Barrier; no accel
#   raw MPI mt:  the same program at MPI_THREAD_MULTIPLE (RAW_MPI_THREAD=
#                multiple), the level accel's mpi backend initializes MPI
#                at: accel mpi / raw MPI mt is accel's own cost above the
#                staging size, raw MPI mt / raw MPI the thread level's
#   raw MPI nb:  the same program with --mode test: MPI_Iallreduce and
#                MPI_Ibarrier, each polled with MPI_Test until done, which
#                is how accel's mpi backend calls MPI up to
#                ACCEL_MPI_STAGING_BYTES (8 KiB; ADR 0017), and how it
#                called MPI at every size before
#
# The mpirun flags are those `accel launch --backend mpi` uses, so both
# sides run alike: --allow-run-as-root only as root, --oversubscribe and
# --mca mpi_yield_when_idle 1 only when the 2 ranks exceed the cores.
# OMPI_MCA_* variables in the environment reach both.
#
# Prints Markdown tables for docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."

SIZES=${SIZES:-4K:64M}
ITERS=${ITERS:-20}
WARMUP=${WARMUP:-5}
ROUNDS=${ROUNDS:-3}
CARGO=${CARGO:-cargo}
TARGET=${CARGO_TARGET_DIR:-target}
PY=${PYTHON:-python3}
MPIRUN=${ACCEL_MPIRUN:-mpirun}
GLOO=${GLOO:-1}
MPI=${MPI:-1}
CHECK_OFF=${CHECK_OFF:-1}
MIN=${SIZES%%:*}
MAX=${SIZES##*:}
NAME=$(basename "$0" .sh)

if [ "$MPI" = 1 ] && ! { command -v mpicc && command -v "$MPIRUN"; } >/dev/null; then
  echo "$NAME: no mpicc or $MPIRUN: the MPI columns are left out (MPI=0)" >&2
  MPI=0
fi
if [ "$GLOO" != 1 ] && [ "$MPI" != 1 ]; then
  echo "$NAME: nothing to run (GLOO=0 and MPI=0)" >&2
  exit 2
fi

# The mpi backend inside `accel bench-worker` is the launcher's opt-in `mpi`
# feature (launching through mpirun needs none: docs/adr/0008). Built in
# whenever mpicc is there, also for MPI=0, so that runs with and without
# the MPI columns use (and leave) the same binary. The build runs at
# niceness 10 even when the script itself runs under `nice -n -15`.
BUILD=(nice -n $((10 - $(nice))))
MPI_FEATURE=""
if command -v mpicc >/dev/null; then MPI_FEATURE="--features mpi"; fi
# shellcheck disable=SC2086 # word splitting of the flags is meant
"${BUILD[@]}" $CARGO build --release -q -p accel-launcher $MPI_FEATURE ${CARGO_FLAGS:-}
ACCEL="$TARGET/release/accel"
RAW_GLOO="$TARGET/release/raw_gloo_bench"
RAW_MPI="$TARGET/release/raw_mpi_bench"
mkdir -p "$TARGET/release"
if [ "$GLOO" = 1 ]; then
  "${BUILD[@]}" g++ -std=c++17 -O3 -o "$RAW_GLOO" benches/raw_gloo/raw_gloo_bench.cc -lgloo -pthread
fi
MPI_FLAGS=()
if [ "$MPI" = 1 ]; then
  "${BUILD[@]}" mpicc -O2 -o "$RAW_MPI" benches/raw_mpi/raw_mpi_bench.c
  if [ "$(id -u)" = 0 ]; then MPI_FLAGS+=(--allow-run-as-root); fi
  if [ "$(nproc)" -lt 2 ]; then MPI_FLAGS+=(--oversubscribe --mca mpi_yield_when_idle 1); fi
fi

HAVE_TORCH=0
if [ "$GLOO" = 1 ] && command -v "$PY" >/dev/null && "$PY" -c 'import torch, torch.distributed' 2>/dev/null; then
  HAVE_TORCH=1
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# Each runner writes "size median_us min_us" lines to $WORK/<name>.<round>.

LOADS="$WORK/loads"
load() { cut -d' ' -f1 /proc/loadavg >>"$LOADS"; }

# run_accel BACKEND NAME ROUND [VAR=VALUE...] (fails when accel connected
# another backend). BACKEND "default:mpi" passes no --backend and expects
# the launcher's default choice to be mpi.
run_accel() {
  local want=${1#default:} flag=(--backend "$1")
  [ "$want" != "$1" ] && flag=()
  load
  env "${@:4}" "$ACCEL" bench "${flag[@]}" -n 2 --op all_reduce --dtype f32 \
    --sizes "$SIZES" --iters "$ITERS" --warmup "$WARMUP" --json |
    if command -v jq >/dev/null; then
      jq -r --arg want "$want" 'if .backend != $want then error("accel bench ran backend \(.backend), not \($want)")
                             else .rows[] | "\(.size) \(.time_us) \(.min_us)" end'
    else
      "$PY" -c 'import json,sys; r = json.load(sys.stdin)
if r["backend"] != sys.argv[1]: sys.exit("accel bench ran backend %s, not %s" % (r["backend"], sys.argv[1]))
[print(x["size"], x["time_us"], x["min_us"]) for x in r["rows"]]' "$want"
    fi >"$WORK/$2.$3"
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

run_raw_gloo() {
  load
  local store="$WORK/raw-store.$1"
  mkdir -p "$store"
  two_ranks "$WORK/raw.$1" "$RAW_GLOO" --size 2 --store "$store" --min "$MIN" --max "$MAX" \
    --iters "$ITERS" --warmup "$WARMUP"
}

run_torch() {
  load
  two_ranks "$WORK/torch.$1" "$PY" benches/torch_gloo/torch_gloo_bench.py --size 2 \
    --init-file "$WORK/torch-init.$1" --min "$MIN" --max "$MAX" --iters "$ITERS" --warmup "$WARMUP"
}

# run_raw_mpi MODE NAME ROUND
run_raw_mpi() {
  load
  "$MPIRUN" -n 2 "${MPI_FLAGS[@]}" "$RAW_MPI" --min "$MIN" --max "$MAX" \
    --iters "$ITERS" --warmup "$WARMUP" --mode "$1" | awk '{ print $1, $3, $4 }' >"$WORK/$2.$3"
}

for ((r = 0; r < ROUNDS; r++)); do
  echo "$NAME: round $((r + 1))/$ROUNDS" >&2
  if [ "$GLOO" = 1 ]; then
    run_accel cpu-gloo accel "$r"
    if [ -n "${BASE:-}" ]; then ACCEL=$BASE run_accel cpu-gloo basegloo "$r"; fi
    if [ "$CHECK_OFF" = 1 ]; then run_accel cpu-gloo accelnc "$r" ACCEL_CHECK_CALLS=0; fi
    run_raw_gloo "$r"
    if [ "$HAVE_TORCH" = 1 ]; then run_torch "$r"; fi
  fi
  if [ "$MPI" = 1 ]; then
    run_accel default:mpi accelmpi "$r"
    if [ -n "${BASE:-}" ]; then ACCEL=$BASE run_accel default:mpi basempi "$r"; fi
    if [ "$CHECK_OFF" = 1 ]; then run_accel default:mpi accelmpinc "$r" ACCEL_CHECK_CALLS=0; fi
    run_raw_mpi blocking rawmpi "$r"
    RAW_MPI_THREAD=multiple run_raw_mpi blocking rawmpimt "$r"
    run_raw_mpi test rawmpinb "$r"
  fi
done

# agg NAME -> "size median-of-medians min-of-mins" per size
agg() {
  cat "$WORK/$1".[0-9]* | sort -k1,1n -k2,2g | awk '
    { s = $1; n[s]++; v[s, n[s]] = $2; if (!(s in mn) || $3 < mn[s]) mn[s] = $3;
      if (!(s in seen)) { seen[s] = 1; order[++k] = s } }
    END { for (i = 1; i <= k; i++) { s = order[i]; c = n[s];
            med = (c % 2) ? v[s, (c + 1) / 2] : (v[s, c / 2] + v[s, c / 2 + 1]) / 2;
            printf "%s %.1f %.1f\n", s, med, mn[s] } }'
}

# col NAME SIZE FIELD -> field 2 (median) or 3 (best) of NAME's aggregate
col() {
  awk -v s="$2" -v f="$3" '$1 == s { print $f }' "$WORK/$1.agg"
}

ratio() { awk -v a="$1" -v r="$2" 'BEGIN { if (a == "" || r == "" || r == 0) print "n/a"; else printf "%.2f", a / r }'; }
diff_us() { awk -v a="$1" -v r="$2" 'BEGIN { if (a == "" || r == "") print "n/a"; else printf "%+.0f", a - r }'; }
gbs() { awk -v b="$1" -v t="$2" 'BEGIN { if (t == "" || t == 0) print "n/a"; else printf "%.2f", b / t / 1000 }'; }

human() {
  awk -v b="$1" 'BEGIN { if (b >= 1048576) printf "%d MiB", b / 1048576;
                         else if (b >= 1024) printf "%d KiB", b / 1024; else printf "%d B", b }'
}

for n in accel accelnc raw torch accelmpi accelmpinc rawmpi rawmpimt rawmpinb basegloo basempi; do
  if ls "$WORK/$n".[0-9]* >/dev/null 2>&1; then agg "$n" >"$WORK/$n.agg"; else : >"$WORK/$n.agg"; fi
done

if [ "$GLOO" = 1 ]; then
  echo "| size | accel cpu-gloo (µs) | check off (µs) | raw Gloo (µs) | torch gloo (µs) | accel / raw | check off / raw | best accel / best raw | best check off / best raw | best: accel, check off, raw, torch (µs) |"
  echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  while read -r size amed amin; do
    nmed=$(col accelnc "$size" 2)
    nmin=$(col accelnc "$size" 3)
    rmed=$(col raw "$size" 2)
    rmin=$(col raw "$size" 3)
    tmed=$(col torch "$size" 2)
    tmin=$(col torch "$size" 3)
    if [ "$HAVE_TORCH" = 1 ]; then tcol=${tmed:-n/a}; else tcol="torch not installed"; fi
    echo "| $(human "$size") | $amed | ${nmed:-not run} | $rmed | $tcol | $(ratio "$amed" "$rmed") | $(ratio "$nmed" "$rmed") | $(ratio "$amin" "$rmin") | $(ratio "$nmin" "$rmin") | $amin, ${nmin:--}, $rmin, ${tmin:--} |"
  done <"$WORK/accel.agg"
  echo
fi

if [ "$MPI" = 1 ]; then
  echo "| size | accel mpi, default engine (µs) | check off (µs) | raw MPI (µs) | raw MPI mt (µs) | raw MPI nb (µs) | accel mpi / raw MPI | accel mpi − raw MPI (µs) | check off / raw MPI | check off − raw MPI (µs) | best accel mpi / best raw MPI | best: accel mpi, check off, raw MPI (µs) | accel cpu-gloo / accel mpi | torch gloo / accel mpi |"
  echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  while read -r size amed amin; do
    cmed=$(col accelmpinc "$size" 2)
    cmin=$(col accelmpinc "$size" 3)
    rmed=$(col rawmpi "$size" 2)
    rmin=$(col rawmpi "$size" 3)
    tmed=$(col rawmpimt "$size" 2)
    nmed=$(col rawmpinb "$size" 2)
    gmed=$(col accel "$size" 2)
    pmed=$(col torch "$size" 2)
    echo "| $(human "$size") | $amed | ${cmed:-not run} | $rmed | $tmed | $nmed | $(ratio "$amed" "$rmed") | $(diff_us "$amed" "$rmed") | $(ratio "$cmed" "$rmed") | $(diff_us "$cmed" "$rmed") | $(ratio "$amin" "$rmin") | $amin, ${cmin:--}, $rmin | $(ratio "$gmed" "$amed") | $(ratio "$pmed" "$amed") |"
  done <"$WORK/accelmpi.agg"
  echo
  echo "MPI: $("$MPIRUN" --version 2>/dev/null | head -n1); mpirun flags: ${MPI_FLAGS[*]:-none}"
fi
if [ -n "${BASE:-}" ]; then
  echo
  echo "Against $BASE (the same rounds, interleaved; check on in both):"
  echo
  echo "| size | cpu-gloo now / before (median) | best / best | mpi now / before (median) | best / best |"
  echo "|---:|---:|---:|---:|---:|"
  for size in $(cut -d' ' -f1 "$WORK/accel.agg" "$WORK/accelmpi.agg" | sort -un); do
    echo "| $(human "$size") | $(ratio "$(col accel "$size" 2)" "$(col basegloo "$size" 2)") | $(ratio "$(col accel "$size" 3)" "$(col basegloo "$size" 3)") | $(ratio "$(col accelmpi "$size" 2)" "$(col basempi "$size" 2)") | $(ratio "$(col accelmpi "$size" 3)" "$(col basempi "$size" 3)") |"
  done
  echo
fi
echo "2 ranks, f32 sum, iters $ITERS, warmup $WARMUP, rounds $ROUNDS; host: $(nproc) cores, $(uname -sr); 1-minute load average $(sort -g "$LOADS" | head -n1)-$(sort -g "$LOADS" | tail -n1) during the runs, $(cut -d' ' -f1-3 /proc/loadavg) at the end"
if [ "$HAVE_TORCH" = 1 ]; then echo "torch: $("$PY" -c 'import torch; print(torch.__version__)') ($PY)"; fi
