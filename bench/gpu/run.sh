#!/usr/bin/env bash
# GPU check and bench of kernels/ (issue 14, item 6). Configures and builds the project against
# this machine's torch with the CUDA kernels (MONARCH_WITH_CUDA=ON), builds only what it needs
# (monarch_kernels_capi, monarch_kernels_cuda, test_kernels), runs the kernel tests, then
# bench/gpu/kernels.py: every CUDA kernel against its CPU reference and torch on CUDA, timed.
#   bench/gpu/run.sh [--dry-run] [--build-dir DIR] [--skip-build] [--out FILE]
#   --dry-run     no GPU: configure/build without CUDA, kernels.py --cpu (CPU references vs torch CPU)
#   --build-dir   build directory (default build-gpu, or build-gpu-dry with --dry-run)
#   --skip-build  reuse an existing build directory
#   --out         JSON results (default bench/results/gpu.json, bench/results/gpu-dry.json with --dry-run)
#   --no-nccl     skip the last step: building test_runtime and running its [nccl] tests (the
#                 NCCL backend on one GPU: all-reduce, all-gather, grouped send/recv); that step
#                 runs only on a GPU and only when the whole project configured
# PYTHON selects the interpreter (default: .venv/bin/python if present, else python3).
# If the whole project does not configure here (e.g. no nlohmann_json/spdlog/Catch2), kernels/
# is configured on its own: the C ABI and CUDA library build, the Catch2 kernel tests are skipped.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dry=0 skip=0 nccl=1 build="" out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --skip-build) skip=1 ;;
    --no-nccl) nccl=0 ;;
    --build-dir) build=$2; shift ;;
    --out) out=$2; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$root/.venv/bin/python" ]; then PYTHON=$root/.venv/bin/python; else PYTHON=python3; fi
fi
if [ $dry = 1 ]; then cuda=OFF; mode=(--cpu); else cuda=ON; mode=(); fi
build=${build:-$root/build-gpu$([ $dry = 1 ] && echo -dry || true)}
out=${out:-$root/bench/results/gpu$([ $dry = 1 ] && echo -dry || true).json}
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
jobs=$(nproc)
t0=$(date +%s)
echo "== python: $PYTHON ($("$PYTHON" -c 'import torch;print("torch", torch.__version__, "cuda", torch.version.cuda)'))"

tests=1
if [ $skip = 0 ]; then
  # LibTorch, pybind11 and NCCL (the nvidia-nccl wheel beside a CUDA torch) are found through
  # the interpreter (cmake/monarch_torch.cmake, csrc/CMakeLists.txt); kernels/ alone needs the prefix.
  prefix=$("$PYTHON" -c 'import torch;print(torch.utils.cmake_prefix_path)')
  common=(-DCMAKE_BUILD_TYPE=Release "-DPython3_EXECUTABLE=$PYTHON" "-DCMAKE_PREFIX_PATH=$prefix" -DMONARCH_WITH_CUDA=$cuda)
  echo "== configure $build (MONARCH_WITH_CUDA=$cuda)"
  mkdir -p "$build"
  log=$build/monarch-configure.log
  if cmake -S "$root" -B "$build" "${generator[@]}" "${common[@]}" -DMONARCH_WITH_TORCH=ON \
       -DMONARCH_BUILD_PYTHON=OFF -DMONARCH_BUILD_EXAMPLES=OFF -DMONARCH_BUILD_BENCH=OFF \
       -DMONARCH_BUILD_TOOLS=OFF >"$log" 2>&1; then
    targets=(monarch_kernels_capi test_kernels)
  else
    echo "!! the whole project does not configure here (tail of $log):"
    tail -5 "$log"
    echo "!! configuring kernels/ on its own: no Catch2 kernel tests"
    build=$build/kernels-only
    cmake -S "$root/kernels" -B "$build" "${generator[@]}" "${common[@]}"
    targets=(monarch_kernels_capi)
    tests=0
  fi
  [ $cuda = ON ] && targets+=(monarch_kernels_cuda)
  echo "== build ${targets[*]} (-j$jobs)"
  cmake --build "$build" --target "${targets[@]}" -j"$jobs"
elif [ -f "$build/kernels-only/CMakeCache.txt" ]; then
  build=$build/kernels-only
  tests=0
fi
t1=$(date +%s)

if [ $tests = 1 ]; then
  echo "== test_kernels"
  "$build/bin/test_kernels"
fi
lib=$build/lib/libmonarch_kernels_capi.so
echo "== kernels.py ${mode[*]:-}"
"$PYTHON" "$root/bench/gpu/kernels.py" --lib "$lib" "${mode[@]}" --out "$out"
if [ $nccl = 1 ] && [ $dry = 0 ] && [ $tests = 1 ]; then
  # Last, so the kernel results are written even if this build or a test fails.
  echo "== NCCL backend: build test_runtime, run [nccl]"
  cmake --build "$build" --target test_runtime -j"$jobs"
  "$build/bin/test_runtime" "[nccl]"
fi
echo "== done: build $((t1 - t0)) s, tests and bench $(($(date +%s) - t1)) s"
