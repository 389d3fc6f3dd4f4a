"""Outputs and gradients of the blocked implementations against the float64 oracle.

Judged as DESIGN.md says (conformance.tolerance): max error at most 2x (outputs) or 3x
(gradients) a plain same-dtype implementation's error, plus the dtype's rounding floor.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from conformance import tolerance
from jax_impl import BlockSizes
from _flash_helpers import DTYPES, Problem, oracle, run

PROBLEMS = [
    Problem("plain-fp32"),
    Problem("plain-bf16", dtype="bfloat16", seed=1),
    Problem("plain-fp16-mqa", dtype="float16", hkv=1, seed=2),
    Problem("causal-topleft-lq<lk-d40", lq=37, lk=129, head_dim=40, is_causal=True, seed=3),
    Problem("causal-bottomright-lq>lk", lq=129, lk=37, is_causal=True,
            causal_alignment="bottom_right", seed=4),
    Problem("bottomright-lengths-bf16", lq=37, lk=129, dtype="bfloat16", is_causal=True,
            causal_alignment="bottom_right", q_lengths=(30, 37), kv_lengths=(129, 50), seed=5),
    Problem("window-d128-fp16", lq=129, lk=129, hq=2, hkv=2, head_dim=128, dtype="float16",
            window=(8, 4), seed=6),
    Problem("causal-window-left", lq=129, lk=129, is_causal=True, window=(16, None), seed=7),
    Problem("dense-mask-empty-row", dense_mask=True, seed=8),
    Problem("bias-heads-causal", bias_shape="heads", is_causal=True, seed=9),
    Problem("bias-keys-softcap", bias_shape="keys", soft_cap=2.0, seed=10),
    Problem("segments-gqa4", hq=4, hkv=1, segments=True, seed=11),
    Problem("decode-lq1", lq=1, lk=129, hq=4, hkv=1, is_causal=True,
            causal_alignment="bottom_right", kv_lengths=(100, 129), seed=12),
    Problem("single-key-d16", lq=1, lk=1, head_dim=16, batch=1, seed=13),
]

IMPLEMENTATIONS = {
    "xla": dict(implementation="xla"),
    "pallas_triton": dict(implementation="pallas_triton", interpret=True),
    # Small tiles: many tiles per sequence, so the block-skip ranges and padding matter.
    "xla-16x32-tiles": dict(implementation="xla", block_sizes=BlockSizes(16, 32)),
}
SMALL_TILE_PROBLEMS = ("causal-bottomright-lq>lk", "bottomright-lengths-bf16",
                       "causal-window-left", "bias-heads-causal", "segments-gqa4")
GRID = [pytest.param(p, impl, id=f"{p}-{impl}") for p in PROBLEMS for impl in IMPLEMENTATIONS
        if impl != "xla-16x32-tiles" or p.name in SMALL_TILE_PROBLEMS]


@functools.lru_cache(maxsize=None)
def _oracle_and_baseline(problem: Problem):
    dtype = DTYPES[problem.dtype]
    return oracle(problem), run(problem, dtype, None, baseline=True)


@pytest.mark.parametrize("problem, implementation", GRID)
def test_matches_float64_oracle(problem, implementation):
    options = dict(IMPLEMENTATIONS[implementation])
    results = run(problem, DTYPES[problem.dtype], **options)
    reference, baseline = _oracle_and_baseline(problem)
    assert set(results) == set(reference)
    for name in results:
        assert np.all(np.isfinite(results[name])), f"{name} has NaN/inf"
        verdict = tolerance.judge(name, results[name], reference[name], baseline[name], problem.dtype)
        assert verdict.passed, verdict


def test_oracle_is_not_trivially_passed():
    """A wrong answer (the scale forgotten) must fail the same judgement."""
    problem = PROBLEMS[0]
    reference, baseline = _oracle_and_baseline(problem)
    wrong = run(problem, jnp.float32, "xla", scale=1.0)
    verdict = tolerance.judge("out", wrong["out"], reference["out"], baseline["out"], "float32")
    assert not verdict.passed
