"""Shared pieces of the Flax tests: module builders, a vjp under a random cotangent, and the
float64-oracle verdicts of ``conformance.tolerance``."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax import linen as nn

from conformance.tolerance import judge

FEATURES, HEADS = 64, 4  # head_dim 16


def linen_mha(attention_fn=nn.dot_product_attention, **kw):
    return nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=FEATURES,
                                           attention_fn=attention_fn, **kw)


def nnx_mha(attention_fn=nnx.dot_product_attention, seed=0, **kw):
    kw.setdefault("decode", False)
    return nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, qkv_features=FEATURES,
                                  attention_fn=attention_fn, rngs=nnx.Rngs(seed), **kw)


def random_inputs(seed, batch_shape, lq, lkv):
    kq, kkv = jax.random.split(jax.random.PRNGKey(seed))
    xq = jax.random.normal(kq, batch_shape + (lq, FEATURES), jnp.float32)
    xkv = jax.random.normal(kkv, batch_shape + (lkv, FEATURES), jnp.float32)
    return xq, xkv


def value_and_vjp(apply, params, cotangent):
    """Output and d<output . cotangent>/d params (a random cotangent, never .sum())."""
    out, pullback = jax.vjp(apply, params)
    (grads,) = pullback(cotangent.astype(out.dtype))
    return out, grads


def to_float64(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def flat(tree):
    """{path: array} of a pytree (linen params dict or an nnx.State)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def verdicts(value, oracle, baseline):
    """conformance verdicts for an (out, grads) triple: flash fp32 vs the float64 oracle, with
    Flax's default attention in fp32 as the plain implementation that sets the bar."""
    (out, grads), (out64, grads64), (out_b, grads_b) = value, oracle, baseline
    result = [judge("out", out, out64, out_b, "float32")]
    g, g64, gb = flat(grads), flat(grads64), flat(grads_b)
    assert g.keys() == g64.keys() == gb.keys() and len(g) == 8, sorted(g)
    scale = max(float(np.max(np.abs(x))) for x in g64.values())
    for name in g:
        if np.max(np.abs(g64[name])) <= 1e-9 * scale:
            # Zero by invariance (the key bias: softmax ignores a constant added to a row of
            # logits). What is left is cancellation noise, which the relative bar cannot judge:
            # it must stay at float32 noise relative to the largest gradient.
            noise = float(np.max(np.abs(g[name])))
            assert noise <= 1e-5 * scale, f"d{name} should be ~0; max {noise:.3g} vs scale {scale:.3g}"
            continue
        result.append(judge(f"d{name}", g[name], g64[name], gb[name], "float32"))
    return result


def assert_verdicts(vs):
    failed = [v for v in vs if not v.passed]
    assert not failed, "\n".join(
        f"{v.name}: error {v.error:.3g} > tolerance {v.tolerance:.3g} (baseline {v.baseline_error:.3g})"
        for v in failed)


def max_abs_diff(a, b):
    fa, fb = flat(a), flat(b)
    return max(float(np.max(np.abs(fa[k] - fb[k]))) for k in fa)
