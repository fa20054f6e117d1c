#!/usr/bin/env bash
# The README's main job: a real data-parallel training run on two local
# ranks over cpu-gloo (examples/train). The main process prints the loss of
# every optimizer step, the evaluation metric of every epoch (gathered with
# gather_for_metrics) and a checksum of the final parameters; a checkpoint
# is saved every 5 steps under target/train-demo/checkpoints.
#
#   scripts/demo.sh                      # uninterrupted run
#   scripts/demo.sh --stop-after 23      # stop mid-run (or kill it: Ctrl-C)
#   scripts/demo.sh --resume             # continue from the newest checkpoint
#
# Any other flag goes to the demo (`target/release/train --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
target=${CARGO_TARGET_DIR:-target}
accel=$target/release/accel
train=$target/release/train
if [[ ! -x $accel || ! -x $train ]]; then
  cargo build --release -p accel-launcher -p accel-example-train
fi
exec "$accel" launch -n 2 --backend cpu-gloo -- "$train" "$@"
