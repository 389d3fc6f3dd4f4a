"""The ``gpu`` marker: tests that run the compiled kernels on a CUDA device (backends.py)."""
import pytest


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
