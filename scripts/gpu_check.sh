#!/usr/bin/env bash
# The cuda-nccl check for a lent GPU machine: one command, at most 8 minutes,
# every result under OUT_DIR. The machine has no cargo and no network: build
# the binaries here first (scripts/gpu_check_build.sh, make gpu-check-build)
# and carry target/gpu-check.
#
#   scripts/gpu_check.sh OUT_DIR            run it
#   scripts/gpu_check.sh OUT_DIR --dry-run  print the steps, run nothing
#                                           (works on any machine)
#
# Steps (each under its own timeout, all under one 450 s budget):
#   env        nvidia-smi, the pip NCCL (nvidia-nccl-cu13/cu12), the link folder
#   probe      accel env and accel env --json (the cuda-nccl row)
#   gpu-tests  the device-buffer tests at world size 1 (ACCEL_REQUIRE_GPU=1:
#              a skip is a failure)
#   conformance accel test --backend cuda-nccl -n 1 (host buffers, staged)
#   bench      accel bench --backend cuda-nccl -n 1 (nccl-tests table, staged)
#   async      accel bench --async 4: all-reduces started without waiting
#              against blocking ones (issue 38; gpu-tests also runs
#              started calls on device buffers, checked for issue order)
#   device     nccl_device_bench: H2D / D2H bandwidth, all_reduce and
#              all_gather on device buffers, all_reduce on staged host memory
#   xla-gpu    accel test --backend xla -n 1 on the machine's PJRT CUDA
#              plugin (jax's xla_cuda_plugin.so): the xla backend on a GPU
# OUT_DIR/summary.txt has one line per step with its exit code; the script
# exits non-zero when a step failed.
#
# Not run here: the tch digits demo on CUDA (tch 0.26 needs libtorch 2.13,
# the machine has torch 2.11, and libtorch's CUDA libraries exceed the
# carry limit) and multi-rank NCCL (NCCL refuses two ranks on one GPU).
set -uo pipefail

usage() { echo "usage: $0 OUT_DIR [--dry-run]" >&2; exit 64; }
[[ $# -ge 1 ]] || usage
out=$1
dry=0
[[ ${2:-} == --dry-run ]] && dry=1
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${ACCEL_GPU_BIN:-$root/target/gpu-check}
budget=${ACCEL_GPU_CHECK_BUDGET:-450}
start=$SECONDS
failed=0

mkdir -p "$out"
out=$(cd "$out" && pwd)
: >"$out/summary.txt"

# step NAME SECONDS CMD...: run CMD with stdout+stderr to OUT/NAME.log.
step() {
  local name=$1 limit=$2 rc
  shift 2
  local left=$((budget - (SECONDS - start)))
  ((limit > left)) && limit=$left
  if ((dry)); then
    printf 'would run (%ss): %s\n' "$limit" "$*" | tee -a "$out/summary.txt"
    return 0
  fi
  if ((limit <= 0)); then
    echo "$name: skipped (time budget spent)" | tee -a "$out/summary.txt"
    failed=1
    return 0
  fi
  echo "== $name ($limit s): $*" >&2
  timeout -k 5 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  echo "$name: rc=$rc ($((SECONDS - start)) s elapsed)" | tee -a "$out/summary.txt"
  ((rc == 0)) || failed=1
}

for b in accel accel-conformance-worker cuda_nccl_gpu_tests nccl_device_bench; do
  if [[ ! -x $bin/$b ]]; then
    echo "missing $bin/$b: run scripts/gpu_check_build.sh here first (make gpu-check-build)" | tee -a "$out/summary.txt"
    ((dry)) || exit 1
  fi
done

# The pip NCCL as libnccl.so (cudarc never opens libnccl.so.2).
linkdir=$out/nccl-link
if ((dry)); then
  echo "would link the pip NCCL's libnccl.so.2 as $linkdir/libnccl.so and put it on LD_LIBRARY_PATH" | tee -a "$out/summary.txt"
else
  ncclso=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "lib", "libnccl.so.2"))' 2>/dev/null) || ncclso=
  if [[ ! -f $ncclso ]]; then
    # Another wheel layout: search the site-packages folders.
    ncclso=$(python3 -c 'import site; print("\n".join(site.getsitepackages()))' 2>/dev/null |
      while read -r d; do find "$d" -maxdepth 5 -name libnccl.so.2 2>/dev/null; done | head -1)
  fi
  if [[ -n $ncclso && -f $ncclso ]]; then
    mkdir -p "$linkdir"
    ln -sfn "$ncclso" "$linkdir/libnccl.so"
    export ACCEL_NCCL_LIB=$ncclso
    nccldir=$(dirname "$ncclso")
    export LD_LIBRARY_PATH=$linkdir:$nccldir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  else
    # No downloads there: report and go on (the probe will say why).
    echo "env: no pip NCCL (python3 -c 'import nvidia.nccl' failed); nothing can be installed here" | tee -a "$out/summary.txt"
  fi
