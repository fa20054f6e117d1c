#!/usr/bin/env bash
# Fetch and unpack what the tch integration (integrations/tch, examples/tch-digits) needs:
#   * libtorch 2.13.0 (the version tch 0.26 requires) from PyPI's torch wheel: its CPU part
#     only (libtorch_cpu, libtorch, libc10, libgomp and the headers; the 0.5 GB of CUDA
#     libraries are left in the wheel),
#   * libcudart.so.13 and libcupti.so.13, which libtorch_cpu links, from the
#     nvidia-cuda-runtime and nvidia-cuda-cupti wheels (the pins torch 2.13.0's
#     cuda-toolkit==13.0.3 requirement resolves to),
#   * the 8x8 digits data set (1,797 images) from the scikit-learn wheel.
# Everything goes under a cache folder laid out like a pip site-packages
# (torch/, nvidia/cu13/), so libtorch_cpu's own RPATH ($ORIGIN/../../nvidia/cu13/lib)
# finds the CUDA runtime; no LD_LIBRARY_PATH is needed.
#
# Usage: scripts/tch_setup.sh            fetch/unpack if needed, write $CACHE/env.sh
#        scripts/tch_setup.sh --print    also print the exports (for eval)
# Environment: ACCEL_TCH_CACHE (default <repo>/.accel-cache/tch), PYTHON (default python3).
# Idempotent: a finished set-up is detected by a stamp file and costs nothing.
source "$(dirname "${BASH_SOURCE[0]}")/wheels.sh"
CACHE=${ACCEL_TCH_CACHE:-$ROOT/.accel-cache/tch}

TORCH_VERSION=2.13.0
CUDART_VERSION=13.0.96
CUPTI_VERSION=13.0.85
SKLEARN_VERSION=1.5.2

WHEELS=$CACHE/wheels
SP=$CACHE/site-packages
DATA=$CACHE/data
STAMP=$CACHE/.done-torch-$TORCH_VERSION-cudart-$CUDART_VERSION-cupti-$CUPTI_VERSION-sklearn-$SKLEARN_VERSION

log() { echo "tch-setup: $*" >&2; }

write_env() {
    cat >"$CACHE/env.sh" <<EOF
# Written by scripts/tch_setup.sh; source it before building integrations/.
export LIBTORCH="$SP/torch"
export ACCEL_DIGITS_CSV="$DATA/digits.csv.gz"
EOF
}

if [[ ! -f $STAMP ]]; then
    need_pip
    mkdir -p "$WHEELS" "$DATA"
    start=$(date +%s)

    # Fixed python/platform tags so the same files come down whatever the local Python is
    # (libtorch inside is the same in every cp3x wheel).
    fetch() { # fetch <requirement> [pip download flags...]
        local req=$1; shift
        log "downloading $req"
        pip_download "$WHEELS" "$@" "$req"
    }
    fetch "torch==$TORCH_VERSION" --python-version 3.11 --platform manylinux_2_28_x86_64
    fetch "nvidia-cuda-runtime==$CUDART_VERSION"
    fetch "nvidia-cuda-cupti==$CUPTI_VERSION"
    fetch "scikit-learn==$SKLEARN_VERSION" --python-version 3.11 --platform manylinux_2_17_x86_64
    fetched=$(date +%s)

    wheel() { # the one wheel file matching a glob
        local w
        w=$(compgen -G "$WHEELS/$1" | head -n1) || true
        [[ -n $w ]] || { log "no wheel matches $1 in $WHEELS"; exit 1; }
        echo "$w"
    }
    rm -rf "$SP.partial" && mkdir -p "$SP.partial"
    log "unpacking libtorch (CPU part) and the CUDA runtime"
    unzip -q -o "$(wheel "torch-$TORCH_VERSION-*.whl")" -d "$SP.partial" \
        'torch/include/*' 'torch/lib/libc10.so' 'torch/lib/libtorch.so' \
        'torch/lib/libtorch_cpu.so' 'torch/lib/libgomp.so.1' 'torch/lib/libshm.so' \
        'torch/lib/libtorch_global_deps.so' 'torch/version.py'
    unzip -q -o "$(wheel "nvidia_cuda_runtime-$CUDART_VERSION-*.whl")" -d "$SP.partial" \
        'nvidia/cu13/lib/libcudart.so.13'
    unzip -q -o "$(wheel "nvidia_cuda_cupti-$CUPTI_VERSION-*.whl")" -d "$SP.partial" \
        'nvidia/cu13/lib/libcupti.so.13'
    # torch-sys checks $LIBTORCH/build-version against the version tch expects.
    sed -n "s/^__version__ = '\([^']*\)'.*/\1/p" "$SP.partial/torch/version.py" \
        >"$SP.partial/torch/build-version"
    [[ $(cat "$SP.partial/torch/build-version") == "$TORCH_VERSION"* ]] \
        || { log "unexpected torch version in the wheel: $(cat "$SP.partial/torch/build-version")"; exit 1; }
    rm -rf "$SP" && mv "$SP.partial" "$SP"

    log "extracting the digits data set"
    unzip -q -o -j "$(wheel "scikit_learn-$SKLEARN_VERSION-*.whl")" \
        'sklearn/datasets/data/digits.csv.gz' -d "$DATA"

    # The wheels stay (528 MB) so that a re-run after deleting site-packages/ needs no
    # network; ACCEL_TCH_KEEP_WHEELS=0 drops them.
    if [[ ${ACCEL_TCH_KEEP_WHEELS:-1} == 0 ]]; then rm -f "$WHEELS"/*.whl; fi
    end=$(date +%s)
    write_env
    touch "$STAMP"
    log "done in $((end - start)) s (download $((fetched - start)) s, unpack $((end - fetched)) s);" \
        "unpacked $(du -sh "$SP" | cut -f1), wheels $(du -sh "$WHEELS" | cut -f1)"
else
    write_env
fi

log "environment in $CACHE/env.sh (LIBTORCH=$SP/torch)"
if [[ ${1:-} == --print ]]; then cat "$CACHE/env.sh"; fi
