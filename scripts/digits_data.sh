#!/usr/bin/env bash
# The 8x8 digits data set (scikit-learn's digits.csv.gz) alone, for the
# candle demo: no libtorch. Goes where scripts/tch_setup.sh puts it
# ($ACCEL_TCH_CACHE/data, default <repo>/.accel-cache/tch/data), so the two
# share one copy; nothing is fetched when it is already there.
# Usage: scripts/digits_data.sh   (prints the file's path)
# Environment: ACCEL_TCH_CACHE, PYTHON (default python3).
source "$(dirname "${BASH_SOURCE[0]}")/wheels.sh"
CACHE=${ACCEL_TCH_CACHE:-$ROOT/.accel-cache/tch}
SKLEARN_VERSION=1.5.2 # as scripts/tch_setup.sh
DATA=$CACHE/data
FILE=$DATA/digits.csv.gz

log() { echo "digits-data: $*" >&2; }

if [[ ! -s $FILE ]]; then
    need_pip
    command -v unzip >/dev/null || { log "unzip not found: apt-get install unzip"; exit 1; }
    mkdir -p "$CACHE/wheels" "$DATA"
    wheel=$(compgen -G "$CACHE/wheels/scikit_learn-$SKLEARN_VERSION-*.whl" | head -n1 || true)
    if [[ -z $wheel ]]; then
        log "downloading scikit-learn==$SKLEARN_VERSION (the wheel holds the data set)"
        pip_download "$CACHE/wheels" --python-version 3.11 --platform manylinux_2_17_x86_64 \
            "scikit-learn==$SKLEARN_VERSION"
        wheel=$(compgen -G "$CACHE/wheels/scikit_learn-$SKLEARN_VERSION-*.whl" | head -n1)
    fi
    # Extract next to the target, then rename: never a half-written file.
    tmp=$(mktemp -d "$DATA/.partial.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    unzip -q -o -j "$wheel" 'sklearn/datasets/data/digits.csv.gz' -d "$tmp"
    mv "$tmp/digits.csv.gz" "$FILE"
    log "extracted $FILE"
fi
echo "$FILE"
