"""Builds torch_monarch._C with the project's CMake (metadata lives in pyproject.toml).

    pip install --no-build-isolation .        # or -e . for an editable install

The CMake build directory is build/python-<interpreter>-<platform>-<environment> in the source
tree and is reused between runs, so a rebuild only recompiles what changed. Extra CMake arguments
can be given in the CMAKE_ARGS environment variable (e.g. CMAKE_ARGS="-G Ninja").
"""

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


class CMakeExtension(Extension):
    def __init__(self, name, source_dir=ROOT):
        super().__init__(name, sources=[])
        self.source_dir = os.path.abspath(source_dir)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        # Where setuptools expects the module (build/lib.../torch_monarch, or the source
        # tree for --inplace / editable installs).
        ext_path = os.path.abspath(self.get_ext_fullpath(ext.name))
        ext_dir = os.path.dirname(ext_path)
        os.makedirs(ext_dir, exist_ok=True)

        # One build folder per interpreter and environment: CMake caches the torch (and
        # pybind11) it found, so a second venv with another torch must not reuse it.
        tag = "{}{}{}-{}-{}".format(sys.implementation.name, *sys.version_info[:2], sysconfig.get_platform(),
                                    hashlib.sha1(sys.prefix.encode()).hexdigest()[:8])
        build_dir = os.path.join(ext.source_dir, "build", "python-" + tag)
        os.makedirs(build_dir, exist_ok=True)

        config = "Debug" if self.debug else "Release"
        configure = [
            "cmake", "-S", ext.source_dir, "-B", build_dir,
            "-DCMAKE_BUILD_TYPE=" + config,
            "-DMONARCH_BUILD_PYTHON=ON",
            "-DMONARCH_BUILD_TESTS=OFF",
            "-DMONARCH_BUILD_BENCH=OFF",
            "-DMONARCH_BUILD_TOOLS=OFF",
            "-DMONARCH_WITH_TORCH=" + ("ON" if WITH_RUNTIME else "OFF"),
            "-DPython3_EXECUTABLE=" + sys.executable,
            "-DMONARCH_PYTHON_OUTPUT_DIR=" + ext_dir,
        ]
        configure += shlex.split(os.environ.get("CMAKE_ARGS", ""))
        target = ext.name.rsplit(".", 1)[-1]
        build = ["cmake", "--build", build_dir, "--config", config, "--target", target,
                 "--parallel", os.environ.get("MONARCH_BUILD_JOBS", "2")]

        for cmd in (configure, build):
            print(" ".join(shlex.quote(c) for c in cmd), flush=True)
            subprocess.run(cmd, check=True)
        if not os.path.exists(ext_path):
            raise RuntimeError(f"CMake did not produce {ext_path}")
        # Also beside the sources, as an editable install would place it: run from the
        # clone's root, `import torch_monarch` finds the source folder first, and it must
        # work there too (the module's file name carries the interpreter's tag).
        in_tree = os.path.join(ext.source_dir, *ext.name.split(".")[:-1], os.path.basename(ext_path))
        if os.path.abspath(in_tree) != ext_path:
            # A new file renamed over the old one, never written in place: a running
            # interpreter (a test process) that loaded the old module keeps its mapping
            # intact; overwriting a mapped shared library makes that process crash later.
            partial = in_tree + ".partial"
            shutil.copy2(ext_path, partial)
            os.replace(partial, in_tree)


def _have_torch():
    """The runtime extension needs torch (its headers and libtorch_python)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


WITH_RUNTIME = _have_torch() and os.environ.get("MONARCH_WITH_TORCH", "AUTO").upper() != "OFF"
extensions = [CMakeExtension("torch_monarch._C")]
if WITH_RUNTIME:
    extensions.append(CMakeExtension("torch_monarch._runtime"))

setup(
    ext_modules=extensions,
    cmdclass={"build_ext": CMakeBuild},
)
