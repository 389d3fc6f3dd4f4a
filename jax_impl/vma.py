"""Varying manual axes: inside ``jax.shard_map`` a loop carry or ``lax.cond`` branch created
with ``jnp.zeros`` is unvarying, while one computed from the sharded operands varies over the
mesh axes; JAX requires both to agree, so fresh buffers take the operands' axes."""
from __future__ import annotations

import jax
from jax import lax


def _varying(x) -> frozenset:
    """The manual axes ``x`` varies over: ``aval.mat.varying`` in newer JAX, ``aval.vma`` before."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    axes = getattr(mat, "varying", None) if mat is not None else getattr(aval, "vma", None)
    return frozenset(axes or ())


def axes_of(*trees) -> tuple:
    """The union of the varying manual axes of every array in ``trees`` (empty outside shard_map)."""
    axes = set()
    for leaf in jax.tree.leaves(trees):
        axes |= _varying(leaf)
    return tuple(sorted(axes, key=str))


def like(tree, axes: tuple):
    """``tree``'s arrays marked varying over ``axes`` (those they do not vary over yet)."""
    if not axes:
        return tree

    def cast(x):
        missing = tuple(a for a in axes if a not in _varying(x))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def out_struct(shape, dtype, like):
    """``jax.ShapeDtypeStruct`` varying over the manual axes ``like`` varies over: with
    check_vma a ``pallas_call`` must be told how its outputs vary, like its operands, which the
    wrappers first bring to one common set of axes (``plgpu.kernel`` of Mosaic GPU ignores it:
    its outputs are marked with ``like`` after the call)."""
    aval = jax.typeof(like)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
    vma = getattr(aval, "vma", None)  # older JAX
    return jax.ShapeDtypeStruct(shape, dtype, **({} if vma is None else {"vma": vma}))


def shared_parameter_cotangent(d, x, axis_names: tuple, rows):
    """The cotangent of a parameter ``x`` (sinks, mod_aux) of which ``d`` is this device's
    rows' share: summed over the ``axis_names`` along which ``rows`` varies and ``x`` does not.
    Untracked (check_vma=False), shard_map's transpose sums the shares itself."""
    summed = tuple(a for a in axis_names if a in axes_of(rows) and a not in axes_of(x))
    return lax.psum(d, summed) if summed else d
