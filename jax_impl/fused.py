"""The custom VJP shared by the two blocked implementations (xla, pallas_triton).

Residuals are only q, k, v, out, the logsumexp, the bias and the mask inputs: nothing of
size Lq * Lk beyond what the caller passed in. The backward recomputes the probabilities.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_impl import masking, pallas_triton, xla
from jax_impl.config import AttentionConfig

_BACKENDS = {
    "xla": (xla.forward, xla.backward),
    "pallas_triton": (pallas_triton.forward, pallas_triton.backward),
}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def attention(backend: str, cfg: AttentionConfig, q, k, v, bias, masks: masking.MaskInputs):
    """-> (out [B, Lq, Hq, D], lse [B, Hq, Lq] float32)."""
    forward, _ = _BACKENDS[backend]
    return forward(cfg, q, k, v, bias, masks)


def _attention_fwd(backend, cfg, q, k, v, bias, masks):
    out, lse = attention(backend, cfg, q, k, v, bias, masks)
    return (out, lse), (q, k, v, bias, masks, out, lse)


def _reduce_to(grad, shape):
    """Sum a [B, Hq, Lq, Lk] gradient over the axes the bias was broadcast along."""
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and grad.shape[a] != 1)
    return jnp.sum(grad, axis=axes, keepdims=True) if axes else grad


def _attention_bwd(backend, cfg, residuals, cotangents):
    q, k, v, bias, masks, out, lse = residuals
    d_out, d_lse = cotangents
    _, backward = _BACKENDS[backend]
    dq, dk, dv, dbias = backward(cfg, q, k, v, bias, masks, out, lse, d_out, d_lse)
    if bias is not None:
        dbias = _reduce_to(dbias, bias.shape).astype(bias.dtype)
    mask_cotangents = jax.tree.map(lambda _: None, masks)
    return dq, dk, dv, dbias, mask_cotangents


attention.defvjp(_attention_fwd, _attention_bwd)
