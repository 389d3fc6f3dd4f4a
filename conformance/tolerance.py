"""How a result is judged (docs/design.md): against a float64 oracle, relative to a plain implementation.

An implementation run in dtype X passes when its max abs error against the oracle is at most
``factor`` times the error of a plain, non-fused implementation run in the same dtype X, plus
a per-dtype floor: twice the rounding error of the oracle's own values when they pass through
dtype X (FlashAttention's atol: ``2 * max|(ref + 0.3 - 0.3)`` in X ``- ref|``: one rounding of
the result, one of the output O that its backward reads), and for float32 at least 1e-5 x
max(1, the oracle's largest magnitude). factor is 2 for outputs and
3 for gradients. The relative norm ``||x - ref|| / ||ref||`` is reported beside it.
"""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

OUTPUT_FACTOR = 2.0
GRADIENT_FACTOR = 3.0
_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
           "float64": np.float64}


def factor_for(name: str) -> float:
    """``out`` is an output; ``dq``, ``dk``, ``dv``, ``dbias`` are gradients."""
    return OUTPUT_FACTOR if name in ("out", "lse") else GRADIENT_FACTOR


# Part of the floor relative to max(1, the oracle's largest magnitude); inputs are of unit
# scale, so 1 is the scale of the intermediate terms even where a gradient is ~0. float32
# needs it: a dense fp32 implementation can be exact by structure where a tiled one is not
# (one key: dense softmax's gradient g - sum(g * p) cancels exactly, while a tiled
# dP - rowsum(dO * O) cancels only to rounding, ~20 ulp after summing over queries; PyTorch's
# own CPU flash kernel shows the same). 1e-5 is the fp32 bar of docs/design.md.
# 16-bit dtypes' rounding floor is already far above their accumulation noise.
RELATIVE_FLOOR = {"float32": 1e-5, "float16": 0.0, "bfloat16": 0.0, "float64": 0.0}


def rounding_floor(oracle: np.ndarray, dtype: str) -> float:
    """The per-dtype floor: twice the max error of representing the oracle's values (shifted by
    0.3) in ``dtype``, or RELATIVE_FLOOR[dtype] times their largest magnitude, whichever is
    larger. Twice, as FlashAttention's tests: a 16-bit backward reads O rounded to the dtype
    (delta = rowsum(dO * O)), so an exact kernel is off by that rounding too, and which side a
    value near a rounding boundary falls on is chance."""
    x = np.asarray(oracle, np.float64)
    finite = np.isfinite(x)
    x = np.where(finite, x, 0.0)
    shifted = (x + 0.3).astype(_DTYPES[dtype]).astype(np.float64) - 0.3
    representation = float(np.max(np.abs(shifted - x), initial=0.0))
    return max(2 * representation, RELATIVE_FLOOR[dtype] * max(1.0, float(np.max(np.abs(x), initial=0.0))))


@dataclasses.dataclass(frozen=True)
class Verdict:
    name: str            # out, lse, dq, dk, dv, dbias
    error: float         # max |value - oracle|
    baseline_error: float  # max |plain same-dtype implementation - oracle|
    tolerance: float     # factor * baseline_error + floor
    relative_norm: float  # ||value - oracle|| / ||oracle||
    passed: bool

    @property
    def ratio(self) -> float:
        """error / tolerance: below 1 passes."""
        return self.error / self.tolerance if self.tolerance > 0 else (0.0 if self.error == 0 else np.inf)


def _max_abs_error(value, oracle) -> float:
    """Max abs difference; a NaN, or an inf where the oracle is finite, counts as infinite error."""
    value = np.asarray(value, np.float64)
    oracle = np.asarray(oracle, np.float64)
    if value.shape != oracle.shape:
        raise ValueError(f"shape mismatch: {value.shape} vs oracle {oracle.shape}")
    same_inf = np.isinf(value) & np.isinf(oracle) & (np.sign(value) == np.sign(oracle))
    diff = np.where(same_inf, 0.0, np.abs(value - oracle))
    if np.isnan(diff).any():
        return float("inf")
    return float(np.max(diff, initial=0.0))


def judge(name: str, value, oracle, baseline, dtype: str) -> Verdict:
    """Judge ``value`` (an implementation in ``dtype``) against the float64 ``oracle``,
    with ``baseline`` (a plain implementation in the same dtype) setting the tolerance."""
    error = _max_abs_error(value, oracle)
    baseline_error = _max_abs_error(baseline, oracle)
    if not np.isfinite(baseline_error):  # a plain implementation that overflows sets no bar
        baseline_error = 0.0
    tolerance = factor_for(name) * baseline_error + rounding_floor(oracle, dtype)
    finite_oracle = np.where(np.isfinite(oracle), np.asarray(oracle, np.float64), 0.0)
    finite_value = np.where(np.isfinite(oracle), np.asarray(value, np.float64), 0.0)
    norm = float(np.linalg.norm(finite_oracle))
    relative = float(np.linalg.norm(finite_value - finite_oracle)) / norm if norm > 0 else \
        float(np.linalg.norm(finite_value))
    return Verdict(name, error, baseline_error, tolerance, relative, bool(error <= tolerance))
