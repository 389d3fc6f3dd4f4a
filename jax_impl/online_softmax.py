"""The per-tile steps of FlashAttention, shared by the blocked XLA path and the Pallas kernels.

Shape-agnostic: a Pallas kernel calls them on ``[block_q, block_k]`` tiles, the XLA path on
``[B, Hkv, G, block_q, block_k]``; the last two axes are always (query, key).
Notation of FlashAttention-2 (Dao, 2023): S logits, P probabilities, m running row max,
l running row sum in m's scale, O unnormalised output accumulator.
"""
from __future__ import annotations

import jax.numpy as jnp

from jax_impl.config import AttentionConfig


def logits(qk, cfg: AttentionConfig, bias_tile=None):
    """S = softcap(scale * q.k) + bias. Returns (S, tanh term kept for the soft cap's gradient)."""
    s = qk * cfg.scale
    capped = None
    if cfg.logits_soft_cap is not None:
        capped = jnp.tanh(s / cfg.logits_soft_cap)
        s = capped * cfg.logits_soft_cap
    if bias_tile is not None:
        s = s + bias_tile.astype(jnp.float32)
    return s, capped


def online_step(row_max, row_sum, s, allowed):
    """Algorithm 1, lines 8-10: fold one key tile into the running (m, l) and return P.

    Rows that have seen no allowed key keep m = -inf; they use 0 as the reference point so
    that no inf - inf appears, and their P is exactly 0.
    Returns (rescale factor for the old accumulator, P, new m, new l).
    """
    if allowed is not None:  # None: every pair of the tile is allowed
        s = jnp.where(allowed, s, -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(s, axis=-1))
    safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    rescale = jnp.exp(row_max - safe_max)        # 0 while row_max is -inf
    p = jnp.exp(s - safe_max[..., None])         # 0 where not allowed
    new_sum = rescale * row_sum + jnp.sum(p, axis=-1)
    return rescale, p, new_max, new_sum


def finalize(acc, row_max, row_sum):
    """Algorithm 1, lines 12-13: O = acc / l, lse = m + log l; empty rows give O = 0, lse = -inf."""
    empty = row_sum == 0
    out = acc / jnp.where(empty, 1.0, row_sum)[..., None]
    lse = jnp.where(empty, -jnp.inf, row_max + jnp.log(jnp.where(empty, 1.0, row_sum)))
    return out, lse


def recomputed_probs(s, lse, allowed):
    """Backward: P = exp(S - lse) from the saved logsumexp, exactly 0 where not allowed."""
    if allowed is None:
        return jnp.exp(s - lse[..., None])
    return jnp.exp(jnp.where(allowed, s - lse[..., None], -jnp.inf))


def logits_gradient(p, dp, delta, capped, cfg: AttentionConfig):
    """Algorithm 2, line 11: dS = P * (dP - delta), delta = rowsum(dO * O) - d(lse).

    Returns (dS: the gradient of the bias, d(q.k): the gradient of the raw product, with the
    soft cap's derivative and the scale folded in).
    """
    ds = p * (dp - delta[..., None])
    dqk = ds
    if capped is not None:
        dqk = dqk * (1.0 - capped * capped)
    return ds, dqk * cfg.scale
