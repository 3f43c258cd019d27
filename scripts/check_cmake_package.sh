#!/usr/bin/env bash
# Installs the project from BUILD into a scratch prefix and builds examples/cpp against it
# with find_package(TorchMonarch), as a user's own CMake project would. Prints the path of
# the example binary it built.
#   scripts/check_cmake_package.sh BUILD WORKDIR
set -euo pipefail
build=${1:?build directory}
work=${2:?scratch directory}
root=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$work/prefix"
cmake --install "$build" --prefix "$work/prefix" >/dev/null
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$root/examples/cpp" -B "$work/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" >"$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" --parallel 2 >"$work/build.log" 2>&1 || { tail -50 "$work/build.log"; exit 1; }
echo "$work/build/train_gpt"
