"""Shared by the jax_impl tests: seeded problems, the float64 oracle, the same-dtype baseline."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_impl import flash_attention as fa
from jax_impl import reference

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


def enable_x64():
    """jax.enable_x64 where it exists (jax >= 0.10), else the experimental one."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64 as legacy  # pragma: no cover
    return legacy()


@dataclasses.dataclass(frozen=True)
class Problem:
    """One attention call: shapes, dtype and mask features; inputs drawn from ``seed``."""

    name: str
    lq: int = 37
    lk: int = 37
    hq: int = 4
    hkv: int = 2
    head_dim: int = 64
    batch: int = 2
    dtype: str = "float32"
    is_causal: bool = False
    causal_alignment: str = "top_left"
    window: tuple | None = None
    q_lengths: tuple | None = None
    kv_lengths: tuple | None = None
    segments: bool = False
    dense_mask: bool = False
    bias_shape: str | None = None   # "heads": [1, Hq, Lq, Lk]; "keys": [B, 1, 1, Lk]
    soft_cap: float | None = None
    seed: int = 0

    def __str__(self):
        return self.name

    def arrays(self):
        """Float64 numpy: q, k, v, cotangent, bias (or None); plus the non-float inputs."""
        rng = np.random.default_rng(self.seed)
        q = rng.standard_normal((self.batch, self.lq, self.hq, self.head_dim))
        k = rng.standard_normal((self.batch, self.lk, self.hkv, self.head_dim))
        v = rng.standard_normal((self.batch, self.lk, self.hkv, self.head_dim))
        cotangent = rng.standard_normal((self.batch, self.lq, self.hq, self.head_dim))
        bias = None
        if self.bias_shape == "heads":
            bias = rng.standard_normal((1, self.hq, self.lq, self.lk))
        elif self.bias_shape == "keys":
            bias = rng.standard_normal((self.batch, 1, 1, self.lk))
        extra = {}
        if self.dense_mask:
            mask = rng.random((self.batch, self.hq, self.lq, self.lk)) < 0.7
            mask[0, 0, 0, :] = False  # one row with no allowed key
            extra["mask"] = mask
        if self.segments:
            extra["q_segment_ids"] = np.sort(rng.integers(0, 3, (self.batch, self.lq)), axis=1)
            extra["kv_segment_ids"] = np.sort(rng.integers(0, 3, (self.batch, self.lk)), axis=1)
        if self.q_lengths is not None:
            extra["query_seq_lengths"] = np.asarray(self.q_lengths, np.int32)
        if self.kv_lengths is not None:
            extra["key_value_seq_lengths"] = np.asarray(self.kv_lengths, np.int32)
        return q, k, v, cotangent, bias, extra

    def static_kwargs(self):
        return dict(is_causal=self.is_causal, causal_alignment=self.causal_alignment,
                    local_window_size=self.window, logits_soft_cap=self.soft_cap)


def run(problem: Problem, dtype, implementation, *, baseline: bool = False, **options):
    """Outputs and gradients (random cotangent) as float64 numpy.

    ``baseline``: the dense reference computing its logits and softmax in ``dtype`` itself,
    the "plain implementation in the same dtype" whose error sets the tolerance.
    """
    q, k, v, cotangent, bias, extra = problem.arrays()
    cast = lambda x: None if x is None else jnp.asarray(x, dtype)
    q, k, v, cotangent = map(cast, (q, k, v, cotangent))
    bias = None if bias is None else jnp.asarray(bias, jnp.float64 if dtype == jnp.float64 else jnp.float32)
    kwargs = {**problem.static_kwargs(), **extra, **options}

    if baseline:
        def attend(q, k, v, bias):
            call = fa._validate(q, k, v, bias, kwargs.get("mask"), **fa._defaults(
                {**{n: x for n, x in kwargs.items() if n != "mask"}, "implementation": "reference"}))
            out, _ = reference.attention(call.q, call.k, call.v, call.bias, call.masks, call.cfg,
                                         logits_dtype=dtype)
            return out.reshape(q.shape)
    else:
        def attend(q, k, v, bias):
            return fa.flash_attention(q, k, v, bias, implementation=implementation, **kwargs)

    out, vjp = jax.vjp(attend, q, k, v, bias)
    dq, dk, dv, dbias = vjp(cotangent)
    results = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    if bias is not None:
        results["dbias"] = dbias
    return {name: np.asarray(x, np.float64) for name, x in results.items()}


def oracle(problem: Problem, **options):
    """Dense attention in float64 on the CPU."""
    with enable_x64():
        return run(problem, jnp.float64, "reference", **options)

