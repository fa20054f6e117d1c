#!/usr/bin/env bash
# ms per optimizer step of the digits demo in four stacks, same run,
# interleaved rounds: candle-digits, tch-digits and burn-digits under
# `accel launch`, and
# the same model in PyTorch under Accelerate + DDP (tools/digits_ddp.py).
# All on 2 ranks over Gloo, batch 16 per rank, 2 accumulation steps, AdamW,
# no evaluation, no checkpoints, no logs.
#
#   scripts/bench_digits.sh [ROUNDS (3)] [EPOCHS (20)]
#
# Needs: target/release/{accel,candle-digits,burn-digits} (cargo build --release -p
# accel-launcher -p accel-example-candle-digits -p accel-example-burn-digits),
# target-tch/release/tch-digits
# (make tch-demo builds it), the torch venv (make torch-venv), the data set
# (make tch-setup).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
epochs=${2:-20}
accel=target/release/accel
data=.accel-cache/tch/data/digits.csv.gz
venv=.accel-cache/torch-venv/bin
source .accel-cache/tch/env.sh
flags=(--no-eval --save-every 0 --epochs "$epochs")
ms() { grep -o '[0-9.]* ms/step' | head -1 | cut -d' ' -f1; }
declare -A all
for r in $(seq 1 "$rounds"); do
  c=$("$accel" launch -n 2 --backend cpu-gloo -- target/release/candle-digits "${flags[@]}" 2>&1 | ms)
  t=$("$accel" launch -n 2 --backend cpu-gloo -- target-tch/release/tch-digits "${flags[@]}" --no-log 2>&1 | ms)
  # One rayon thread per rank, as burn's NdArray backend would otherwise take every core per rank.
  b=$(RAYON_NUM_THREADS=1 "$accel" launch -n 2 --backend cpu-gloo -- target/release/burn-digits "${flags[@]}" 2>&1 | ms)
  a=$(ACCELERATE_USE_CPU=1 PATH="$venv:$PATH" "$venv/accelerate" launch --multi_gpu --num_processes 2 \
      tools/digits_ddp.py --data "$data" --epochs "$epochs" 2>/dev/null | ms)
  echo "round $r: candle-digits $c ms/step, tch-digits $t ms/step, burn-digits $b ms/step, accelerate+DDP $a ms/step (load $(cut -d' ' -f1 /proc/loadavg))"
  all[candle]+="$c "; all[tch]+="$t "; all[burn]+="$b "; all[accel]+="$a "
done
python3 - "${all[candle]}" "${all[tch]}" "${all[burn]}" "${all[accel]}" <<'PY'
import statistics, sys
names = ["candle-digits", "tch-digits", "burn-digits", "accelerate+DDP"]
vals = [[float(v) for v in s.split()] for s in sys.argv[1:]]
ref_med, ref_best = statistics.median(vals[3]), min(vals[3])
for n, v in zip(names, vals):
    m, b = statistics.median(v), min(v)
    print(f"{n:15} median {m:6.2f} ms/step  best {b:6.2f}  vs accelerate+DDP: median {ref_med / m:4.2f}x, best-vs-best {ref_best / b:4.2f}x")
PY
