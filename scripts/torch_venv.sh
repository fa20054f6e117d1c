#!/usr/bin/env bash
# A Python venv with torch 2.13.0 (CPU use) and accelerate 1.15.0 for the torch
# interop tests, at .accel-cache/torch-venv (or $ACCEL_TORCH_VENV).
# torch comes from the wheel `make tch-setup` already downloaded for libtorch,
# with only the CUDA runtime wheels that tch-setup fetched too; the other CUDA
# libraries the wheel links (cuDNN, cuBLAS, NCCL, ~3 GB) are replaced by empty
# stand-ins (tools/torch_cpu_stubs.py) that a CPU `import torch` never calls.
# Downloads beyond tch-setup's: accelerate and torch's small pure-Python
# dependencies (~25 MB). Idempotent: a finished venv costs nothing.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${ACCEL_TORCH_VENV:-$ROOT/.accel-cache/torch-venv}
WHEELS=${ACCEL_TCH_CACHE:-$ROOT/.accel-cache/tch}/wheels
PY=${PYTHON:-python3}
STAMP=$VENV/.done-torch-2.13.0-accelerate-1.15.0
log() { echo "torch-venv: $*" >&2; }

if [[ -f $STAMP ]] && "$VENV/bin/python" -c "import torch.distributed, accelerate" 2>/dev/null; then
    log "present ($VENV)"; exit 0
fi
start=$(date +%s)
shopt -s nullglob
torch_whl=("$WHEELS"/torch-2.13.0-*.whl)
[[ ${#torch_whl[@]} -eq 1 ]] || { log "no torch 2.13.0 wheel in $WHEELS: run make tch-setup first"; exit 1; }
rm -rf "$VENV"
"$PY" -m venv "$VENV" 2>/dev/null || {
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q python3-venv
    rm -rf "$VENV"; "$PY" -m venv "$VENV"; }
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
"${PIP[@]}" --no-deps "${torch_whl[0]}" "$WHEELS"/nvidia_cuda_runtime-*.whl "$WHEELS"/nvidia_cuda_cupti-*.whl
# torch's own pure-Python requirements, then accelerate without pulling torch's CUDA wheels.
"${PIP[@]}" "typing-extensions>=4.10" filelock "sympy>=1.13.3" networkx jinja2 fsspec "numpy==2.4.6"
"${PIP[@]}" --no-deps "accelerate==1.15.0"
"${PIP[@]}" psutil pyyaml "huggingface_hub==2.4.0" "safetensors==0.8.0" packaging
SP=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$PY" "$ROOT/tools/torch_cpu_stubs.py" "$SP"
"$VENV/bin/python" -c "import torch, torch.distributed as d, accelerate; assert d.is_available(); assert not torch.cuda.is_available(); print('torch-venv: torch', torch.__version__, 'accelerate', accelerate.__version__)" >&2
touch "$STAMP"
log "done in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))"
