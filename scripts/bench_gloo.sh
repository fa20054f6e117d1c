#!/usr/bin/env bash
# The former name of scripts/bench_collectives.sh, which superseded it: the
# cpu-gloo / raw Gloo / torch gloo table only, as before (MPI=1 adds the MPI
# table). Same variables: SIZES, ITERS, WARMUP, ROUNDS, CARGO_TARGET_DIR.
#
#   SIZES=4K:64M ROUNDS=5 ITERS=50 nice -n -15 scripts/bench_gloo.sh
set -euo pipefail
MPI=${MPI:-0} exec "$(dirname "$0")/bench_collectives.sh" "$@"
