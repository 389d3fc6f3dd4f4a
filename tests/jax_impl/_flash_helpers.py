"""Shared by the jax_impl tests: run flash_attention on a conformance ``Case`` and judge it.

The oracle is ``torch_ref.manual_attention`` in float64 and the same-dtype baseline is the same
function in the case dtype (``conformance.oracle``): written from the documented rules in
PyTorch, sharing no code with ``jax_impl``. Problems are conformance's ``Case``s, drawn by
``conformance.cases.make_inputs``: the same seeded inputs the conformance suite uses.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from conformance import oracle as torch_oracle
from conformance import tolerance
from conformance.cases import Case, Inputs, make_inputs
from jax_impl.flash_attention import flash_attention

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


def run(case: Case, dtype, implementation, *, constant_bias: bool = False, **options):
    """Outputs and gradients (the case's random cotangent) as float64 numpy. ``constant_bias``:
    the bias is not differentiated (no dbias: the backward is told so by symbolic zeros)."""
    inputs: Inputs = make_inputs(case)
    cast = lambda x: None if x is None else jnp.asarray(np.asarray(x, np.float64), dtype)
    q, k, v, cotangent, bias = map(cast, (inputs.q, inputs.k, inputs.v, inputs.cotangent, inputs.bias))
    kwargs = {**inputs.attention_kwargs(), **options}
    if case.dropout:  # the pattern the oracle gets from inputs.dropout_keep()
        kwargs.update(dropout_rng=inputs.dropout_key(), broadcast_dropout=False, deterministic=False)

    sinks = kwargs.pop("attention_sinks", None)

    def attend(q, k, v, bias, sinks):
        return flash_attention(q, k, v, bias, inputs.mask, implementation=implementation,
                               attention_sinks=sinks, **kwargs)

    sinks = None if sinks is None else jnp.asarray(sinks)
    if constant_bias:
        out, vjp = jax.vjp(lambda q, k, v, sinks: attend(q, k, v, bias, sinks), q, k, v, sinks)
        (dq, dk, dv, dsinks), dbias = vjp(cotangent), None
    else:
        out, vjp = jax.vjp(attend, q, k, v, bias, sinks)
        dq, dk, dv, dbias, dsinks = vjp(cotangent)
    results = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    if dbias is not None:
        results["dbias"] = dbias
    if sinks is not None:
        results["dsinks"] = dsinks
    return {name: np.asarray(x, np.float64) for name, x in results.items()}


def oracle(case: Case, **overrides):
    """torch_ref.manual_attention in float64 on the CPU."""
    return torch_oracle.oracle(make_inputs(case), **overrides)


def baseline(case: Case):
    """torch_ref.manual_attention in the case dtype: its error sets the tolerance."""
    return torch_oracle.baseline(make_inputs(case))


def assert_judged_correct(results, reference, plain, dtype: str):
    """Every output and gradient finite and within conformance's tolerance of the oracle."""
    assert set(results) == set(reference)
    for name in results:
        assert np.all(np.isfinite(results[name])), f"{name} has NaN/inf"
        verdict = tolerance.judge(name, results[name], reference[name], plain[name], dtype)
        assert verdict.passed, verdict


def run_arrays(q, k, v, cotangent, implementation, *, bias=None, mask=None, jit_lengths=False,
               **kwargs):
    """flash_attention's output and gradients for numpy inputs (float64 numpy results).

    ``jit_lengths``: pass the sequence lengths as traced arguments of a jitted function, so that
    they cannot be range-checked.
    """
    extra = {} if implementation != "pallas_triton" else {"interpret": True}
    lengths = {n: kwargs.pop(n) for n in ("query_seq_lengths", "key_value_seq_lengths") if n in kwargs}

    def attend(q, k, v, bias, lengths):
        return flash_attention(q, k, v, bias, mask, implementation=implementation, **lengths,
                               **extra, **kwargs)

    def vjp(q, k, v, bias, lengths):
        out, pullback = jax.vjp(lambda q, k, v, bias: attend(q, k, v, bias, lengths), q, k, v, bias)
        return (out, *pullback(cotangent))

    if jit_lengths:
        vjp = jax.jit(vjp)
    out, dq, dk, dv, dbias = vjp(q, k, v, bias, lengths)
    results = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    if bias is not None:
        results["dbias"] = dbias
    return {name: np.asarray(x, np.float64) for name, x in results.items()}


def torch_arrays(q, k, v, cotangent, *, dtype=np.float64, **kwargs):
    """torch_ref.manual_attention's output and gradients for the same numpy inputs, in dtype
    (``conformance.oracle.manual_with_grads``: in the Python that has torch)."""
    cast = lambda x: np.asarray(x).astype(dtype) if isinstance(x, np.ndarray) and x.dtype.kind == "f" \
        or getattr(x, "dtype", None) == ml_dtypes.bfloat16 else x
    kwargs = {n: cast(x) for n, x in kwargs.items() if x is not None}
    return torch_oracle.manual_with_grads(cast(q), cast(k), cast(v), cast(cotangent), **kwargs)
