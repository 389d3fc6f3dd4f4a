"""Loads the C++ kernel (``flash_cpu.cc``), prebuilt or built on first use, and registers its
handlers with XLA.

A built package (a wheel, or ``pip install .``) holds the library for several x86-64 levels
(``levels.py``); the best one this CPU runs is loaded, no compiler needed. Otherwise (a source
checkout, another architecture), or when ``$JAX_FLASH_ATTENTION_CPU_MARCH`` asks for a build
(``native``, or another ``-march``: the tests build the AVX2 and SSE2 paths so on an AVX-512
machine), it is compiled for the machine it runs on (``-march=native``: 16-float SIMD vectors
with AVX-512, 8 with AVX, 4 otherwise, whatever the compiler finds), once per source, compiler
flags, jaxlib and CPU, into a cache directory (``$JAX_FLASH_ATTENTION_CACHE``, else
``~/.cache/jax_flash_attention``). Concurrent processes (pytest-xdist) build into temporary
names and rename atomically. With neither, nothing loads: ``unavailable()`` says why and the xla
path runs instead; ``loaded()`` names the library in use.

``JAX_FLASH_ATTENTION_CPU_SANITIZE=1`` builds it with AddressSanitizer and UndefinedBehavior-
Sanitizer instead (for the tests: every out-of-bounds access or undefined operation is
reported). Such a library loads only into a process that starts with the sanitizer runtimes:
``sanitizer_preload()`` gives the ``LD_PRELOAD`` value that does it.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

from jax_impl.cpu_kernel import levels

SOURCE = Path(__file__).with_name("flash_cpu.cc")  # the FFI binding; it includes the kernel:
HEADERS = tuple(sorted(SOURCE.parent.glob("*.h")))  # flash_cpu.h and the parts it includes
# -march: the machine's own instruction set unless $JAX_FLASH_ATTENTION_CPU_MARCH names another
# (the tests build the AVX2 and SSE2 paths this way on an AVX-512 machine).
MARCH = os.environ.get("JAX_FLASH_ATTENTION_CPU_MARCH", "native")
BUILD_ASKED = "JAX_FLASH_ATTENTION_CPU_MARCH" in os.environ  # a first-use build even with prebuilt ones
SANITIZE = bool(os.environ.get("JAX_FLASH_ATTENTION_CPU_SANITIZE"))
# FLASH_CPU_CHECKS: the kernel's own invariant checks (tile ranges, offsets) abort on failure.
SANITIZER_FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                   "-fno-omit-frame-pointer", "-g", "-DFLASH_CPU_CHECKS")
FLAGS = (*levels.BASE_FLAGS, f"-march={MARCH}", *(SANITIZER_FLAGS if SANITIZE else ()))
TARGETS = {"jax_flash_attention_cpu_forward": "FlashForwardCpu",
           "jax_flash_attention_cpu_backward": "FlashBackwardCpu",
           "jax_flash_attention_cpu_decode": "FlashDecodeCpu"}
# The bfloat16 products (bf16_dot.h), in a library built where the CPU has AVX512-BF16.
BF16_TARGETS = {"jax_flash_attention_cpu_forward_bf16": "FlashForwardBf16Cpu",
                "jax_flash_attention_cpu_backward_bf16": "FlashBackwardBf16Cpu"}
_FEATURE_BF16_PRODUCTS = 1  # a bit of the library's FlashCpuFeatures()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def sanitizer_preload(compiler: str | None = None) -> str:
    """``LD_PRELOAD`` for a process that loads the sanitized build: the compiler's ASan and
    UBSan runtimes (they must come before every other library)."""
    compiler = compiler or _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler to ask for the sanitizer runtimes")
    paths = [subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True,
                            text=True, check=True).stdout.strip() for name in ("libasan.so", "libubsan.so")]
    return ":".join(paths)


def _cpu_flags_line() -> str:
    try:  # the instruction-set flags decide what -march=native emits
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith(("flags", "Features")))
    except (OSError, StopIteration):
        return ""


def _cpu_id() -> str:
    return f"{platform.machine()} {_cpu_flags_line()}"


def prebuilt() -> Path | None:
    """The packaged library for the best x86-64 level this CPU runs, if the package holds one and
    no build was asked for (``$JAX_FLASH_ATTENTION_CPU_MARCH``, the sanitizers)."""
    if BUILD_ASKED or SANITIZE or platform.machine() not in ("x86_64", "AMD64"):
        return None
    flags = set(_cpu_flags_line().partition(":")[2].split())
    path = levels.PREBUILT / levels.library_name(levels.best_level(flags))
    return path if path.exists() else None


def _cache_dir() -> Path:
    root = os.environ.get("JAX_FLASH_ATTENTION_CACHE") or Path.home() / ".cache" / "jax_flash_attention"
    return Path(root)


def _library_path(compiler: str) -> Path:
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), *(h.read_bytes() for h in HEADERS), " ".join(FLAGS).encode(), compiler.encode(),
                 jaxlib.__version__.encode(), _cpu_id().encode()):
        key.update(part)
    return _cache_dir() / f"flash_cpu_{key.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        command = levels.compile_command(compiler, FLAGS[len(levels.BASE_FLAGS):], jax.ffi.include_dir(),
                                         SOURCE, partial)
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no message"])[-1]
            raise RuntimeError(f"{compiler} exited with {result.returncode} ({last[-300:]})")
        os.replace(partial, target)  # atomic: another process may have raced us to the same file


@functools.lru_cache(maxsize=None)
def unavailable() -> str | None:
    """None once the kernels are built and registered; else why they cannot be."""
    if os.environ.get("JAX_FLASH_ATTENTION_NO_CPU_KERNEL"):
        return "JAX_FLASH_ATTENTION_NO_CPU_KERNEL is set"
    target = shipped = prebuilt()
    if target is None:
        compiler = _compiler()
        if compiler is None:
            return ("no prebuilt CPU kernel for this CPU and no C++ compiler (g++, c++, clang++ "
                    "or $CXX) to build it")
        if SANITIZE and "libasan" not in os.environ.get("LD_PRELOAD", ""):
            # Loading it anyway would abort the process (ASan's runtime must come first).
            return ("JAX_FLASH_ATTENTION_CPU_SANITIZE is set but the process did not start with "
                    f"LD_PRELOAD={sanitizer_preload(compiler)}")
        target = _library_path(compiler)
    try:
        if not target.exists():
            _build(compiler, target)
        library = ctypes.cdll.LoadLibrary(str(target))
    except (OSError, RuntimeError) as error:
        return f"{'loading the prebuilt' if shipped else 'building the'} CPU kernel failed: {error}"
    library.FlashCpuFeatures.restype = ctypes.c_int64
    features = library.FlashCpuFeatures()
    targets = dict(TARGETS, **(BF16_TARGETS if features & _FEATURE_BF16_PRODUCTS else {}))
    for name, symbol in targets.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    _features.append(features)
    _loaded.append(target)
    return None


_loaded: list[Path] = []  # the library unavailable() loaded


def loaded() -> Path | None:
    """The kernel library in use (a prebuilt one, or the first-use build in the cache), or None."""
    return None if unavailable() is not None else _loaded[-1]


_features: list[int] = []  # the loaded library's FlashCpuFeatures()


def bf16_products() -> bool:
    """Whether bfloat16 calls multiply on the CPU's bfloat16 dot-product units (AVX512-BF16,
    bf16_dot.h) rather than widened to float32: the loaded library has them, and
    ``$JAX_FLASH_ATTENTION_CPU_BF16_PRODUCTS`` is not ``0`` (read when a call is traced: set it
    before the first call)."""
    if unavailable() is not None or os.environ.get("JAX_FLASH_ATTENTION_CPU_BF16_PRODUCTS") == "0":
        return False
    return bool(_features[-1] & _FEATURE_BF16_PRODUCTS)
