"""Score and mask functions (FlexAttention's ``score_mod`` and ``mask_mod``): their checks and
how an implementation evaluates them on a tile.

``score_mod(score, b, h, q_idx, kv_idx, *mod_aux) -> score`` rewrites the logits (after the
scale, the soft cap and the bias); ``mask_mod(b, h, q_idx, kv_idx, *mod_aux) -> bool`` says
which pairs may attend (True), ANDed with every other mask rule. Both are written elementwise:
they are called with int32 index arrays that broadcast against each other and the score (a
tile's, the whole ``[B, Hq, Lq, Lk]`` in the reference, or scalars in a kernel), so plain
``jnp`` code that indexes ``mod_aux`` arrays with the indices works (``slopes[h]``,
``table[bucket(kv_idx - q_idx), h]``). ``h`` is the query head.

Three rules hold on every implementation, and live here:

- **Gradients** of the floating ``mod_aux`` entries are exact sums over the *allowed* pairs:
  ``score_gradient`` evaluates the mod with ``keep`` (``evaluate``), which zeroes the cotangent of
  every excluded pair before it is summed, so a non-finite partial derivative at a pair that
  takes no part (``log(q_idx - kv_idx)`` above the diagonal) reaches no gradient. Entries nobody
  differentiates (``AttentionConfig.aux_gradients``) get none computed.
- **Reads out of range** of a ``mod_aux`` array clamp, forward and gradient alike: a negative
  index counts from the end once (as jnp indexes), then the index is clamped into the array, and
  the gradient of such a read goes to the element it read.
- **Closures** over concrete arrays are constants everywhere: ``hoisted`` moves them into
  ``mod_aux`` (no kernel captures an array; new values do not recompile), and a closure over a
  traced array is refused with the hint below.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jax_core


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
    return dataclasses.replace(
        cfg, score_mod=wrap(cfg.score_mod, True), mask_mod=wrap(cfg.mask_mod, False),
        aux_gradients=None if cfg.aux_gradients is None else (False, *cfg.aux_gradients))


def offset_aux(mod_aux: tuple, *, b=0, h=0, q=0, kv=0) -> tuple:
    """``mod_aux`` for ``at_offset``'s mods: the global start of the local indices first."""
    return (jnp.stack([jnp.asarray(x, jnp.int32) for x in (b, h, q, kv)]),) + tuple(mod_aux)


def differentiable(x) -> bool:
    """Whether a ``mod_aux`` entry can have a gradient (floating arrays can)."""
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def gradient_entries(cfg: "AttentionConfig", mod_aux) -> tuple[bool, ...]:
    """Which ``mod_aux`` entries a backward gives a cotangent: the floating ones that are
    differentiated (``cfg.aux_gradients``, from the custom VJP's symbolic zeros; None: all
    floating ones), and none without a score_mod."""
    if cfg.score_mod is None:
        return tuple(False for _ in mod_aux)
    wanted = cfg.aux_gradients or (True,) * len(mod_aux)
    return tuple(bool(w) and differentiable(x) for w, x in zip(wanted, mod_aux))


# --- Evaluating a mod: one interpreter for the three rules ---------------------------------

class AuxView:
    """A mod_aux array a kernel reads element by element (``kernel_tiles.ModAux``): ``evaluate``
    turns a jaxpr's gather, dynamic_slice or slice of one into ``view[indices]``."""

    shape: tuple
    dtype: object

    def __getitem__(self, key):  # pragma: no cover - the subclass reads
        raise NotImplementedError


_CALLS = {"jit", "pjit", "closed_call", "core_call"}
# Elementwise primitives whose operands may broadcast (size-1 axes, or rank 0) to the result:
# evaluate broadcasts them first, so that no transpose rule sums a pair's cotangent inside itself.
_ELEMENTWISE = {"add", "add_any", "sub", "mul", "div", "rem", "pow", "max", "min", "atan2",
                "nextafter", "select_n", "clamp"}