fi
export ACCEL_TIMEOUT=${ACCEL_TIMEOUT:-60s}

# What the machine is (each command bounded; not a step: no rc to judge).
if ((dry)); then
  echo "would write $out/env.log: nvidia-smi, pip's NCCL, the loader path, the binaries" | tee -a "$out/summary.txt"
else
  {
    date -u
    timeout 15 nvidia-smi -L
    timeout 15 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    timeout 30 python3 -m pip show nvidia-nccl-cu13 nvidia-nccl-cu12 2>/dev/null | grep -E '^(Name|Version|Location)'
    echo "ACCEL_NCCL_LIB=${ACCEL_NCCL_LIB:-}"
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
    echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-<unset>}"
    ls -l "$bin"
  } >"$out/env.log" 2>&1
fi
step probe-json 20 "$bin/accel" env --json
step probe 20 "$bin/accel" env
step gpu-tests 90 env ACCEL_REQUIRE_GPU=1 "$bin/cuda_nccl_gpu_tests" --test-threads=1
step conformance 90 "$bin/accel" test --backend cuda-nccl -n 1 --timeout 60s --world-timeout 85s \
  --worker "$bin/accel-conformance-worker" --json "$out/conformance.json"
step bench 60 "$bin/accel" bench --backend cuda-nccl -n 1 --op all_reduce --sizes 4K:64M
# Calls started without waiting (issue 38): 4 all-reduces in flight against
# 4 blocking ones, per call (the device-buffer case is in gpu-tests:
# started_calls_on_device_memory, handles done in issue order).
step async 40 "$bin/accel" bench --backend cuda-nccl -n 1 --op all_reduce --sizes 64K:16M --async 4
step device 60 "$bin/nccl_device_bench" $((256 << 20))
# The xla backend on the machine's PJRT GPU plugin (jax-cuda13-pjrt's
# .so), world size 1 on a real GPU: the whole suite, the async family too.
if ((dry)); then
  echo "would find jax's PJRT CUDA plugin (xla_cuda_plugin.so under site-packages/jax_plugins) and set ACCEL_PJRT_PLUGIN to it" | tee -a "$out/summary.txt"
  pjrt=
else
  pjrt=$(python3 -c 'import site; print("\n".join(site.getsitepackages()))' 2>/dev/null |
    while read -r d; do find "$d/jax_plugins" -maxdepth 2 -name 'xla_cuda_plugin.so' 2>/dev/null; done | head -1)
  [[ -n $pjrt ]] || echo "xla-gpu: no jax PJRT CUDA plugin found under site-packages/jax_plugins" | tee -a "$out/summary.txt"
fi
if ((dry)) || [[ -n $pjrt ]]; then
  step xla-gpu 70 env ACCEL_PJRT_PLUGIN="${pjrt:-<jax_plugins/xla_cuda*/xla_cuda_plugin.so>}" \
    "$bin/accel" test --backend xla -n 1 --timeout 60s --world-timeout 85s \
    --worker "$bin/accel-conformance-worker" --json "$out/xla-gpu.json"
fi

echo "total: $((SECONDS - start)) s; results in $out" | tee -a "$out/summary.txt"
exit $failed
