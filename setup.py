"""Builds the C++ CPU kernel into the package: ``pip wheel .`` and ``pip install .`` compile
``jax_impl/cpu_kernel/flash_cpu.cc`` once per x86-64 level of ``cpu_kernel/levels.py`` into
``jax_impl/cpu_kernel/prebuilt/`` (the wheel is then tagged for this platform); the installed
package loads the best one the CPU runs, with no compiler. Everything else is pyproject.toml's.

Skipped, with a message (the package then builds the kernel on first use, as a source
checkout does): an editable install, a machine that is not x86-64, a build environment without
a C++ compiler ($CXX, g++, c++, clang++) or jaxlib (the XLA FFI headers), or
``JAX_FLASH_ATTENTION_NO_PREBUILT=1``.
"""
from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
KERNEL = ROOT / "jax_impl" / "cpu_kernel"


def _levels():
    """cpu_kernel/levels.py, read without importing jax_impl (which imports jax)."""
    spec = importlib.util.spec_from_file_location("_flash_cpu_levels", KERNEL / "levels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _why_not_prebuilt() -> str | None:
    """Why no library can be prebuilt here, or None."""
    if os.environ.get("JAX_FLASH_ATTENTION_NO_PREBUILT"):
        return "JAX_FLASH_ATTENTION_NO_PREBUILT is set"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the levels are x86-64's, this is {platform.machine()}"
    if _compiler() is None:
        return "no C++ compiler ($CXX, g++, c++, clang++)"
    if _ffi_include_dir() is None:
        return "no jaxlib in the build environment (its XLA FFI headers)"
    return None


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _ffi_include_dir() -> str | None:
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return None
    include = Path(list(spec.submodule_search_locations)[0]) / "include"
    return str(include) if (include / "xla" / "ffi" / "api" / "ffi.h").exists() else None


def build_prebuilt(out_dir: Path) -> list[Path]:
    """Compiles the kernel for every level into out_dir, two compilers at a time."""
    levels = _levels()
    out_dir.mkdir(parents=True, exist_ok=True)
    compiler, include = _compiler(), _ffi_include_dir()
    jobs = [(name, out_dir / levels.library_name(name),
             levels.compile_command(compiler, flags, include, KERNEL / "flash_cpu.cc",
                                    out_dir / levels.library_name(name)))
            for name, flags, _ in levels.LEVELS]
    built = []
    for start in range(0, len(jobs), 2):
        running = [(name, path, subprocess.Popen(command, stderr=subprocess.PIPE, text=True))
                   for name, path, command in jobs[start:start + 2]]
        for name, path, process in running:
            _, errors = process.communicate()
            if process.returncode != 0:
                raise RuntimeError(f"building the CPU kernel for {name} failed:\n{errors[-3000:]}")
            built.append(path)
    return built


class BuildPyWithCpuKernel(build_py):
    """build_py, then the kernel's libraries into the build tree (not for an editable install)."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        why = _why_not_prebuilt()
        if why:
            print(f"jax_impl: not prebuilding the CPU kernel ({why}); it is built on first use",
                  file=sys.stderr)
            return
        for path in build_prebuilt(Path(self.build_lib) / "jax_impl" / "cpu_kernel" / "prebuilt"):
            print(f"jax_impl: built {path.name}", file=sys.stderr)


class PlatformDistribution(Distribution):
    """A wheel holding the prebuilt libraries is one platform's (not py3-none-any)."""

    def has_ext_modules(self):
        return _why_not_prebuilt() is None


setup(cmdclass={"build_py": BuildPyWithCpuKernel}, distclass=PlatformDistribution)
