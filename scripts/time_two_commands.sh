#!/usr/bin/env bash
# Wall and CPU time of the README's two commands on a fresh clone: `make demo`
# (cold: no target directory), then `make test` after it, serially.
#
#   scripts/time_two_commands.sh [CLONE_DIR (/tmp/accel-two-commands)]
#
# One-time downloads are kept out of the figures (issue 30 counts them
# separately): the clone links to this checkout's .accel-cache (libtorch, the
# PJRT plugin, MiniLM, the torch venv) and .venv-tb when they exist, so the
# times are builds and tests. Without them the first run also downloads
# (sizes in the README). Prints one line per command and the load average
# before and after; docs/benchmarks.md ("Build times") records the results.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-/tmp/accel-two-commands}
rm -rf "$dir"
git clone -q "$src" "$dir"
for cache in .accel-cache .venv-tb; do
  if [ -d "$src/$cache" ]; then ln -s "$src/$cache" "$dir/$cache"; fi
done
cd "$dir"
load() { cut -d' ' -f1-3 /proc/loadavg; }
for cmd in demo test; do
  before=$(load)
  start=$(date +%s)
  if CI=true /usr/bin/time -f "%U %S" -o "$dir/.time-$cmd" make "$cmd" > "$dir/make-$cmd.log" 2>&1; then rc=0; else rc=$?; fi
  end=$(date +%s)
  read -r user sys < "$dir/.time-$cmd" || true
  echo "make $cmd: rc $rc, $((end - start)) s wall, ${user:-?} s user, ${sys:-?} s sys, load before $before, after $(load) (log: $dir/make-$cmd.log)"
  [ "$rc" = 0 ] || exit "$rc"
done
