"""Score and mask functions (FlexAttention's ``score_mod`` and ``mask_mod``): their checks and
how an implementation evaluates them on a tile.

``score_mod(score, b, h, q_idx, kv_idx, *mod_aux) -> score`` rewrites the logits (after the
scale, the soft cap and the bias); ``mask_mod(b, h, q_idx, kv_idx, *mod_aux) -> bool`` says
which pairs may attend (True), ANDed with every other mask rule. Both are written elementwise:
they are called with int32 index arrays that broadcast against each other and the score (a
tile's, the whole ``[B, Hq, Lq, Lk]`` in the reference, or scalars in a kernel), so plain
``jnp`` code that indexes ``mod_aux`` arrays with the indices works (``slopes[h]``,
``table[bucket(kv_idx - q_idx), h]``). ``h`` is the query head. The floating ``mod_aux``
entries are differentiable: ``score_gradient`` gives their cotangents tile by tile, summed in
a fixed order (no atomics).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp


_HINT = "pass the arrays it reads through mod_aux (they arrive after the indices)"


@dataclasses.dataclass(frozen=True)
class _AtOffset:
    """A mod called with a shard's local indices: adds the shard's global (b, h, q, kv) start,
    which arrives as the first mod_aux entry (int32 ``[4]``, traced: one program serves every
    shard and ring step). Hashable by the mod it wraps, so a static config stays cacheable."""

    mod: Callable
    takes_score: bool

    def __call__(self, *args):
        lead = args[:1] if self.takes_score else ()
        b, h, q_idx, kv_idx, start, *mod_aux = args[len(lead):]
        return self.mod(*lead, b + start[0], h + start[1], q_idx + start[2], kv_idx + start[3],
                        *mod_aux)


def at_offset(cfg: "AttentionConfig") -> "AttentionConfig":
    """``cfg`` whose mods take one more leading mod_aux entry, ``offset_aux``'s, and see global
    indices (a ring step's chunk pair, an all-to-all device's block of heads)."""
    if not cfg.has_mods:
        return cfg
    wrap = lambda mod, takes_score: None if mod is None else _AtOffset(mod, takes_score)
    return dataclasses.replace(cfg, score_mod=wrap(cfg.score_mod, True),
                               mask_mod=wrap(cfg.mask_mod, False))


def offset_aux(mod_aux: tuple, *, b=0, h=0, q=0, kv=0) -> tuple:
    """``mod_aux`` for ``at_offset``'s mods: the global start of the local indices first."""
    return (jnp.stack([jnp.asarray(x, jnp.int32) for x in (b, h, q, kv)]),) + tuple(mod_aux)


def differentiable(x) -> bool:
    """Whether a ``mod_aux`` entry gets a gradient (floating arrays do)."""
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def score(cfg: "AttentionConfig", s, b, h, q_idx, kv_idx, mod_aux):
    """The logits ``s`` (float32) after ``cfg.score_mod``; ``s`` itself without one."""
    if cfg.score_mod is None:
        return s
    out = cfg.score_mod(s, b, h, q_idx, kv_idx, *mod_aux)
    return jnp.broadcast_to(jnp.asarray(out, s.dtype), s.shape)


def allowed(cfg: "AttentionConfig", b, h, q_idx, kv_idx, mod_aux):
    """``cfg.mask_mod`` on these indices (bool, broadcast as its result is), or None without one."""
    if cfg.mask_mod is None:
        return None
    return jnp.asarray(cfg.mask_mod(b, h, q_idx, kv_idx, *mod_aux))


def score_gradient(cfg: "AttentionConfig", s, b, h, q_idx, kv_idx, mod_aux, d_score):
    """(dS with respect to the logits before ``score_mod``, the ``mod_aux`` cotangents) for the
    cotangent ``d_score`` of its output at ``s``. The cotangents are summed to each entry's
    shape; None for an entry that is not floating (or when there is no score_mod)."""
    if cfg.score_mod is None:
        return d_score, tuple(None for _ in mod_aux)
    floats = [i for i, x in enumerate(mod_aux) if differentiable(x)]

    def apply(s, *float_aux):
        aux = list(mod_aux)
        for i, x in zip(floats, float_aux):
            aux[i] = x
        return score(cfg, s, b, h, q_idx, kv_idx, aux)

    _, vjp = jax.vjp(apply, s, *(mod_aux[i] for i in floats))
    d_s, *d_floats = vjp(d_score.astype(s.dtype))
    d_aux = [None] * len(mod_aux)
    for i, d in zip(floats, d_floats):
        d_aux[i] = d
    return d_s, tuple(d_aux)


