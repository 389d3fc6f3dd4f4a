"""Which device the harness and the benchmarks run on when none is named: a CUDA GPU if JAX
sees one, else the CPU. Its own module, so that the registry and the plug-in loader both read
it without importing each other."""
from __future__ import annotations

import functools


def cuda_available() -> bool:
    try:
        import jax
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


@functools.cache
def default_device() -> str:
    return "cuda" if cuda_available() else "cpu"
