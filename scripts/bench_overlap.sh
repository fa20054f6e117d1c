#!/usr/bin/env bash
# Overlapped against blocking gradient sync on a model whose sync matters:
# the digits MLP made wide (--hidden H: 64 -> H -> H -> 10, about H^2
# parameters), 2 ranks over cpu-gloo, in four accel configurations (tch and
# candle, each overlapped and --no-overlap) and Accelerate + DDP (gloo), same
# run, interleaved rounds. Per run: ms per optimizer step and the ms of
# gradient sync left after the backward ("exposed"); the --no-overlap run's
# exposed sync is the whole sync, so 1 - exposed(overlap) / exposed(blocking)
# is the share the backward hid. Two more rows say what glibc's allocator
# setting (ADR 0038) contributes: accel tch overlapped with
# ACCEL_MALLOC=system (glibc's defaults, as before it), and Accelerate +
# DDP given the same setting through glibc's environment variables
# (MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=536870912).
#
#   scripts/bench_overlap.sh [HIDDEN (4096)] [ROUNDS (3)] [STEPS (10)]
#   BACKEND=mpi scripts/bench_overlap.sh 2048
#
# Needs: target/release/{accel,candle-digits} (cargo build --release -p
# accel-launcher --features mpi -p accel-example-candle-digits),
# target-tch/release/tch-digits (make tch-demo builds it), the torch venv
# (make torch-venv), the data set (make tch-setup).
set -euo pipefail
cd "$(dirname "$0")/.."
hidden=${1:-4096}
rounds=${2:-3}
steps=${3:-10}
backend=${BACKEND:-cpu-gloo}
accel=target/release/accel
data=.accel-cache/tch/data/digits.csv.gz
venv=.accel-cache/torch-venv/bin
source .accel-cache/tch/env.sh
# batch 16 x 2 ranks x 2 accumulation steps per optimizer step.
train_len=$((steps * 16 * 2 * 2))
flags=(--no-eval --save-every 0 --epochs 1 --train-len "$train_len" --hidden "$hidden")
ms() { grep -o '[0-9.]* ms/step' | head -1 | cut -d' ' -f1; }
exposed() { grep -o '[0-9.]* ms exposed sync' | head -1 | cut -d' ' -f1; }
declare -A step sync
run() { # name, command...
  local name=$1; shift
  local out
  out=$("$@" 2>&1) || { echo "$name failed:"; echo "$out" | tail -5; exit 1; }
  step[$name]+="$(echo "$out" | ms) "
  sync[$name]+="$(echo "$out" | exposed) "
}
accelerate_ddp() {
  ACCELERATE_USE_CPU=1 PATH="$venv:$PATH" "$venv/accelerate" launch --multi_gpu --num_processes 2 \
    tools/digits_ddp.py --data "$data" --epochs 1 --hidden "$hidden" --train-len "$train_len" 2>/dev/null
}
for r in $(seq 1 "$rounds"); do
  load=$(cut -d' ' -f1 /proc/loadavg)
  run candle-overlap "$accel" launch -n 2 --backend "$backend" -- target/release/candle-digits "${flags[@]}"
  run candle-blocking "$accel" launch -n 2 --backend "$backend" -- target/release/candle-digits "${flags[@]}" --no-overlap
  run tch-overlap "$accel" launch -n 2 --backend "$backend" -- target-tch/release/tch-digits "${flags[@]}" --no-log
  run tch-blocking "$accel" launch -n 2 --backend "$backend" -- target-tch/release/tch-digits "${flags[@]}" --no-log --no-overlap
  run tch-system env ACCEL_MALLOC=system "$accel" launch -n 2 --backend "$backend" -- target-tch/release/tch-digits "${flags[@]}" --no-log
  a=$(accelerate_ddp | ms)
  step[accelerate-ddp]+="$a "
  step[accelerate-kept]+="$(MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=536870912 accelerate_ddp | ms) "
  echo "round $r (load $load -> $(cut -d' ' -f1 /proc/loadavg)): tch $(echo "${step[tch-overlap]}" | awk '{print $NF}') / $(echo "${step[tch-blocking]}" | awk '{print $NF}') ms, candle $(echo "${step[candle-overlap]}" | awk '{print $NF}') / $(echo "${step[candle-blocking]}" | awk '{print $NF}') ms (overlap / blocking), accelerate+DDP $a ms; tch with glibc's defaults $(echo "${step[tch-system]}" | awk '{print $NF}') ms, accelerate+DDP keeping freed memory $(echo "${step[accelerate-kept]}" | awk '{print $NF}') ms"
done
python3 - "$hidden" "$backend" \
  "${step[tch-overlap]}" "${sync[tch-overlap]}" "${step[tch-blocking]}" "${sync[tch-blocking]}" \
  "${step[candle-overlap]}" "${sync[candle-overlap]}" "${step[candle-blocking]}" "${sync[candle-blocking]}" \
  "${step[accelerate-ddp]}" "${step[tch-system]}" "${sync[tch-system]}" "${step[accelerate-kept]}" <<'PY'
import statistics as st, sys
hidden, backend = sys.argv[1], sys.argv[2]
f = lambda s: [float(v) for v in s.split()]
tco, tcs, tbo, tbs, cco, ccs, cbo, cbs, acc, tso, tss, kept = map(f, sys.argv[3:])
ref_m, ref_b = st.median(acc), min(acc)
print(f"\n--hidden {hidden}, 2 ranks, {backend}; medians over rounds (best in brackets)\n")
print("| run | ms/step | exposed sync ms | sync hidden | vs Accelerate + DDP (median, best-vs-best) |")
print("|---|---|---|---|---|")
for name, steps, sync, whole in [("accel tch, overlapped", tco, tcs, tbs), ("accel tch, blocking", tbo, tbs, tbs),
                                  ("accel candle, overlapped", cco, ccs, cbs), ("accel candle, blocking", cbo, cbs, cbs),
                                  ("accel tch, overlapped, ACCEL_MALLOC=system", tso, tss, tbs)]:
    hid = 1 - st.median(sync) / st.median(whole) if st.median(whole) > 0 else 0
    print(f"| {name} | {st.median(steps):.2f} ({min(steps):.2f}) | {st.median(sync):.2f} | {100*hid:.0f} % | {ref_m/st.median(steps):.2f}x, {ref_b/min(steps):.2f}x |")
print(f"| Accelerate + DDP (gloo) | {ref_m:.2f} ({ref_b:.2f}) | | | 1.00x |")
print(f"| Accelerate + DDP (gloo), glibc keeping freed memory | {st.median(kept):.2f} ({min(kept):.2f}) | | | {ref_m/st.median(kept):.2f}x, {ref_b/min(kept):.2f}x |")
print(f"\naccel tch overlapped against Accelerate + DDP with the same allocator setting: "
      f"{st.median(kept)/st.median(tco):.2f}x at the median, {min(kept)/min(tco):.2f}x best-vs-best")
PY
