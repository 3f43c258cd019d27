#!/usr/bin/env bash
# Installs every Debian package the project needs that is not already present.
# Idempotent: a machine that has everything runs no apt command at all.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache
  nlohmann-json3-dev libspdlog-dev catch2 pybind11-dev
  libtorch-dev libgloo-dev
  python3 python3-dev python3-pip python3-venv python3-setuptools python3-wheel
  python3-pytest python3-numpy python3-torch python3-torchvision python3-pybind11
  chromium fonts-dejavu-core
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#PACKAGES[@]} Debian packages present"
  exit 0
fi

echo "install_deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
