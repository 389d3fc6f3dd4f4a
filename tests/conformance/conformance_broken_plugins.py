"""Attention plug-ins for the harness tests: one correct, several deliberately broken.

Each takes flash_attention's arguments (JAX layout [B, L, H, D]); supported: scale, bias,
mask, is_causal with causal_alignment, and nothing else (NotImplementedError otherwise).
"""
import math

import jax.numpy as jnp

BLOCK = 16


def _logits_and_allowed(q, k, bias, mask, scale, is_causal, causal_alignment, forget_scale=False):
    group = q.shape[2] // k.shape[2]
    k = jnp.repeat(k, group, axis=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32))
    s = s if forget_scale else s * scale
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    lq, lk = q.shape[1], k.shape[1]
    allowed = jnp.ones((1, 1, lq, lk), bool)
    if is_causal:
        offset = lk - lq if causal_alignment == "bottom_right" else 0
        allowed = allowed & (jnp.arange(lk)[None, :] <= jnp.arange(lq)[:, None] + offset)
    if mask is not None:
        allowed = allowed & mask
    return s, allowed


def _attention(q, k, v, bias=None, mask=None, *, scale=None, is_causal=False, causal_alignment="top_left",
               bug=None, **unsupported):
    if unsupported:
        raise NotImplementedError(f"this plug-in has no {sorted(unsupported)}")
    if bug == "wrong_causal_alignment":
        causal_alignment = "top_left" if causal_alignment == "bottom_right" else "bottom_right"
    s, allowed = _logits_and_allowed(q, k, bias, mask, scale, is_causal, causal_alignment,
                                     forget_scale=bug == "forgotten_scale")
    vv = jnp.repeat(v, q.shape[2] // v.shape[2], axis=2).astype(jnp.float32)
    row_ok = allowed.any(-1, keepdims=True)
    if bug == "nan_empty_rows":
        p = jnp.exp(jnp.where(allowed, s, -jnp.inf) - jnp.max(jnp.where(allowed, s, -jnp.inf), -1, keepdims=True))
        p = p / p.sum(-1, keepdims=True)  # 0/0 in an empty row
    elif bug in ("per_block_softmax", "unrescaled_running_max"):
        lk = k.shape[1]
        acc = jnp.zeros(s.shape[:3] + (v.shape[-1],), jnp.float32)
        run_max = jnp.full(s.shape[:3] + (1,), -1e30)
        run_sum = jnp.zeros(s.shape[:3] + (1,))
        total = jnp.zeros_like(acc)
        for start in range(0, lk, BLOCK):
            sb = jnp.where(allowed[..., start:start + BLOCK], s[..., start:start + BLOCK], -1e30)
            vb = jnp.swapaxes(vv[:, start:start + BLOCK], 1, 2)  # [B, H, Tk, D]
            if bug == "per_block_softmax":  # each block normalised on its own
                pb = jnp.exp(sb - sb.max(-1, keepdims=True))
                total = total + (pb / pb.sum(-1, keepdims=True)) @ vb
            else:  # the max moves on, but acc and sum keep their old scale
                run_max = jnp.maximum(run_max, sb.max(-1, keepdims=True))
                pb = jnp.exp(sb - run_max)
                acc = acc + pb @ vb
                run_sum = run_sum + pb.sum(-1, keepdims=True)
        out = total if bug == "per_block_softmax" else acc / run_sum
        out = jnp.where(row_ok, out, 0.0)
        return jnp.swapaxes(out, 1, 2).astype(q.dtype)
    else:
        p = jnp.exp(jnp.where(allowed, s, -jnp.inf) - jnp.max(jnp.where(allowed, s, -1e30), -1, keepdims=True))
        p = jnp.where(row_ok, p / jnp.where(row_ok, p.sum(-1, keepdims=True), 1.0), 0.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, vv)
    return out.astype(q.dtype)


def correct(q, k, v, bias=None, mask=None, **kw):
    return _attention(q, k, v, bias, mask, **kw)


def per_block_softmax(q, k, v, bias=None, mask=None, **kw):
    return _attention(q, k, v, bias, mask, bug="per_block_softmax", **kw)


def unrescaled_running_max(q, k, v, bias=None, mask=None, **kw):
    return _attention(q, k, v, bias, mask, bug="unrescaled_running_max", **kw)


def forgotten_scale(q, k, v, bias=None, mask=None, **kw):
    return _attention(q, k, v, bias, mask, bug="forgotten_scale", **kw)


def wrong_causal_alignment(q, k, v, bias=None, mask=None, **kw):
    return _attention(q, k, v, bias, mask, bug="wrong_causal_alignment", **kw)


def nan_empty_rows(q, k, v, bias=None, mask=None, **kw):
    return _attention(q, k, v, bias, mask, bug="nan_empty_rows", **kw)


def always_not_implemented(q, k, v, bias=None, mask=None, **kw):
    raise NotImplementedError("this plug-in supports nothing")


def returns_query(q, k, v, bias=None, mask=None, **kw):
    """Not attention: hands back q, so a test can see the bytes the plug-in received."""
    return q
