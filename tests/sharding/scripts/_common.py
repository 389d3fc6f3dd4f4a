"""Shared by the sharding scripts: random problems and the float64 dense oracle.

The oracle is ``implementation="reference"`` in float64 on one device: dense, plain autodiff,
no blocked code, no ring, no partitioning.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_impl.flash_attention import flash_attention


def problem(seed, b, lq, lk, hq, hkv, d, *, bias=False):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    arrays = dict(q=normal(b, lq, hq, d), k=normal(b, lk, hkv, d), v=normal(b, lk, hkv, d),
                  ct=normal(b, lq, hq, d))
    if bias:
        arrays["bias"] = normal(b, hq, lq, lk)
    return arrays, rng


def oracle(arrays, **kwargs):
    """(out, grads of q, k, v[, bias]) in float64 for the cotangent ``ct``."""
    with jax.enable_x64(True):
        c64 = lambda x: jnp.asarray(x, jnp.float64)
        names = [n for n in ("q", "k", "v", "bias") if n in arrays]
        def f(*xs):
            named = dict(zip(names, xs))
            return flash_attention(named["q"], named["k"], named["v"], named.get("bias"),
                                   implementation="reference", **kwargs)
        out, vjp = jax.vjp(f, *(c64(arrays[n]) for n in names))
        grads = vjp(c64(arrays["ct"]))
        return np.asarray(out), dict(zip(names, (np.asarray(g) for g in grads)))


def max_errors(out, grads, ref_out, ref_grads):
    errs = {"out": float(np.max(np.abs(np.asarray(out, np.float64) - ref_out)))}
    for name, g in grads.items():
        errs["d" + name] = float(np.max(np.abs(np.asarray(g, np.float64) - ref_grads[name])))
    return errs
