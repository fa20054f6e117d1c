#!/usr/bin/env bash
# The README's main job: a real multi-process run on two local ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/accel
if ! "$bin" launch --help >/dev/null 2>&1; then
  echo "demo: 'accel launch' is not there yet; showing the probe table instead"
  exec "$bin" env
fi
exec "$bin" launch -n 2 -- target/release/examples/train "$@"
