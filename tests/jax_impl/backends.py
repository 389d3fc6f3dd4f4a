"""The test base's list of what to run: every implementation of ``implementations.IMPLEMENTATIONS``
declares its variants here once (the options of a ``flash_attention`` call), and the grids of
test_flash_correctness.py and the bit-identity test are built from it. A new implementation
fails ``test_every_implementation_declares_its_variants`` until it is added.

``gpu``: variants that run the compiled kernels on a CUDA device; they carry the ``gpu`` marker
(``pytest -m gpu``, run by benchmarks/run_gpu.sh) and are skipped where JAX sees no GPU.
"""
from __future__ import annotations

import pytest

from jax_impl import BlockSizes

VARIANTS = {
    "pallas_triton": {
        "interpret": dict(interpret=True),
        # One warp: two [32, 64] fp32 accumulators would not fit its registers, so dV and dK are
        # computed by two kernels (heuristics.split_dkdv), as at D=256 with the default tiles.
        "split-dkdv": dict(interpret=True, block_sizes=BlockSizes(16, 32, 16, 32, 16, 32, num_warps_bwd=1)),
    },
    "cpu": {
        "default": {},
        "16x64-tiles": dict(block_sizes=BlockSizes(16, 64)),  # many tiles: ranges and edges matter
    },
    "xla": {
        "default": {},
        "16x32-tiles": dict(block_sizes=BlockSizes(16, 32)),
    },
    "reference": {"default": {}},
}
GPU_VARIANTS = {"pallas_triton": {"compiled": {}}}
# Variants too slow to run on every problem (the Pallas interpreter) or whose point is a few.
SOME_PROBLEMS = {("pallas_triton", "split-dkdv"), ("xla", "16x32-tiles"), ("cpu", "16x64-tiles")}


def params(only=None):
    """pytest params (implementation, options) of every variant, ids ``implementation-variant``;
    ``only(implementation, variant)`` filters; the GPU variants carry the gpu marker."""
    found = []
    for table, marks in ((VARIANTS, ()), (GPU_VARIANTS, (pytest.mark.gpu,))):
        for name, variants in table.items():
            for variant, options in variants.items():
                if only is None or only(name, variant):
                    found.append(pytest.param(name, dict(options, implementation=name),
                                              id=f"{name}-{variant}", marks=marks))
    return found
