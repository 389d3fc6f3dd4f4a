"""Compiles ``flash_cpu.cc`` on first use and registers its handlers with XLA.

The library is built for the machine it runs on (``-march=native``: 16-float SIMD vectors
with AVX-512, 8 with AVX, 4 otherwise, whatever the compiler finds), once per source, compiler flags, jaxlib and CPU, into
a cache directory (``$JAX_FLASH_ATTENTION_CACHE``, else ``~/.cache/jax_flash_attention``).
Concurrent processes (pytest-xdist) build into temporary names and rename atomically. Without
a C++ compiler nothing is built: ``unavailable()`` says why and the xla path runs instead.

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

SOURCE = Path(__file__).with_name("flash_cpu.cc")  # the FFI binding; it includes the kernel:
HEADERS = tuple(sorted(SOURCE.parent.glob("*.h")))  # flash_cpu.h and the parts it includes
# -march: the machine's own instruction set unless $JAX_FLASH_ATTENTION_CPU_MARCH names another
# (the tests build the AVX2 and SSE2 paths this way on an AVX-512 machine).
MARCH = os.environ.get("JAX_FLASH_ATTENTION_CPU_MARCH", "native")
SANITIZE = bool(os.environ.get("JAX_FLASH_ATTENTION_CPU_SANITIZE"))
# FLASH_CPU_CHECKS: the kernel's own invariant checks (tile ranges, offsets) abort on failure.
SANITIZER_FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                   "-fno-omit-frame-pointer", "-g", "-DFLASH_CPU_CHECKS")
FLAGS = ("-O3", f"-march={MARCH}", "-std=c++17", "-fPIC", "-shared", "-fno-math-errno",
         *(SANITIZER_FLAGS if SANITIZE else ()))
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


def _cpu_id() -> str:
    try:  # the instruction-set flags decide what -march=native emits
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith(("flags", "Features")))
    except (OSError, StopIteration):
        flags = ""
    return f"{platform.machine()} {flags}"


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
        command = [compiler, *FLAGS, "-isystem", jax.ffi.include_dir(), str(SOURCE), "-o", str(partial)]
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
    compiler = _compiler()
    if compiler is None:
        return "no C++ compiler (g++, c++, clang++ or $CXX) to build the CPU kernel"
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
        return f"building the CPU kernel failed: {error}"
    library.FlashCpuFeatures.restype = ctypes.c_int64
    features = library.FlashCpuFeatures()
    targets = dict(TARGETS, **(BF16_TARGETS if features & _FEATURE_BF16_PRODUCTS else {}))
    for name, symbol in targets.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    _features.append(features)
    return None


_features: list[int] = []  # the loaded library's FlashCpuFeatures()


def bf16_products() -> bool:
    """Whether bfloat16 calls multiply on the CPU's bfloat16 dot-product units (AVX512-BF16,
    bf16_dot.h) rather than widened to float32: the loaded library has them, and
    ``$JAX_FLASH_ATTENTION_CPU_BF16_PRODUCTS`` is not ``0`` (read when a call is traced: set it
    before the first call)."""
    if unavailable() is not None or os.environ.get("JAX_FLASH_ATTENTION_CPU_BF16_PRODUCTS") == "0":
        return False
    return bool(_features[-1] & _FEATURE_BF16_PRODUCTS)

