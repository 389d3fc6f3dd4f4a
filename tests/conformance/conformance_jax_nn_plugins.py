"""Plug-ins wrapping jax.nn.dot_product_attention: one faithful, one with a wrong scale."""
import math

import jax


def faithful(q, k, v, bias=None, mask=None, *, scale=None, is_causal=False):
    """What a user would write: jax.nn's attention under the plug-in contract's signature."""
    return jax.nn.dot_product_attention(q, k, v, bias, mask, scale=scale, is_causal=is_causal)


def forwarding(q, k, v, bias=None, mask=None, **keywords):
    """Every keyword handed on: those jax.nn lacks raise TypeError, which means "not supported"."""
    return jax.nn.dot_product_attention(q, k, v, bias, mask, **keywords)


def wrong_scale(q, k, v, bias=None, mask=None, *, scale=None, is_causal=False):
    """Scales the logits by 1/D instead of 1/sqrt(D)."""
    scale = 1.0 / q.shape[-1] if scale is None else scale / math.sqrt(q.shape[-1])
    return jax.nn.dot_product_attention(q, k, v, bias, mask, scale=scale, is_causal=is_causal)


def declares_capability(q, k, v, bias=None, mask=None, **keywords):
    return jax.nn.dot_product_attention(q, k, v, bias, mask, **keywords)


declares_capability.unsupported = lambda case: "fp32 only" if case.dtype != "float32" else None
