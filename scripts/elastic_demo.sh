#!/usr/bin/env bash
# Elastic membership (`--nnodes MIN:MAX`, docs/multi-machine.md): three
# machines train together; one machine's launcher is killed (SIGKILL) at
# step KILL_AT_STEP; the other two form a new round and finish from the last
# checkpoint at world size 2. The sample logs show every sample of every
# epoch trained on exactly once, and the final loss is printed beside an
# uninterrupted 2-machine run's.
#
# The machines are network namespaces on a bridge (10.231.9.1-3, as root
# with iproute2: `make setup`), one launcher and one rank each, running
# `accel elastic-worker` on cpu-gloo; their traffic stays inside the
# namespaces, which the script removes at the end. Not root: launchers on
# this box over 127.0.0.1 instead (said at the start). The checkpoint folder
# is shared, as a cluster's shared file system would be.
#
#   scripts/elastic_demo.sh                 # ACCEL=path/to/accel to pick a build
#   KILL_AT_STEP=9 scripts/elastic_demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
target=${CARGO_TARGET_DIR:-target}
accel=${ACCEL:-$target/release/accel}
if [[ ! -x $accel ]]; then
  cargo build --release -p accel-launcher
fi
kill_at=${KILL_AT_STEP:-5}
len=96
epochs=2
work=$(mktemp -d "${TMPDIR:-/tmp}/accel-elastic-demo.XXXXXX")
ns=accel-ed$$
netns=false
if [[ $(id -u) == 0 ]] && command -v ip >/dev/null; then netns=true; fi
cleanup() {
  jobs -p | xargs -r kill -9 2>/dev/null || true
  [[ -f $work/e2.pid ]] && kill -9 "$(cat "$work/e2.pid")" 2>/dev/null || true
  if $netns; then
    for n in ${ns}m0 ${ns}m1 ${ns}m2 ${ns}sw; do
      ip netns pids "$n" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
      ip netns del "$n" 2>/dev/null || true
    done
  fi
  rm -rf "$work"
}
trap cleanup EXIT
od -An -tx1 -N16 /dev/urandom | tr -d ' \n' > "$work/token"
base=$((20000 + RANDOM % 20000))

# Three machines: namespaces m0-m2 with 10.231.9.1-3 on a bridge that sits in
# a namespace of its own (nothing touches this box's interfaces).
if $netns; then
  ip netns add ${ns}sw
  ip -n ${ns}sw link add br0 type bridge
  ip -n ${ns}sw link set br0 up
  for i in 0 1 2; do
    ip netns add ${ns}m$i
    ip link add eth0 netns ${ns}m$i type veth peer name p$i netns ${ns}sw
    ip -n ${ns}sw link set p$i master br0
    ip -n ${ns}sw link set p$i up
    ip -n ${ns}m$i addr add 10.231.9.$((i + 1))/24 dev eth0
    ip -n ${ns}m$i link set eth0 up
    ip -n ${ns}m$i link set lo up
  done
  main_addr=10.231.9.1
  echo "== machines: network namespaces ${ns}m0-2 (10.231.9.1-3) on a bridge"
else
  main_addr=127.0.0.1
  echo "== machines: launchers on this box over 127.0.0.1 (not root: no network namespaces)"
fi

# machine RANK NNODES PORT DIR: one launcher under a 300 s bound; `timeout`
# is $!, the launcher its child.
machine() {
  local in=()
  $netns && in=(ip netns exec "${ns}m$1")
  exec timeout 300 "${in[@]}" "$accel" launch --nnodes "$2" --node-rank "$1" \
    --master-addr $main_addr --master-port "$3" --token-file "$work/token" \
    --backend cpu-gloo --timeout 20s --join-window 2s --join-timeout 60s \
    --max-restarts 2 --quiet-ranks -- \
    "$accel" elastic-worker --train-len $len --epochs $epochs --save-every 2 \
    --step-delay-ms 200 --checkpoint-dir "$4/ck" --sample-log "$4/log"
}

# Every sample of every epoch once, counting each attempt's steps up to the
# step the next attempt resumed after.
check() {
  local log=$1 files=() a next lim
  for f in "$log"/a*-rank*.log; do files+=("$f"); done
  for f in "${files[@]}"; do
    a=$(basename "$f" | sed 's/^a\([0-9]*\)-.*/\1/')
    next="$log/a$((a + 1)).resumed"
    lim=999999999
    [[ -f $next ]] && lim=$(cat "$next")
    awk -v lim="$lim" '$2 <= lim { n = split($5, s, ","); for (i = 1; i <= n; i++) print $4, s[i] }' "$f"
  done | sort | uniq -c | awk -v want=$((len * epochs)) '
    $1 != 1 { bad++; if (bad <= 5) printf "  sample %s of epoch %s trained on %s times\n", $3, $2, $1 }
    { n++ }
    END {
      if (bad || n != want) { printf "  FAILED: %d distinct samples (want %d), %d not once\n", n, want, bad; exit 1 }
      printf "  every sample of the %d epochs trained on exactly once (%d samples)\n", want / 96, n
    }'
}

echo "== uninterrupted: 2 machines (--nnodes 2)"
mkdir -p "$work/fixed" "$work/elastic"
machine 0 2 $base "$work/fixed" >"$work/f0.out" 2>"$work/f0.err" &
f0=$!
machine 1 2 $base "$work/fixed" >"$work/f1.out" 2>"$work/f1.err" &
f1=$!
wait $f0 && wait $f1 || { cat "$work"/f0.err "$work"/f1.err; exit 1; }
grep 'final:' "$work/f0.out"

echo "== elastic: 3 machines (--nnodes 2:3); machine 2's launcher is killed after step $kill_at"
port=$((base + 1))
machine 0 2:3 $port "$work/elastic" >"$work/e0.out" 2>"$work/e0.err" &
e0=$!
machine 1 2:3 $port "$work/elastic" >"$work/e1.out" 2>"$work/e1.err" &
e1=$!
# Not a job of this shell, so that its end is not reported as "Killed".
(machine 2 2:3 $port "$work/elastic" >"$work/e2.out" 2>"$work/e2.err" & echo $! >"$work/e2.pid")
e2=$(cat "$work/e2.pid")
for _ in $(seq 600); do
  [[ $(cat "$work/elastic/log/a0-rank0.log" 2>/dev/null | wc -l) -ge $kill_at ]] && break
  sleep 0.1
done
victim=$(pgrep -P $e2)
kill -9 "$victim"
echo "  killed machine 2's launcher (pid $victim)"
wait $e0 && wait $e1 || { cat "$work"/e0.err "$work"/e1.err; exit 1; }
grep -h 'round [0-9]*: \|restarting' "$work/e0.err" | sed 's/^/  /'
grep -h 'resumed from' "$work/e0.out" | sed "s|$work/||; s/^/  /"
grep 'final:' "$work/e0.out"
echo "== the elastic run's sample log"
check "$work/elastic/log"

fixed=$(grep -o 'loss [0-9.]*' "$work/f0.out" | tail -1 | cut -d' ' -f2)
elastic=$(grep -o 'loss [0-9.]*' "$work/e0.out" | tail -1 | cut -d' ' -f2)
printf '== final loss over the %d training samples: uninterrupted 2 machines %s | elastic 3 -> 2 machines %s\n' \
  $len "$fixed" "$elastic"
