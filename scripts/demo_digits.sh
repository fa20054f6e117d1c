#!/usr/bin/env bash
# make demo-candle / make demo-burn: examples/NAME-digits on 2 ranks through
# `accel launch` (the mpi engine when Open MPI is installed: both link MPI;
# DEMO_LAUNCH="--backend cpu-gloo" picks Gloo): an uninterrupted 10-epoch run (held-out accuracy, the
# final parameters' checksum), then the same run stopped after optimizer
# step 63 (as if killed, 3 steps after a checkpoint) and resumed from its newest checkpoint; the two
# checksums must be equal. Arguments go to every run.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
# shellcheck disable=SC2206
LAUNCH=(target/release/accel launch -n 2 ${DEMO_LAUNCH:-} --)
NAME=${1:?usage: scripts/demo_digits.sh candle|burn [ARGS...]}
shift
DEMO=target/release/$NAME-digits
CK=target/$NAME-digits
checksum() { sed -n 's/.*params checksum \([0-9a-f]*\).*/\1/p' "$1" | tail -n1; }

echo "== $NAME-digits: 10 epochs on 2 ranks =="
"${LAUNCH[@]}" "$DEMO" --checkpoint-dir "$CK/full" --save-model "$CK/weights" "$@" | tee "$CK.full.log"
echo "== stopped after step 63 (3 steps after its last checkpoint) =="
"${LAUNCH[@]}" "$DEMO" --checkpoint-dir "$CK/cut" --stop-after 63 "$@" | tee "$CK.cut.log"
echo "== resumed =="
"${LAUNCH[@]}" "$DEMO" --checkpoint-dir "$CK/cut" --resume "$@" | tee "$CK.resumed.log"
full=$(checksum "$CK.full.log")
resumed=$(checksum "$CK.resumed.log")
if [[ -n $full && $full == "$resumed" ]]; then
    echo "demo-$NAME: resumed run ends on the uninterrupted run's checksum $full"
else
    echo "demo-$NAME: checksums differ: full $full, resumed $resumed" >&2
    exit 1
fi