def _abstract(x):
    """What ``jax.make_jaxpr`` traces ``x`` as: an array or tracer itself (its type, with the
    manual axes it varies over inside shard_map), a view as its shape and dtype."""
    if isinstance(x, AuxView):
        return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
    return x


def sub_jaxpr(eqn):
    """The ClosedJaxpr of a call-like equation (jit, custom_jvp/vjp, checkpoint), else None."""
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(name)
        if isinstance(sub, jax_core.ClosedJaxpr):
            return sub
        if isinstance(sub, jax_core.Jaxpr):
            return jax_core.ClosedJaxpr(sub, ())
    return None


def _allowed_pairs_only(x, keep):
    """x; its derivative (tangent and cotangent) is 0 where ``keep`` is False."""
    return jnp.where(keep, x, lax.stop_gradient(x))


class _Keep:
    """``keep`` (bool, the pairs' shape) reduced to the shape of a value: a position of a
    broadcast value is kept where any pair it stands for is."""

    def __init__(self, keep):
        self.keep, self.cache = keep, {}

    def of(self, shape):
        if self.keep is None or len(shape) != self.keep.ndim:
            return None
        if shape not in self.cache:
            if any(n not in (1, m) for n, m in zip(shape, self.keep.shape)):
                self.cache[shape] = None
            else:
                axes = tuple(a for a, (n, m) in enumerate(zip(shape, self.keep.shape)) if n == 1 < m)
                self.cache[shape] = jnp.any(self.keep, axis=axes, keepdims=True) if axes else self.keep
        return self.cache[shape]

    def guard(self, x):
        keep = self.of(jnp.shape(x)) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else None
        return x if keep is None else _allowed_pairs_only(x, keep)


def _read_view(eqn, view: AuxView, operands):
    """A kernel's element read of ``view`` for a gather, dynamic_slice or slice equation."""
    name, params, out = eqn.primitive.name, eqn.params, eqn.outvars[0].aval
    if name == "gather":
        numbers = params["dimension_numbers"]
        indices = operands[1]
        if (numbers.offset_dims or any(n != 1 for n in params["slice_sizes"])
                or sorted(numbers.collapsed_slice_dims) != list(range(len(view.shape)))
                or getattr(numbers, "operand_batching_dims", ())):
            return view[...]  # refused by the view, with its rule
        key = [None] * len(view.shape)
        for position, axis in enumerate(numbers.start_index_map):
            key[axis] = indices[..., position]
        return jnp.reshape(view[tuple(key)], out.shape)
    if name in ("dynamic_slice", "slice"):
        sizes = params.get("slice_sizes") or tuple(
            hi - lo for lo, hi in zip(params["start_indices"], params["limit_indices"]))
        if any(n != 1 for n in sizes):
            return view[...]
        starts = operands[1:] if name == "dynamic_slice" else params["start_indices"]
        return jnp.reshape(view[tuple(starts)], out.shape)
    return view[...]


