#!/usr/bin/env bash
# Installs the Debian packages the project builds and tests with that are not already present
# (Debian 12 or 13). Idempotent: a machine that has everything runs no apt command at all.
# Python packages, torch among them, come from PyPI into .venv (requirements.txt, `make venv`);
# Debian provides only the C++ libraries, the build tools and the browser the report tests use.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache
  nlohmann-json3-dev libspdlog-dev catch2
  libgloo-dev          # gloo's headers: torch's wheels ship gloo's library, not its headers
  python3-venv python3-dev   # for a Debian python3 (venv, Python.h); a pyenv python3 has its own
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
