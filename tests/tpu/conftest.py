"""Compile-only TPU devices, no TPU: run by tests/tpu_compile_lane.sh (jax[tpu], its
environment); skipped elsewhere."""
from __future__ import annotations

import os
import pathlib

import pytest

HERE = pathlib.Path(__file__).resolve().parent


def _lane_refusal() -> str | None:
    if os.environ.get("TPU_COMPILE_LANE") != "1":
        return "TPU compile lane only (tests/tpu_compile_lane.sh)"
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return "no libtpu (jax[tpu]) in this Python"
    return None


def pytest_collection_modifyitems(config, items):
    """Skips this folder's tests outside the lane (the hook sees the whole session's items)."""
    why = _lane_refusal()
    for item in items if why else ():
        if HERE in pathlib.Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def implementation() -> str:
    """The TPU kernel where registered, else xla (the blocked path in plain JAX)."""
    from jax_impl.implementations import IMPLEMENTATIONS
    return "mosaic_tpu" if "mosaic_tpu" in IMPLEMENTATIONS else "xla"
