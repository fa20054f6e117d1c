#!/usr/bin/env bash
# Build, on a machine WITHOUT a GPU, the release binaries scripts/gpu_check.sh
# runs on the lent GPU machine (which has no cargo), into target/gpu-check/.
# cpu-gloo and mpi are left out (--no-default-features --features
# cuda-nccl,xla): libgloo and libmpi are not installed there; xla loads its
# PJRT plugin at run time (the machine's jax CUDA plugin). Prints what to carry.
#
#   scripts/gpu_check_build.sh          (make gpu-check-build)
#
# Note: this rebuilds target/release/accel and accel-conformance-worker with
# only cuda-nccl; `make build` puts the default ones back.
set -euo pipefail
cd "$(dirname "$0")/.."
CARGO=${CARGO:-cargo}
out=target/gpu-check
feat=(--no-default-features --features "cuda-nccl,xla")

$CARGO build --release -p accel-launcher -p accel-conformance "${feat[@]}"
$CARGO build --release -p accel-backend-cuda-nccl --example nccl_device_bench
tests_bin=$($CARGO test --release -p accel-backend-cuda-nccl --test gpu --no-run --message-format=json \
  | python3 -c 'import sys, json
for l in sys.stdin:
    try: m = json.loads(l)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu":
        print(m["executable"])')

rm -rf "$out"; mkdir -p "$out"
cp target/release/accel target/release/accel-conformance-worker \
   target/release/examples/nccl_device_bench "$out/"
cp "$tests_bin" "$out/cuda_nccl_gpu_tests"
cp scripts/nccl_libdir.sh "$out/"
# Line tables are not needed there; stay well under the 64 MiB carry limit.
strip "$out"/accel "$out"/accel-conformance-worker "$out"/nccl_device_bench "$out"/cuda_nccl_gpu_tests 2>/dev/null || true
for b in "$out"/accel "$out"/accel-conformance-worker; do
  if ldd "$b" 2>/dev/null | grep -Eq 'libgloo|libmpi'; then
    echo "gpu_check_build: $b links libgloo or libmpi: it will not start on the GPU machine" >&2
    exit 1
  fi
done
# The GPU machine's glibc may be older than this one's: show what is needed.
for b in "$out"/*; do
  [[ -x $b && ! -L $b && $b != *.sh ]] || continue
  need=$(objdump -T "$b" 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
  echo "$(basename "$b") needs ${need:-?}"
done
total=$(du -cb "$out"/* | awk 'END{print $1}')
ls -l "$out"
echo "total: $((total / 1024 / 1024)) MiB (limit 64 MiB)"
[[ $total -lt $((64 * 1024 * 1024)) ]] || { echo "gpu_check_build: over the carry limit" >&2; exit 1; }
echo "carry: [\"$out\"]   run there: scripts/gpu_check.sh \"\$OUT\""
