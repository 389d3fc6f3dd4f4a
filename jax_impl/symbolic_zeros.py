"""What the two custom VJPs (recompute_vjp.attention, ring.ring_vjp) share: under
``symbolic_zeros=True`` the forward learns which inputs are differentiated and the backward
gets SymbolicZero cotangents for outputs nobody differentiates; gradients of broadcast inputs
are summed back to their shapes."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from jax_impl.config import AttentionConfig


@functools.partial(jax.tree_util.register_dataclass, data_fields=("arrays",), meta_fields=("cfg",))
@dataclasses.dataclass(frozen=True)
class Residuals:
    """A custom VJP's residuals and the config its backward runs with. The config is static
    (pytree metadata), so the forward sets what symbolic zeros tell it (``bias_gradient``) and
    the backward is traced knowing it."""

    arrays: Any
    cfg: AttentionConfig


def from_primals(cfg: AttentionConfig, bias, args, mod_aux=()):
    """In a forward rule: (cfg with ``bias_gradient`` = whether ``bias`` (a CustomVJPPrimal or
    None) is differentiated and ``aux_gradients`` = which ``mod_aux`` entries (CustomVJPPrimals)
    are, ``args`` with every CustomVJPPrimal replaced by its value). A constant bias (an additive
    mask, ALiBi) then costs the backward no dS, a constant mod_aux entry no cotangent."""
    cfg = dataclasses.replace(cfg, bias_gradient=bias is not None and bias.perturbed,
                              aux_gradients=tuple(bool(x.perturbed) for x in mod_aux))
    return cfg, custom_vjp_primal_tree_values(args)


def delta_of(out, cotangents):
    """(dO, delta ``[B, Hq, Lq]``) from the cotangents (dO, dlse) of (out, lse), either of which
    may be a SymbolicZero (an output nobody differentiates)."""
    d_out, d_lse = cotangents
    if isinstance(d_out, SymbolicZero):
        d_out = jnp.zeros(out.shape, out.dtype)
    # delta_i = rowsum(dO_i * O_i); a cotangent of the logsumexp enters as dS += P * dlse.
    delta = jnp.einsum("bqhd,bqhd->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32))
    if not isinstance(d_lse, SymbolicZero):
        delta = delta - d_lse
    return d_out, delta


def reduce_to(grad, shape):
    """Sum a gradient (``[B, Hq, Lq, Lk]`` of the bias, ``[B, Hq]`` of the sinks) over the axes
    where the input was broadcast (size 1 in ``shape``)."""
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and grad.shape[a] != 1)
    return jnp.sum(grad, axis=axes, keepdims=True) if axes else grad
