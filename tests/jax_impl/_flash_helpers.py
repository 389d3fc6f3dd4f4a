"""Shared by the jax_impl tests: the float64 oracle and the same-dtype baseline.

Problems are conformance's ``Case``s, drawn by ``conformance.cases.make_inputs``: the same
seeded inputs the conformance suite and the benchmarks use.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from conformance.cases import Case, Inputs, make_inputs
from jax_impl import flash_attention as fa
from jax_impl import reference

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


def enable_x64():
    """jax.enable_x64 where it exists (jax >= 0.10), else the experimental one."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64 as legacy  # pragma: no cover
    return legacy()


def run(case: Case, dtype, implementation, *, baseline: bool = False, **options):
    """Outputs and gradients (the case's random cotangent) as float64 numpy.

    ``baseline``: the dense reference computing its logits and softmax in ``dtype`` itself,
    the "plain implementation in the same dtype" whose error sets the tolerance.
    """
    inputs: Inputs = make_inputs(case)
    cast = lambda x: None if x is None else jnp.asarray(np.asarray(x, np.float64), dtype)
    q, k, v, cotangent, bias = map(cast, (inputs.q, inputs.k, inputs.v, inputs.cotangent, inputs.bias))
    kwargs = {**inputs.attention_kwargs(), **options}
    mask = inputs.mask

    if baseline:
        def attend(q, k, v, bias):
            call = fa._validate(q, k, v, bias, mask, **fa._defaults(
                {**kwargs, "implementation": "reference"}))
            out, _ = reference.attention(call.q, call.k, call.v, call.bias, call.masks, call.cfg,
                                         logits_dtype=dtype)
            return out.reshape(q.shape)
    else:
        def attend(q, k, v, bias):
            return fa.flash_attention(q, k, v, bias, mask, implementation=implementation, **kwargs)

    out, vjp = jax.vjp(attend, q, k, v, bias)
    dq, dk, dv, dbias = vjp(cotangent)
    results = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    if bias is not None:
        results["dbias"] = dbias
    return {name: np.asarray(x, np.float64) for name, x in results.items()}


def oracle(case: Case, **options):
    """Dense attention in float64 on the CPU."""
    with enable_x64():
        return run(case, jnp.float64, "reference", **options)