def add_cotangents(total, part):
    """Sums two ``score_gradient`` cotangent tuples (None where not differentiable)."""
    return tuple(None if a is None else a + b for a, b in zip(total, part))


def zero_cotangents(mod_aux):
    """The starting sum of ``add_cotangents``: float32 zeros per floating entry, else None."""
    return tuple(jnp.zeros(jnp.shape(x), jnp.float32) if differentiable(x) else None
                 for x in mod_aux)


def check(score_mod, mask_mod, mod_aux, *, batch: int, heads: int, q_len: int, kv_len: int):
    """Trace each mod once on small index arrays: a mod that is not callable, closes over a
    traced array, or returns the wrong dtype or shape is refused with an error naming it."""
    b = jnp.zeros((batch, 1, 1, 1), jnp.int32)
    h = jnp.zeros((1, heads, 1, 1), jnp.int32)
    q_idx = jnp.zeros((1, 1, min(q_len, 2), 1), jnp.int32)
    kv_idx = jnp.zeros((1, 1, 1, min(kv_len, 2)), jnp.int32)
    shape = (batch, heads, q_idx.shape[2], kv_idx.shape[3])
    if score_mod is not None:
        check_function("score_mod", "(score, b, h, q_idx, kv_idx, *mod_aux) -> score", score_mod,
                   (jnp.zeros(shape, jnp.float32), b, h, q_idx, kv_idx), mod_aux, shape,
                   lambda dtype: jnp.issubdtype(dtype, jnp.floating), "a float array (the new score)")
    if mask_mod is not None:
        check_function("mask_mod", "(b, h, q_idx, kv_idx, *mod_aux) -> bool", mask_mod,
                   (b, h, q_idx, kv_idx), mod_aux, shape, lambda dtype: dtype == jnp.bool_,
                   "a bool array (True = may attend)")


def check_function(name, signature, fn, indices, mod_aux, shape, dtype_ok, wanted):
    """Trace ``fn(*indices, *mod_aux)`` once: refuse a closed-over tracer, a result whose dtype
    fails ``dtype_ok`` (``wanted`` says what it must be) or that does not broadcast to ``shape``."""
    if not callable(fn):
        raise TypeError(f"{name} must be a function {signature}; got {type(fn).__name__}")
    try:
        jaxpr, out = jax.make_jaxpr(fn, return_shape=True)(*indices, *mod_aux)
    except jax.errors.UnexpectedTracerError as e:
        raise ValueError(f"{name} uses a traced array from a finished trace: {_HINT}") from e
    except TypeError as e:  # most often: it does not take every mod_aux entry
        raise TypeError(f"{name} failed when called as {name}{signature.split(' ->')[0]} with "
                        f"{len(mod_aux)} mod_aux arrays (every mod receives all of them): {e}") from e
    if any(isinstance(const, jax.core.Tracer) for const in jaxpr.consts):
        raise ValueError(f"{name} closes over a traced array (a value of an enclosing jit, grad "
                         f"or vmap): {_HINT}")
    if not isinstance(out, jax.ShapeDtypeStruct) or not dtype_ok(out.dtype):
        got = out.dtype if isinstance(out, jax.ShapeDtypeStruct) else type(out).__name__
        raise TypeError(f"{name} must return {wanted}; got {got}")
    try:
        fits = jnp.broadcast_shapes(out.shape, shape) == shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"{name} returned shape {out.shape}, which does not broadcast to the "
                         f"indices' shape [B, H, Q, K]={shape} (index arrays broadcast: do not "
                         f"reshape them)")
