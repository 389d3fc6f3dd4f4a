"""The x86-64 levels a built package ships the C++ kernel for, and which one a CPU runs.

Free of jax (``setup.py`` reads it to build the libraries before jax can be imported). A wheel
holds ``prebuilt/flash_cpu_<level>.so`` for each level of ``LEVELS``; ``build.py`` loads the
best one whose instruction sets the CPU has (/proc/cpuinfo's flags, which Linux clears where
the OS does not save the registers), else builds ``flash_cpu.cc`` on first use.
"""
from __future__ import annotations

from pathlib import Path

# What every build of flash_cpu.cc is compiled with (build.py adds -march, and the sanitizers
# where asked).
BASE_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fno-math-errno")

_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

# Best first: (name, compiler flags, /proc/cpuinfo flags the CPU needs). x86-64-v4 with
# AVX512-BF16: 16-float vectors and the bfloat16 products (bf16_dot.h); x86-64-v4: AVX-512;
# x86-64-v3: AVX2 and FMA (8-float vectors); x86-64: SSE2 (4-float vectors, no FMA).
LEVELS = (
    ("x86-64-v4-bf16", ("-march=x86-64-v4", "-mavx512bf16"), _V4 | {"avx512_bf16"}),
    ("x86-64-v4", ("-march=x86-64-v4",), _V4),
    ("x86-64-v3", ("-march=x86-64-v3",), _V3),
    ("x86-64", ("-march=x86-64",), frozenset()),
)

PREBUILT = Path(__file__).with_name("prebuilt")  # where a built package holds the libraries


def library_name(level: str) -> str:
    return f"flash_cpu_{level}.so"


def best_level(cpu_flags: set) -> str:
    """The best level of LEVELS whose instruction sets are all in ``cpu_flags``."""
    return next(name for name, _, needs in LEVELS if needs <= cpu_flags)


def compile_command(compiler: str, flags, include_dir: str, source: Path, output: Path) -> list[str]:
    """The command that builds ``source`` (flash_cpu.cc) into the shared library ``output``."""
    return [compiler, *BASE_FLAGS, *flags, "-isystem", include_dir, str(source), "-o", str(output)]
