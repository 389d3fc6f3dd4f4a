"""The test base's list of what to run: every implementation of ``implementations.IMPLEMENTATIONS``
declares its variants here once (the options of a ``flash_attention`` call), and the grids of
test_flash_correctness.py and the bit-identity test are built from it. A new implementation
fails ``test_every_implementation_declares_its_variants`` until it is added.

``gpu``: variants that run the compiled kernels on a CUDA device; they carry the ``gpu`` marker
(``pytest -m gpu``, run by benchmarks/run_gpu.sh) and are skipped where JAX sees no GPU.
"""
from __future__ import annotations

import pytest

from conformance.cases import Case
from jax_impl import BlockSizes, implementations
from jax_impl.call_features import CallFeatures
from jax_impl.config import AttentionConfig
from jax_impl.masking import MaskSpec

VARIANTS = {
    "pallas_triton": {
        "interpret": dict(interpret=True),
        # One warp: two [32, 64] fp32 accumulators would not fit its registers, so dV and dK are
        # computed by two kernels (heuristics.split_dkdv), as at D=256 with the default tiles.
        "split-dkdv": dict(interpret=True, block_sizes=BlockSizes(16, 32, 16, 32, 16, 32, num_warps_bwd=1)),
    },
    # The Mosaic GPU interpreter (jax >= 0.11) on the CPU; its P V product is a plain dot there
    # (forward._accumulate_values). The backward is pallas_triton's, interpreted too.
    "mosaic_gpu": {"interpret": dict(interpret=True)},
    # The TPU interpreter on the CPU (forward and backward kernels); slow: a few problems.
    "mosaic_tpu": {"interpret": dict(interpret=True)},
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
# Compiled kernels on a CUDA GPU; cuDNN (jax.nn's, dense) has no other.
GPU_VARIANTS = {"pallas_triton": {"compiled": {}}, "mosaic_gpu": {"compiled": {}}, "cudnn": {"compiled": {}}}
# Variants too slow to run on every problem (the Pallas interpreter) or whose point is a few.
SOME_PROBLEMS = {("pallas_triton", "split-dkdv"), ("xla", "16x32-tiles"), ("cpu", "16x64-tiles"),
                 ("mosaic_tpu", "interpret")}


def unavailable(name: str) -> str | None:
    """Why implementation ``name`` cannot run in this installation at all (e.g. mosaic_gpu on
    jax < 0.11), or None; its variants are then skipped with this reason."""
    impl = implementations.get(name)
    if impl.call_unsupported is None:
        return None
    reason = impl.call_unsupported(CallFeatures(AttentionConfig(scale=1.0, mask=MaskSpec()), 64))
    return reason if reason and "jax" in reason else None


def takes(name: str, case: Case) -> bool:
    """Whether implementation ``name`` takes a problem's features (its table entry decides;
    platform aside): a problem it refuses by design is not in its grid."""
    cfg = AttentionConfig(scale=1.0, mask=MaskSpec(), logits_soft_cap=case.soft_cap,
                          dropout_rate=case.dropout)
    features = CallFeatures(cfg, case.head_dim, dtype=case.dtype, has_bias=case.bias,
                            has_mask=case.mask != "none", has_sinks=case.sinks,
                            has_segment_ids=case.segments)
    platform = "tpu" if implementations.get(name).needs_tpu else "cuda"
    reason = implementations.unsupported(name, features, platform)
    return reason is None or reason == unavailable(name)


def params(only=None):
    """pytest params (implementation, options) of every variant, ids ``implementation-variant``;
    ``only(implementation, variant)`` filters; the GPU variants carry the gpu marker, and the
    variants of an implementation this installation cannot offer are skipped with the reason."""
    found = []
    for table, marks in ((VARIANTS, ()), (GPU_VARIANTS, (pytest.mark.gpu,))):
        for name, variants in table.items():
            reason = unavailable(name)
            skip = (pytest.mark.skip(reason=f"{name}: {reason}"),) if reason else ()
            for variant, options in variants.items():
                if only is None or only(name, variant):
                    found.append(pytest.param(name, dict(options, implementation=name),
                                              id=f"{name}-{variant}", marks=marks + skip))
    return found


def grid(tiles: bool = False):
    """pytest params (implementation, options) of the behaviour grid: ``flash_attention``'s
    automatic choice (``implementation=None``) and every implementation this host can run, with
    ``tiles`` their tile variants too (where a behaviour's point is the tiles); a behaviour of
    the programmable surface (block masks, mods, mod_aux gradients, transformations) is a test
    over this grid, never a test of one backend."""
    first = lambda name, variant: tiles or variant == next(iter(VARIANTS.get(name, {})), None)
    return [pytest.param(None, {}, id="default")] + params(first)
