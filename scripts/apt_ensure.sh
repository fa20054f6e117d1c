#!/usr/bin/env bash
# Install the Debian packages that are missing (with sudo when not root).
#   scripts/apt_ensure.sh STEP PACKAGE...   STEP names the make step in messages
set -euo pipefail
step=$1; shift
missing=()
for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [[ ${#missing[@]} -eq 0 ]]; then
    echo "$step: system packages present"; exit 0
fi
echo "$step: installing ${missing[*]}"
SUDO=""; [[ $(id -u) = 0 ]] || SUDO=sudo
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}"
