"""The float64 oracle and the plain same-dtype baseline, both ``torch_ref.manual_attention`` on CPU.

The oracle runs on the case's inputs converted exactly to float64 (inputs, bias and
cotangent); the baseline runs the same function in the case dtype (fp16 and bf16 matmuls work
on CPU in torch >= 2.11, so ``jax_impl.reference`` with a low-precision ``logits_dtype`` is not
needed). Both return float64 numpy in the JAX layout, like ``Prepared.results()``.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from conformance.cases import Inputs


def _run_manual(inputs: Inputs, dtype, **overrides) -> dict[str, np.ndarray]:
    from torch_ref import attention_with_grads, manual_attention
    cast = (lambda x: None if x is None else np.asarray(x).astype(dtype)) if dtype is not None else (lambda x: x)
    kw = dict(inputs.attention_kwargs(), mask=inputs.mask)
    if inputs.case.dropout:
        kw["dropout_mask"] = inputs.dropout_keep()
    kw.update(overrides)  # an override of None removes the keyword (e.g. scale=None: the default)
    kw = {n: v for n, v in kw.items() if v is not None}
    res = attention_with_grads(manual_attention, cast(inputs.q), cast(inputs.k), cast(inputs.v),
                               cast(inputs.cotangent), bias=cast(inputs.bias), **kw)
    return {n: np.asarray(v).astype(np.float64) for n, v in res.items()}


def oracle(inputs: Inputs, **overrides) -> dict[str, np.ndarray]:
    """float64 manual attention: out, dq, dk, dv (and dbias). ``overrides`` replace keyword
    arguments (e.g. ``causal_alignment="bottom_right"``, ``scale=1.0``, ``mask=~mask``)."""
    return _run_manual(inputs, np.float64, **overrides)


def baseline(inputs: Inputs) -> dict[str, np.ndarray]:
    """The plain implementation in the case dtype: its error sets the tolerance."""
    return _run_manual(inputs, None)


@dataclasses.dataclass
class References:
    oracle: dict
    baseline: dict


def references(inputs: Inputs) -> References:
    return References(oracle(inputs), baseline(inputs))
