"""The ``gpu`` marker: tests that run the compiled kernels on a CUDA device (backends.py); XLA's
CPU code generation at -O0 for the suite but the CUDA compile lane."""
import os

import pytest

# The suite compiles thousands of small XLA programs, and compiling is most of its time: LLVM at
# -O0 takes about a quarter off (what the tests check is each program's results, HLO and
# buffers, none of which depend on how well LLVM optimises the host code). Set before any test
# starts JAX's CPU backend; subprocesses inherit it. A flag given in XLA_FLAGS is kept, and the
# CUDA compile lane (tests/cuda_compile_lane.sh) compiles as users do: its registers and
# spills are the result.
if os.environ.get("CUDA_COMPILE_LANE") != "1" and \
        "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: runs the compiled kernels on a CUDA device "
                                       "(pytest -m gpu; skipped without one)")


def pytest_collection_modifyitems(config, items):
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import jax
    if any(d.platform == "gpu" for d in jax.devices()):
        return
    skip = pytest.mark.skip(reason="no CUDA device: the gpu lane runs in benchmarks/run_gpu.sh")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
