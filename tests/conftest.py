"""Markers: ``gpu``, tests that run the compiled kernels on a CUDA device (backends.py), and
``slow``, what the quick tier leaves out; XLA's CPU code generation at -O0 for the suite but the
CUDA compile lane."""
import os
import re

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


# The quick tier, `pytest -m "not slow"` (README): the behaviour tests of the API, the xla and
# cpu paths, masks, decode, the oracle and the harness. `slow` marks what builds or spawns (the
# C++ kernel under the sanitizers, processes with 8 devices, training runs, the docs, the
# benchmark suites and the conformance CLI end to end) and the kernels run in an interpreter
# (Pallas, Mosaic): 79% of the suite's test time in a measured run.
SLOW_PATHS = ("tests/sharding/", "tests/examples/", "tests/docs/", "tests/tools/test_compile_report.py",
              "tests/tools/test_tune_blocks.py", "tests/flax/test_flax_attention_fn.py",
              "tests/jax_impl/test_cpu_kernel_sanitized.py", "tests/jax_impl/test_cpu_kernel_harness.py",
              "tests/jax_impl/test_cpu_kernel_tiles.py", "tests/jax_impl/test_flash_conformance_quick.py",
              "tests/jax_impl/test_flash_properties.py", "tests/jax_impl/test_mosaic_tpu.py",
              "tests/jax_impl/test_mosaic_tpu_backward.py", "tests/benchmarks/test_bench_sharded.py",
              "tests/benchmarks/test_bench_masks.py", "tests/benchmarks/test_bench_cpu.py",
              "tests/benchmarks/test_bench_outputs.py", "tests/benchmarks/test_bench_failures.py",
              "tests/benchmarks/test_bench_judging.py", "tests/benchmarks/test_bench_cli.py",
              "tests/benchmarks/test_bench_precision.py", "tests/benchmarks/test_bench_dropout.py",
              "tests/conformance/test_conf_cli.py", "tests/conformance/test_conf_peers.py",
              "tests/conformance/test_conf_mods.py", "tests/conformance/test_conf_oracle_process.py",
              "tests/conformance/test_conf_mosaic_tpu.py")
INTERPRETED = re.compile(r"pallas|mosaic|interpret")


def is_slow(nodeid: str) -> bool:
    return nodeid.startswith(SLOW_PATHS) or INTERPRETED.search(nodeid) is not None


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: runs the compiled kernels on a CUDA device "
                                       "(pytest -m gpu; skipped without one)")
    config.addinivalue_line("markers", "slow: left out of the quick tier (pytest -m 'not slow')")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import jax
    if any(d.platform == "gpu" for d in jax.devices()):
        return
    skip = pytest.mark.skip(reason="no CUDA device: the gpu lane runs in benchmarks/run_gpu.sh")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
