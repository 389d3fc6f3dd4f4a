"""The custom VJP shared by the blocked implementations (xla, pallas_triton, cpu).

Residuals are q, k, v, the bias, the mask inputs and the per-row softmax statistics
(``online_softmax.RowStats``: the row max and the log of the row sum, kept apart so that the
backward recomputes P exactly even when the logits are huge): nothing of size Lq * Lk beyond
what the caller passed in. The backward recomputes the probabilities tile by tile.
A bias nobody differentiates (custom_vjp's symbolic zeros tell the forward) gets no gradient:
the backward runs with ``cfg.bias_gradient=False`` and writes no ``[B, Hq, Lq, Lk]`` dS.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.extend
from jax.interpreters import ad, batching, mlir

from jax_impl import dropout_sinks, masking, mods, online_softmax, partitioned
from jax_impl.config import AttentionConfig
from jax_impl.symbolic_zeros import Residuals, delta_of, from_primals, reduce_to

SECOND_ORDER_ERROR = (
    "flash_attention's blocked implementations (xla, pallas_triton, cpu) have a first-order VJP "
    "only: their backward pass cannot be differentiated again. For higher-order derivatives "
    "use implementation='reference' (dense autodiff, [Lq, Lk] memory).")
FORWARD_MODE_ERROR = (
    "flash_attention's blocked implementations (xla, pallas_triton, cpu) have a custom VJP: "
    "reverse mode only (jax.grad, jax.vjp, jax.jacrev). Forward mode (jax.jvp, jax.jacfwd, "
    "jax.hessian, applying jax.linearize's function) cannot run through them; use "
    "implementation='reference' (dense autodiff, [Lq, Lk] memory), which supports it.")


# --- Forward mode, refused in words -------------------------------------------------------
# JAX cannot push tangents forward through a custom VJP and says so without naming a way out,
# often where the program is lowered, far from this call. So each differentiable input passes
# through an identity whose tangent is a primitive that raises the given message when it is
# evaluated or lowered, which only forward mode does: reverse mode stages it and transposes it
# to the identity. Batching passes it on: jax.grad of a jax.vmap batches it before the
# transpose removes it, and jax.jacfwd's batched tangent then meets the custom VJP, whose
# refusal ``naming_forward_mode`` words as the others.
_forward_tangent_p = jax.extend.core.Primitive("flash_attention_forward_mode_tangent")
_forward_tangent_p.def_abstract_eval(lambda tangent, **params: tangent)


def _raise_message(*args, message, **params):
    raise NotImplementedError(message)


def _batch_tangent(args, dims, **params):
    return _forward_tangent_p.bind(*args, **params), dims[0]


_JAX_FORWARD_MODE_REFUSAL = "can't apply forward-mode autodiff (jvp) to a custom_vjp function"


def naming_forward_mode(function, message: str):
    """``function``, whose custom VJPs' refusal of forward mode (JAX's TypeError, raised where a
    jitted call is differentiated) says ``message``."""
    def call(*args):
        try:
            return function(*args)
        except TypeError as error:
            if _JAX_FORWARD_MODE_REFUSAL in str(error):
                raise NotImplementedError(message) from error
            raise
    return call


_forward_tangent_p.def_impl(_raise_message)
mlir.register_lowering(_forward_tangent_p, _raise_message)
batching.primitive_batchers[_forward_tangent_p] = _batch_tangent
ad.deflinear(_forward_tangent_p, lambda cotangent, **params: [cotangent])


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def refuse_forward_mode(x, message: str):
    """``x``; pushing a tangent forward through it raises ``message``, reverse mode passes."""
    return x


@refuse_forward_mode.defjvp
def _refuse_forward_mode_jvp(message, primals, tangents):
    # The primal stays guarded, for a forward pass over this one (jax.hessian).
    return (refuse_forward_mode(primals[0], message),
            _forward_tangent_p.bind(tangents[0], message=message))


def _refusing_forward_mode(message, *arrays):
    return [None if x is None else refuse_forward_mode(x, message) for x in arrays]


def attention(implementation, cfg: AttentionConfig, q, k, v, bias, masks: masking.MaskInputs,
              extras: dropout_sinks.SinksAndDropout):
    """-> (out [B, Lq, Hq, D], lse [B, Hq, Lq] float32, natural log, -inf for empty rows).

    ``implementation``: the chosen ``implementations.Implementation`` (static, hashable).
    Differentiable in reverse mode; forward mode raises FORWARD_MODE_ERROR. The bias is not
    guarded: the guard's identity would add a [B, Hq, Lq, Lk] value to every jaxpr, where the
    tests look for score-sized arrays (a tangent of the bias alone gets JAX's own message)."""
    q, k, v, sinks = _refusing_forward_mode(FORWARD_MODE_ERROR, q, k, v, extras.sinks)
    mod_aux = tuple(refuse_forward_mode(x, FORWARD_MODE_ERROR) if mods.differentiable(x) else x
                    for x in extras.mod_aux)
    return _attention(implementation, cfg, q, k, v, bias, masks,
                      extras._replace(sinks=sinks, mod_aux=mod_aux))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(implementation, cfg: AttentionConfig, q, k, v, bias, masks: masking.MaskInputs,
               extras: dropout_sinks.SinksAndDropout):
    out, stats = _forward(implementation, cfg, q, k, v, bias, masks, extras)
    return out, online_softmax.logsumexp(stats)


def _attention_fwd(implementation, cfg, q, k, v, bias, masks, extras):
    # symbolic_zeros=True: every array arrives as a CustomVJPPrimal(value, perturbed).
    # Differentiated, the forward is the regular path: the backward recomputes its logits with the
    # same products, so a row's max cancels exactly at any magnitude (a decode path's split
    # products round apart: at |logits| ~1e9, 64 apart, and exp of that is no probability).
    cfg = dataclasses.replace(cfg, decode=False)
    backward_cfg, (q, k, v, bias, masks, extras) = from_primals(cfg, bias, (q, k, v, bias, masks, extras), extras.mod_aux)
    out, stats = _forward(implementation, cfg, q, k, v, bias, masks, extras)
    return ((out, online_softmax.logsumexp(stats)),
            Residuals((q, k, v, bias, masks, extras, out, stats), backward_cfg))


def _attention_bwd(implementation, cfg, residuals: Residuals, cotangents):
    q, k, v, bias, masks, extras, out, stats = residuals.arrays
    d_out, delta = delta_of(out, cotangents)
    dq, dk, dv, dbias, d_mod_aux = _first_order(implementation, residuals.cfg, q, k, v, bias,
                                                masks, stats, d_out, delta, extras)
    if dbias is not None:  # None: a constant bias, whose cotangent is a symbolic zero
        dbias = reduce_to(dbias, bias.shape).astype(bias.dtype)
    mask_cotangents = jax.tree.map(lambda _: None, masks)
    # Sinks need no kernel: their gradient follows from the row statistics and delta.
    d_sinks = None if extras.sinks is None else reduce_to(
        dropout_sinks.sink_gradient(extras.sinks, online_softmax.logsumexp(stats), delta),
        extras.sinks.shape).astype(extras.sinks.dtype)
    d_mod_aux = tuple(None if d is None else d.astype(x.dtype)
                      for x, d in zip(extras.mod_aux, d_mod_aux or (None,) * len(extras.mod_aux)))
    d_extras = jax.tree.map(lambda _: None, extras)._replace(sinks=d_sinks, mod_aux=d_mod_aux)
    return dq, dk, dv, dbias, mask_cotangents, d_extras


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


# The implementations' own passes, each behind a custom VJP that refuses to be differentiated:
# a second-order derivative reaches one of them and gets SECOND_ORDER_ERROR, not an obscure
# message from inside a kernel or loop.

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _forward(implementation, cfg, q, k, v, bias, masks, extras):
    return partitioned.forward(implementation, cfg, q, k, v, bias, masks, extras)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _first_order(implementation, cfg, q, k, v, bias, masks, stats, d_out, delta, extras):
    """The implementation's backward; differentiating it again raises SECOND_ORDER_ERROR."""
    return partitioned.backward(implementation, cfg, q, k, v, bias, masks, stats, d_out, delta, extras)


def _refuse_second_order(implementation, cfg, residuals, cotangents):
    raise NotImplementedError(SECOND_ORDER_ERROR)


def paged_attention(implementation, cfg: AttentionConfig, q, k_pages, v_pages, masks, extras, page_table):
    """A paged-cache call: the implementation's decode path, forward only. -> (out, lse)."""
    q, k_pages, v_pages, sinks = _refusing_forward_mode(PAGED_GRADIENT_ERROR, q, k_pages, v_pages,
                                                        extras.sinks)
    extras = extras._replace(sinks=sinks)
    out, stats = _paged_forward(implementation, cfg, q, k_pages, v_pages, masks, extras, page_table)
    return out, online_softmax.logsumexp(stats)


PAGED_GRADIENT_ERROR = (
    "flash_attention with a paged KV cache (page_table=...) is forward only (inference): it has "
    "no gradient with respect to the query, the pages or the sinks. To differentiate, gather "
    "the cache into a dense [B, Lk, Hkv, D] key/value (jax_impl.kv_cache.gather) and call "
    "flash_attention without page_table.")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _paged_forward(implementation, cfg, q, k_pages, v_pages, masks, extras, page_table):
    return partitioned.paged_forward(implementation, cfg, q, k_pages, v_pages, masks, extras,
                                     page_table)


def _refuse_paged_gradient(implementation, cfg, residuals, cotangents):
    raise NotImplementedError(PAGED_GRADIENT_ERROR)


_paged_forward.defvjp(lambda implementation, cfg, *args: (_paged_forward(implementation, cfg, *args), None),
                      _refuse_paged_gradient)


for _pass in (_forward, _first_order):
    _pass.defvjp(lambda implementation, cfg, *args, _pass=_pass: (_pass(implementation, cfg, *args), None),
                 _refuse_second_order)
