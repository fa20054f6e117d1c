#!/usr/bin/env bash
# Print a folder holding `libnccl.so` for LD_LIBRARY_PATH, making it if needed.
#
# cudarc (the cuda-nccl backend) opens NCCL as `libnccl.so`; the PyPI wheels
# (nvidia-nccl-cu12 / nvidia-nccl-cu13, what PyTorch installs) ship only
# `libnccl.so.2`, and the loader reads LD_LIBRARY_PATH only at process start.
# This script finds libnccl.so.2 and links it as libnccl.so in a folder:
#
#   export LD_LIBRARY_PATH="$(scripts/nccl_libdir.sh)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
#
# Looks in: $ACCEL_NCCL_LIB (the file or its folder), the `nvidia.nccl` Python
# package of python3, then the loader cache (ldconfig -p). The link folder is
# $1, or ${XDG_CACHE_HOME:-$HOME/.cache}/accel/nccl-link. Exits 1 (with the
# reason on stderr) when no libnccl.so.2 is found.
set -euo pipefail

into=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/accel/nccl-link}

find_lib() {
  local c
  if [[ -n ${ACCEL_NCCL_LIB:-} ]]; then
    for c in "$ACCEL_NCCL_LIB" "$ACCEL_NCCL_LIB/libnccl.so.2"; do
      [[ -f $c ]] && { echo "$c"; return 0; }
    done
  fi
  if command -v python3 >/dev/null; then
    c=$(python3 -c 'import nvidia.nccl, os; d = nvidia.nccl.__path__[0]; print(os.path.join(d, "lib", "libnccl.so.2"))' 2>/dev/null || true)
    [[ -n $c && -f $c ]] && { echo "$c"; return 0; }
  fi
  if command -v ldconfig >/dev/null; then
    c=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 /{print $NF; exit}')
    [[ -n $c && -f $c ]] && { echo "$c"; return 0; }
  fi
  return 1
}

if ! lib=$(find_lib); then
  echo "nccl_libdir: no libnccl.so.2 found: pip install nvidia-nccl-cu12 (or -cu13), or set ACCEL_NCCL_LIB" >&2
  exit 1
fi
mkdir -p "$into"
ln -sfn "$lib" "$into/libnccl.so"
echo "$into"
