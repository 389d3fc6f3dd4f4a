"""Dense attention: ``implementation="reference"``, for checking and higher-order derivatives.

It materialises the ``[B, Hq, Lq, Lk]`` logits, so it is for small shapes. Plain autodiff gives
its gradients (of any order); the masking is arranged so that a row with no allowed
key has output 0, logsumexp -inf and zero gradients, with no NaN anywhere.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_impl import block_mask as block_mask_lib
from jax_impl import dropout_sinks, masking, mods, online_softmax
from jax_impl.config import AttentionConfig


@jax.custom_jvp
def _finite_or_zero(x):
    """x with its NaN/inf entries as 0; the derivative passes through unchanged, so such an
    entry gets its row's gradient (NaN where the row attends anything), as in the kernels."""
    return online_softmax.finite_or_zero(x)


_finite_or_zero.defjvp(lambda primals, tangents: (_finite_or_zero(primals[0]), tangents[0]))


def attention(q, k, v, bias, masks: masking.MaskInputs, cfg: AttentionConfig,
              logits_dtype=jnp.float32, extras: dropout_sinks.SinksAndDropout | None = None):
    """q ``[B, Lq, Hq, D]``, k/v ``[B, Lk, Hkv, D]`` -> (out ``[B, Lq, Hq, D]``, lse ``[B, Hq, Lq]``).

    ``logits_dtype`` is the dtype of the logits and softmax: float32 (or float64 for the oracle)
    for an accurate result; the input dtype for "a plain implementation in that dtype", whose
    error sets the tolerance of the fused ones.
    """
    b, lq, hq, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    groups = hq // hkv
    # online_softmax's non-finite rule, densely: compute with non-finite entries as 0 and give
    # NaN logits to the pairs whose query row or key row (K or V) holds one.
    q_poison = jnp.swapaxes(online_softmax.row_poison(q), 1, 2)         # [B, Hq, Lq]
    kv_poison = jnp.repeat(jnp.swapaxes(online_softmax.key_poison(k, v), 1, 2), groups, axis=1)
    q, k, v = map(_finite_or_zero, (q, k, v))
    q_grouped = q.reshape(b, lq, hkv, groups, d)
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", q_grouped, k, precision=cfg.precision,
                        preferred_element_type=logits_dtype)
    logits = logits.reshape(b, hq, lq, lk) * jnp.asarray(cfg.scale, logits_dtype)
    if cfg.logits_soft_cap is not None:
        cap = jnp.asarray(cfg.logits_soft_cap, logits_dtype)
        logits = cap * jnp.tanh(logits / cap)
    if bias is not None:
        logits = logits + bias.astype(logits_dtype)
    logits = logits + (q_poison[..., :, None] + kv_poison[..., None, :]).astype(logits_dtype)
    extras = extras or dropout_sinks.SinksAndDropout()
    if masks.block_mask is not None:  # its meaning pair by pair
        cfg, extras = block_mask_lib.with_pair_rule(cfg, masks, extras)
    indices = (jnp.arange(b, dtype=jnp.int32)[:, None, None, None],
               jnp.arange(hq, dtype=jnp.int32)[None, :, None, None],
               jnp.arange(lq, dtype=jnp.int32)[None, None, :, None],
               jnp.arange(lk, dtype=jnp.int32)[None, None, None, :])
    allowed = masking.dense_allowed(cfg.mask, lq, lk, masks.q_len, masks.kv_len,
                                    masks.q_segment_ids, masks.kv_segment_ids, masks.mask)
    allowed = masking.all_of([allowed, mods.allowed(cfg, *indices, extras.mod_aux)])
    allowed = jnp.broadcast_to(True if allowed is None else allowed, logits.shape)
    # An additive -inf bias excludes its pair; so does a score_mod's -inf (after it).
    logits = mods.score(cfg, logits, *indices, extras.mod_aux, keep=allowed & (logits != -jnp.inf))
    allowed = allowed & (logits != -jnp.inf)
    row_max = jnp.max(jnp.where(allowed, logits, -jnp.inf), axis=-1, keepdims=True)
    sink = None if extras.sinks is None else extras.sinks.astype(logits_dtype)[:, :, None, None]
    if sink is not None:  # one more logit in every row's denominator, with no value
        row_max = jnp.maximum(row_max, sink)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0))
    unnormalised = jnp.exp(jnp.where(allowed, logits - row_max, -jnp.inf))  # [B, Hq, Lq, Lk]
    row_sum = jnp.sum(unnormalised, axis=-1, keepdims=True)
    if sink is not None:
        row_sum = row_sum + jnp.exp(sink - row_max)
    nonempty = row_sum != 0  # a NaN row (an allowed NaN logit) is not empty: its sum stays NaN
    safe_sum = jnp.where(nonempty, row_sum, 1)
    # Exactly 0 at the pairs not allowed, also in a NaN row (0 / NaN would be NaN there), so its
    # gradient reaches only the keys it attends.
    probs = jnp.where(allowed, unnormalised / safe_sum, 0)
    if cfg.dropout_rate:
        rows = jnp.arange(lq, dtype=jnp.int32)[:, None]
        cols = jnp.arange(lk, dtype=jnp.int32)[None, :]
        keep = dropout_sinks.keep(extras.dropout_seeds[:, :, None, None], rows, cols, cfg.dropout_rate)
        probs = dropout_sinks.apply_dropout(probs, keep, cfg.dropout_rate)
    probs = probs.astype(v.dtype)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.reshape(b, hkv, groups, lq, lk), v,
                     precision=cfg.precision, preferred_element_type=logits_dtype)
    lse = jnp.where(nonempty, jnp.log(safe_sum) + row_max, -jnp.inf)[..., 0]
    return out.reshape(b, lq, hq, v.shape[-1]).astype(q.dtype), lse.astype(jnp.promote_types(logits_dtype, jnp.float32))
