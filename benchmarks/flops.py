"""FLOP counts and the theory of one score tensor.

FLOPs are *useful* FLOPs, the same number for every implementation of a configuration (so
that FLOP/s compare like with like): forward ``4 * B * Hq * P * D`` where ``P`` is the number
of allowed (query, key) pairs, i.e. two matmuls (``QK^T`` and ``PV``) of ``2 * D`` FLOPs per
pair. Without causal masking ``P = Lq * Lk``; with it, ``P`` is the *exact* count of pairs
with ``k <= q`` (top-left) or ``k <= q + Lk - Lq`` (bottom-right), not the asymptotic half
(``L * (L + 1) / 2`` for a square one). Backward is counted as 2.5x the forward (five matmuls
against two), so forward+backward is 3.5x. An implementation that computes masked pairs anyway
(dense) does that work for nothing: it is not counted.
"""
from __future__ import annotations

MODES = ("fwd", "fwd+bwd")
BACKWARD_FACTOR = 2.5


def allowed_pairs(q_len: int, kv_len: int, causal: str | None = None) -> int:
    """Exact number of (query, key) pairs that may interact in one [Lq, Lk] head.

    ``causal``: None, "top_left" (key j allowed for query i when j <= i, as SDPA and jax.nn)
    or "bottom_right" (j <= i + Lk - Lq, as FlashAttention-2)."""
    if causal is None:
        return q_len * kv_len
    if causal not in ("top_left", "bottom_right"):
        raise ValueError(f"{causal=} must be None, 'top_left' or 'bottom_right'")
    offset = kv_len - q_len if causal == "bottom_right" else 0
    # row i allows min(max(i + 1 + offset, 0), Lk) keys: a sum of a clipped arithmetic series
    total = 0
    lo = max(0, -offset)                        # first row with at least one key: i + 1 + offset >= 1
    full = max(lo, min(q_len, kv_len - offset - 1))  # rows from here on allow all Lk keys
    if full > lo:                               # rows lo..full-1 allow i + 1 + offset keys
        first, last = lo + 1 + offset, full + offset
        total += (first + last) * (full - lo) // 2
    total += max(0, q_len - full) * kv_len
    return total


def attention_flops(batch: int, q_heads: int, q_len: int, kv_len: int, head_dim: int, *,
                    causal: str | None = None, mode: str = "fwd") -> float:
    """Useful FLOPs of one call (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"{mode=} must be one of {MODES}")
    forward = 4.0 * batch * q_heads * allowed_pairs(q_len, kv_len, causal) * head_dim
    return forward * (1.0 + BACKWARD_FACTOR) if mode == "fwd+bwd" else forward


def case_flops(case, mode: str) -> float:
    """``attention_flops`` for a ``conformance.cases.Case``."""
    return attention_flops(case.batch, case.q_heads, case.q_len, case.kv_len, case.head_dim,
                           causal=case.causal, mode=mode)


# --- memory theory ------------------------------------------------------------------------------

BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


def score_tensor_bytes(batch: int, heads: int, q_len: int, kv_len: int, dtype: str) -> int:
    """Bytes of one ``[B, H, Lq, Lk]`` score (or probability) tensor: what a dense
    implementation materialises at least once (and several times for its backward)."""
    return batch * heads * q_len * kv_len * BYTES[dtype]


def binary_size(n: float | None) -> str:
    """1024-based units: 33554432 -> '32 MiB'."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if n == int(n) or unit == "B" or abs(n) >= 100:
                return f"{n:.0f} {unit}"
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"


def theory_table(batch: int = 2, heads: int = 8, seq_lens=(512, 1024, 2048, 4096, 8192, 16384),
                 dtypes=("float16", "float32")) -> list[dict]:
    """One score tensor per (L, dtype): rows {"L", dtype: bytes, ...}; the reference table is
    batch 2, 8 heads (32 MiB fp16 / 64 MiB fp32 at L=1024, 1 GiB fp32 at L=4096)."""
    return [{"L": n, "batch": batch, "heads": heads,
             **{dt: score_tensor_bytes(batch, heads, n, n, dt) for dt in dtypes}} for n in seq_lens]