def _run(jaxpr, consts, args, keep: _Keep, pair_inputs: frozenset):
    """``jaxpr`` evaluated equation by equation (calls inlined): gathers clamp (their
    transpose too); with ``keep``, the cotangent of every pair-dependent float value is 0 at the
    excluded pairs (``pair_inputs``: positions of the invars that are the pair's inputs)."""
    env, pair = {}, set()
    read = lambda v: v.val if isinstance(v, jax_core.Literal) else env[v]
    for var, value in zip(jaxpr.constvars, consts):
        env[var] = value
    for position, (var, value) in enumerate(zip(jaxpr.invars, args)):
        env[var] = value
        if position in pair_inputs:
            pair.add(var)
    for eqn in jaxpr.eqns:
        operands = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        depends = any(not isinstance(v, jax_core.Literal) and v in pair for v in eqn.invars)
        views = [x for x in operands if isinstance(x, AuxView)]
        sub = sub_jaxpr(eqn) if name in _CALLS else None
        if views:
            outs = [_read_view(eqn, views[0], operands)]
        elif sub is not None:
            inner = frozenset(i for i, v in enumerate(eqn.invars)
                              if not isinstance(v, jax_core.Literal) and v in pair)
            outs = _run(sub.jaxpr, sub.consts, operands, keep, inner)
        else:
            params = dict(eqn.params)
            if name == "gather" and params["mode"] in (lax.GatherScatterMode.PROMISE_IN_BOUNDS,
                                                       lax.GatherScatterMode.CLIP):
                params["mode"] = lax.GatherScatterMode.CLIP
            if depends and keep.keep is not None and name in _ELEMENTWISE:
                shape = eqn.outvars[0].aval.shape
                operands = [keep.guard(jnp.broadcast_to(x, shape))
                            if jnp.issubdtype(jnp.result_type(x), jnp.floating)
                            and (jnp.shape(x) != shape or v not in pair) else x
                            for v, x in zip(eqn.invars, operands)]
            bind = eqn.primitive.get_bind_params(params)
            subfuns, params = bind if isinstance(bind, tuple) else ((), bind)
            outs = eqn.primitive.bind(*subfuns, *operands, **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        if depends:
            outs = [keep.guard(x) for x in outs]
            pair.update(eqn.outvars)
        for var, value in zip(eqn.outvars, outs):
            env[var] = value
    return [read(v) for v in jaxpr.outvars]


def evaluate(mod: Callable, args, *, takes_score: bool, keep=None, consts=None):
    """``mod(*args)`` by the three rules of this module: ``keep`` (bool, broadcasting against
    the pairs; None: all kept) zeroes excluded pairs' cotangents; ``consts`` replaces the
    arrays ``mod`` closes over (``hoisted``), in trace order. ``args`` may hold AuxViews."""
    closed = jax.make_jaxpr(mod)(*map(_abstract, args))
    if consts is not None and len(consts) != len(closed.consts):
        raise ValueError(f"{getattr(mod, '__name__', 'a mod')} closes over {len(closed.consts)} "
                         f"arrays here and over {len(consts)} when it was checked: {_HINT}")
    inputs = frozenset(range(5 if takes_score else 4))
    (out,) = _run(closed.jaxpr, closed.consts if consts is None else consts, list(args),
                  _Keep(keep), inputs)
    return out


@dataclasses.dataclass(frozen=True)
class _Hoisted:
    """A mod whose closed-over arrays arrive as mod_aux entries ``[first, first + count)``
    after the caller's ``user_aux`` entries (``hoisted``)."""

    mod: Callable
    takes_score: bool
    user_aux: int
    first: int
    count: int

    def __call__(self, *args):
        lead = 5 if self.takes_score else 4
        aux = args[lead:]
        if not self.count:  # it closes over none: the caller's entries only
            return self.mod(*args[:lead], *aux[:self.user_aux])
        return evaluate(self.mod, (*args[:lead], *aux[:self.user_aux]), takes_score=self.takes_score,
                        consts=aux[self.first:self.first + self.count])


def origin(mod):
    """The caller's function behind ``hoisted``'s wrapper (``mod`` itself otherwise)."""
    return mod.mod if isinstance(mod, _Hoisted) else mod


def hoisted(score_mod, mask_mod, mod_aux: tuple, indices) -> tuple:
    """(score_mod, mask_mod, mod_aux) with the concrete arrays each mod closes over moved into
    mod_aux (after the caller's entries): every implementation then reads them as it reads
    mod_aux. ``indices``: (b, h, q_idx, kv_idx) to trace the mods on."""
    user_aux = tuple(mod_aux)
    mod_aux, found = user_aux, []
    for mod, takes_score in ((score_mod, True), (mask_mod, False)):
        arrays = []
        if mod is not None:
            lead = (jnp.zeros(jnp.broadcast_shapes(*map(jnp.shape, indices)), jnp.float32),) \
                if takes_score else ()
            arrays = jax.make_jaxpr(mod)(*lead, *indices, *user_aux).consts
        found.append((mod, takes_score, len(mod_aux), len(arrays)))
        mod_aux = mod_aux + tuple(jnp.asarray(c) for c in arrays)
    if len(mod_aux) == len(user_aux):
        return score_mod, mask_mod, mod_aux
    # Each mod sees the caller's entries, then its own constants (not the other mod's).
    wrap = lambda mod, takes_score, first, count: None if mod is None else _Hoisted(
        mod, takes_score, len(user_aux), first, count)
    return (*(wrap(*x) for x in found), mod_aux)


def score(cfg: "AttentionConfig", s, b, h, q_idx, kv_idx, mod_aux, keep=None):
    """The logits ``s`` (float32) after ``cfg.score_mod``; ``s`` itself without one. ``keep``
    (the allowed pairs, or None): evaluated by ``evaluate``'s rules, so that differentiating the
    result reaches no excluded pair (the dense reference differentiates it by autodiff)."""
    if cfg.score_mod is None:
        return s
    args = (s, b, h, q_idx, kv_idx, *mod_aux)
    out = (cfg.score_mod(*args) if keep is None
           else evaluate(cfg.score_mod, args, takes_score=True, keep=keep))
    return jnp.broadcast_to(jnp.asarray(out, s.dtype), s.shape)


def allowed(cfg: "AttentionConfig", b, h, q_idx, kv_idx, mod_aux):
    """``cfg.mask_mod`` on these indices (bool, broadcast as its result is), or None without one."""
    if cfg.mask_mod is None:
        return None
    return jnp.asarray(cfg.mask_mod(b, h, q_idx, kv_idx, *mod_aux))


def score_gradient(cfg: "AttentionConfig", s, b, h, q_idx, kv_idx, mod_aux, d_score, keep=None):
    """(dS with respect to the logits before ``score_mod``, the ``mod_aux`` cotangents) for the
    cotangent ``d_score`` of its output at ``s``, summed over the pairs ``keep`` allows (None:
    all). The cotangents are summed to each entry's shape; None for an entry that gets none
    (``gradient_entries``) or when there is no score_mod."""
    if cfg.score_mod is None:
        return d_score, tuple(None for _ in mod_aux)
    wanted = gradient_entries(cfg, mod_aux)
    floats = [i for i, w in enumerate(wanted) if w]

    def apply(s, *float_aux):
        aux = list(mod_aux)
        for i, x in zip(floats, float_aux):
            aux[i] = x
        out = evaluate(cfg.score_mod, (s, b, h, q_idx, kv_idx, *aux), takes_score=True, keep=keep)
        return jnp.broadcast_to(jnp.asarray(out, s.dtype), s.shape)

    _, vjp = jax.vjp(apply, s, *(mod_aux[i] for i in floats))
    d_s, *d_floats = vjp(d_score.astype(s.dtype))
    d_aux = [None] * len(mod_aux)
    for i, d in zip(floats, d_floats):
        d_aux[i] = d
    return d_s, tuple(d_aux)


def add_cotangents(total, part):
    """Sums two ``score_gradient`` cotangent tuples (None where not differentiable)."""
    return tuple(None if a is None else a + b for a, b in zip(total, part))


def zero_cotangents(cfg: "AttentionConfig", mod_aux):
    """The starting sum of ``add_cotangents``: float32 zeros per entry that gets a gradient
    (``gradient_entries``), else None."""
    return tuple(jnp.zeros(jnp.shape(x), jnp.float32) if wanted else None
                 for x, wanted in zip(mod_aux, gradient_entries(cfg, mod_aux)))


def check(score_mod, mask_mod, mod_aux, *, batch: int, heads: int, q_len: int, kv_len: int):
    """Trace each mod on small index arrays: a mod that is not callable, closes over a traced
    array, returns the wrong dtype or shape, or is not elementwise (``_check_elementwise``) is
    refused with an error naming it. -> the (b, h, q_idx, kv_idx) it was traced on."""
    q_rows, kv_cols = min(q_len, 3), min(kv_len, 4)  # unequal, so a swap of axes shows
    b = jnp.zeros((batch, 1, 1, 1), jnp.int32)
    h = jnp.zeros((1, heads, 1, 1), jnp.int32)
    q_idx = jnp.zeros((1, 1, q_rows, 1), jnp.int32)
    kv_idx = jnp.zeros((1, 1, 1, kv_cols), jnp.int32)
    shape = (batch, heads, q_rows, kv_cols)
    for name, mod, signature, dtype_ok, wanted in (
            ("score_mod", score_mod, "(score, b, h, q_idx, kv_idx, *mod_aux) -> score",
             lambda dtype: jnp.issubdtype(dtype, jnp.floating), "a float array (the new score)"),
            ("mask_mod", mask_mod, "(b, h, q_idx, kv_idx, *mod_aux) -> bool",
             lambda dtype: dtype == jnp.bool_, "a bool array (True = may attend)")):
        if mod is None:
            continue
        lead = (jnp.zeros(shape, jnp.float32),) if name == "score_mod" else ()
        check_function(name, signature, mod, (*lead, b, h, q_idx, kv_idx), mod_aux, shape,
                       dtype_ok, wanted)
        if batch and heads:
            _check_elementwise(name, mod, name == "score_mod", shape, (q_len, kv_len), mod_aux)
    return b, h, q_idx, kv_idx


def _stand_in(x, rng):
    """A concrete array like mod_aux entry ``x`` (``x`` itself where concrete)."""
    if not isinstance(x, jax.core.Tracer):
        return x
    shape, dtype = jnp.shape(x), np.dtype(jnp.result_type(x))
    if jnp.issubdtype(dtype, jnp.floating):
        return rng.standard_normal(shape).astype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    return rng.integers(0, 8, shape).astype(dtype)


def _check_elementwise(name, mod, takes_score: bool, shape, lengths, mod_aux):
    """Refuse a mod that is not elementwise: its result on the broadcasting index arrays must
    equal, pair by pair, its result on each pair's scalar indices (``jax.vmap`` over the
    pairs), and on index arrays that each have the whole ``[B, H, Q, K]`` shape it must have
    that shape. A mod that reshapes, reduces or indexes its index arrays does not. Concrete
    stand-ins replace traced mod_aux entries (this runs while tracing)."""
    rng = np.random.default_rng(0)
    batch, heads, q_rows, kv_cols = shape
    positions = lambda length, n: np.sort(rng.choice(length, n, replace=False)).astype(np.int32)
    indices = (np.arange(batch, dtype=np.int32).reshape(-1, 1, 1, 1),
               np.arange(heads, dtype=np.int32).reshape(1, -1, 1, 1),
               positions(lengths[0], q_rows).reshape(1, 1, -1, 1),
               positions(lengths[1], kv_cols).reshape(1, 1, 1, -1))
    score = (rng.standard_normal(shape).astype(np.float32),) if takes_score else ()
    aux = tuple(_stand_in(x, rng) for x in mod_aux)
    whole = tuple(np.broadcast_to(i, shape) for i in (*score, *indices))
    try:
        with jax.ensure_compile_time_eval():  # jnp arrays made here are concrete, not staged
            aux = tuple(map(jnp.asarray, aux))
            out = np.broadcast_to(np.asarray(mod(*map(jnp.asarray, (*score, *indices)), *aux)), shape)
            per_pair = jax.vmap(lambda *pair: mod(*pair, *aux))(
                *(jnp.asarray(x.reshape(-1)) for x in whole))
            on_whole = np.shape(mod(*map(jnp.asarray, whole), *aux))
        elementwise = (on_whole == shape and per_pair.shape == (out.size,)
                       and np.array_equal(np.asarray(per_pair), out.reshape(-1), equal_nan=True))
    except (TypeError, ValueError, IndexError):
        elementwise = False
    if not elementwise:
        raise ValueError(f"{name} is not elementwise: its result at a pair must depend on that "
                         f"pair's indices only (called on each pair's scalar indices it must give "
                         f"what it gives on the broadcasting index arrays, and on index arrays of "
                         f"the whole shape [B, H, Q, K]={shape} that shape): a mod must not "
                         f"reshape, reduce or index its index arrays; they broadcast against each "
                         f"other")


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
