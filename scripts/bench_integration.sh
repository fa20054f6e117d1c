#!/usr/bin/env bash
# What the framework integrations cost per step: the digits demo's wide
# model (hidden 1024 by default) trained in one process through accel
# (accel-candle, accel-tch: an Accelerator of one rank, prepare, backward,
# the prepared optimizer) against the same model, data, batches and
# accumulation in the plain framework (`--plain`: candle-nn's AdamW,
# libtorch's AdamW), interleaved rounds.
#
#   scripts/bench_integration.sh [ROUNDS (5)] [EPOCHS (3)] [HIDDEN (1024)]
#
# Needs: target/release/candle-digits (cargo build --release -p
# accel-example-candle-digits), target-tch/release/tch-digits (make tch-demo
# builds it), the data set (make tch-setup).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
epochs=${2:-3}
hidden=${3:-1024}
source .accel-cache/tch/env.sh
flags=(--no-eval --save-every 0 --epochs "$epochs" --hidden "$hidden")
ms() { grep -o '[0-9.]* ms/step' | head -1 | cut -d' ' -f1; }
declare -A all
for r in $(seq 1 "$rounds"); do
  ca=$(target/release/candle-digits "${flags[@]}" 2>&1 | ms)
  cp=$(target/release/candle-digits --plain "${flags[@]}" 2>&1 | ms)
  ta=$(target-tch/release/tch-digits --no-log "${flags[@]}" 2>&1 | ms)
  tp=$(target-tch/release/tch-digits --plain "${flags[@]}" 2>&1 | ms)
  echo "round $r: accel-candle $ca, plain candle $cp, accel-tch $ta, plain tch $tp ms/step (load $(cut -d' ' -f1 /proc/loadavg))"
  all[ca]+="$ca "; all[cp]+="$cp "; all[ta]+="$ta "; all[tp]+="$tp "
done
python3 - "${all[ca]}" "${all[cp]}" "${all[ta]}" "${all[tp]}" <<'PY'
import statistics, sys
v = [[float(x) for x in s.split()] for s in sys.argv[1:]]
for name, acc, plain in [("candle", v[0], v[1]), ("tch", v[2], v[3])]:
    ma, mp = statistics.median(acc), statistics.median(plain)
    print(f"{name:7} accel median {ma:7.2f} ms/step, plain {mp:7.2f}: accel/plain {ma / mp:4.2f}x median, "
          f"{min(acc) / min(plain):4.2f}x best-vs-best")
PY
