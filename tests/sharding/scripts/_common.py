"""Shared by the sharding scripts: random problems and the float64 dense oracles.

``torch_oracle``: torch_ref.manual_attention in float64 (shares no code with jax_impl).
``oracle``: ``implementation="reference"`` in float64 on one device: dense, plain autodiff,
no blocked code, no ring, no partitioning (but jax_impl's masking rules).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_impl.flash_attention import flash_attention


def problem(seed, b, lq, lk, hq, hkv, d, *, bias=False):
    """Unit-normal q, k, v, the output cotangent ``ct`` and, with ``bias`` (True or a shape
    ``(Bb, Hb)``), a bias ``[Bb, Hb, Lq, Lk]``."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    arrays = dict(q=normal(b, lq, hq, d), k=normal(b, lk, hkv, d), v=normal(b, lk, hkv, d),
                  ct=normal(b, lq, hq, d))
    if bias:
        bb, hb = (b, hq) if bias is True else bias
        arrays["bias"] = normal(bb, hb, lq, lk)
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


def torch_oracle(arrays, **kwargs):
    """(out, grads of q, k, v[, bias]) from torch_ref.manual_attention in float64."""
    from torch_ref import attention_with_grads, manual_attention
    c64 = lambda x: np.asarray(x, np.float64)
    kwargs = {n: x for n, x in kwargs.items() if x is not None}
    ref = attention_with_grads(manual_attention, c64(arrays["q"]), c64(arrays["k"]),
                               c64(arrays["v"]), c64(arrays["ct"]),
                               bias=None if "bias" not in arrays else c64(arrays["bias"]), **kwargs)
    grads = {n: ref["d" + n] for n in ("q", "k", "v", "bias") if "d" + n in ref}
    return ref["out"], grads


def max_errors(out, grads, ref_out, ref_grads):
    errs = {"out": float(np.max(np.abs(np.asarray(out, np.float64) - ref_out)))}
    for name, g in grads.items():
        errs["d" + name] = float(np.max(np.abs(np.asarray(g, np.float64) - ref_grads[name])))
    return errs
