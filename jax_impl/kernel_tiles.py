"""What every Pallas kernel (pallas_triton, mosaic_gpu, mosaic_tpu) shares about a visited
tile: which mask rules it evaluates, the lists of the non-empty tiles of its grid, and the
user's score_mod / mask_mod on it, with mod_aux read through indexing.

The tile lists come from ``block_mask.tile_classes`` on the kernel's own grid, in
FlexAttention's layout (``BlockMask``): a program reads its row of them and visits the
partial tiles (every rule), then the full ones (no per-pair rule). The mods are traced into
the kernels on each tile, with the tile's b, h (the global query head), q_idx and kv_idx and
its final logits; a mod_aux array arrives as a whole ref that the mods read through ModAux,
whose indexing is a gather load.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_impl import block_mask, masking, mods


def broadcast_index(x, axis: int, index):
    """Block index along a mask/bias axis that may be broadcast (size 1): then always 0."""
    return index if x.shape[axis] > 1 else 0


def per_head(ref, b, h):
    """The entry of (batch b, query head h) of a ``[Bs, Hs]`` sinks/seeds ref (Bs in {1, B},
    Hs in {1, Hq}), or None without one."""
    if ref is None:
        return None
    return ref[broadcast_index(ref, 0, b), broadcast_index(ref, 1, h)]


class TileRules(NamedTuple):
    """Which rules a visited tile evaluates per pair (static)."""
    structural: bool  # rules 1-3 (band and lengths) and the loads' edge masks
    segments: bool    # rule 4
    mask_mod: bool    # cfg.mask_mod

    @classmethod
    def band(cls, masked: bool) -> "TileRules":
        """A tile of the band walk: structural at its edges, segment ids and mask_mod everywhere."""
        return cls(masked, True, True)


PARTIAL_TILE = TileRules(True, True, True)
# A full tile: tile_classes said FULL only where no rule can refuse a pair (with a mask_mod, only
# where a block_mask's full tiles promise it holds).
FULL_TILE = TileRules(False, False, False)


def tile_lists(cfg, masks: masking.MaskInputs, lq: int, lk: int, block_rows: int,
               block_cols: int, *, transposed: bool = False):
    """The (partial counts, partial indices, full counts, full indices) int32 lists of a grid of
    ``block_rows`` queries x ``block_cols`` keys, per query tile, or with ``transposed`` per key
    tile (the dK/dV kernel); None when the call has neither segment ids nor a block_mask."""
    classes = block_mask.tile_classes(cfg.mask, masks, lq, lk, block_rows, block_cols,
                                      mask_mod=cfg.mask_mod is not None)
    if classes is None:
        return None
    lists = block_mask.BlockMask.from_tile_classes(classes, lq, lk, block_rows, block_cols)
    if transposed:
        return (lists.q_num_blocks, lists.q_indices, lists.full_q_num_blocks, lists.full_q_indices)
    return (lists.kv_num_blocks, lists.kv_indices, lists.full_kv_num_blocks, lists.full_kv_indices)


def mod_aux_operand(x):
    """A mod_aux array as a kernel operand: bool as int8 (Triton loads no i1), 0-d as [1]."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.int8)
    return x.reshape(1) if x.ndim == 0 else x


_MOD_AUX_RULE = ("in the Pallas kernels a mod_aux array is read by indexing every axis "
                 "with an int or an int32 index array (slopes[h], table[bucket, h], doc[b, q_idx]); "
                 "{what} is not supported there (implementation='xla' takes any jnp code)")


class ModAux(mods.AuxView):
    """A mod_aux array inside a kernel: ``aux[i, j]`` with ints or int32 arrays that broadcast
    is one gather load (indices as jnp takes them: negative ones count from the end, the rest
    clamped into the array, so no load leaves it). Nothing else: a use as a whole array raises."""

    def __init__(self, ref, dtype, position: int):
        self._ref, self.dtype, self._position = ref, jnp.dtype(dtype), position
        self.shape, self.ndim = tuple(ref.shape), ref.ndim

    def _refuse(self, what):
        return TypeError(f"mod_aux[{self._position}] (shape {self.shape}): "
                         + _MOD_AUX_RULE.format(what=what))

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        if len(key) != self.ndim:
            raise self._refuse(f"indexing {len(key)} of its {self.ndim} axes")
        indices = []
        for axis, index in enumerate(key):
            if isinstance(index, bool) or not (isinstance(index, int) or (
                    hasattr(index, "dtype") and jnp.issubdtype(index.dtype, jnp.integer))):
                raise self._refuse(f"the index {index!r} on axis {axis}")
            index = jnp.asarray(index, jnp.int32)
            size = self.shape[axis]
            indices.append(jnp.clip(jnp.where(index < 0, index + size, index), 0, size - 1))
        shape = jnp.broadcast_shapes(*(i.shape for i in indices))
        value = self._ref[tuple(jnp.broadcast_to(i, shape) for i in indices)]
        return value != 0 if self.dtype == jnp.bool_ else value

    def __jax_array__(self):
        raise self._refuse("using the array as a whole")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise self._refuse(f"the attribute {name!r}")

    def _as_whole(self, *_):
        raise self._refuse("using the array as a whole (arithmetic, comparison, conversion)")

    __hash__ = object.__hash__
    for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and",
                  "or", "xor", "lshift", "rshift"):
        locals()[f"__{_name}__"] = locals()[f"__r{_name}__"] = _as_whole
    for _name in ("eq", "ne", "lt", "le", "gt", "ge", "neg", "pos", "abs", "invert", "iter",
                  "len", "bool", "int", "float", "index", "array"):
        locals()[f"__{_name}__"] = _as_whole
    del _name


def mods_unsupported(cfg, mod_aux) -> str | None:
    """Why a Pallas kernel cannot evaluate ``cfg``'s mods on ``mod_aux`` (arrays or
    ShapeDtypeStructs), or None: each mod traced once on the kernels' ModAux views, on
    broadcastable index arrays as the kernels call it (a refusal found while lowering would
    fail the call on every platform: lax.platform_dependent traces each platform's kernel)."""
    if cfg is None or not cfg.has_mods:
        return None
    refs = [jnp.zeros(tuple(x.shape) or (1,), mod_aux_operand(jnp.zeros((), x.dtype)).dtype)
            for x in mod_aux]
    index = jnp.zeros((1, 1, 1, 1), jnp.int32)

    def trace():
        views = kernel_mod_aux(refs, [(x.dtype, tuple(x.shape)) for x in mod_aux])
        if cfg.score_mod is not None:
            cfg.score_mod(jnp.zeros((1, 1, 1, 1), jnp.float32), index, index, index, index, *views)
        if cfg.mask_mod is not None:
            cfg.mask_mod(index, index, index, index, *views)

    try:
        jax.eval_shape(trace)
    except TypeError as error:
        if _MOD_AUX_RULE.split("{what}")[0] in str(error):
            return str(error)
        raise
    return None


def kernel_mod_aux(aux_refs, dtypes):
    """The mods' view of the mod_aux refs: ModAux, or the value itself for a 0-d entry (read
    once, usable as a scalar in any expression)."""
    def view(position, ref, dtype, shape):
        if shape:
            return ModAux(ref, dtype, position)
        return ref[0] != 0 if dtype == jnp.bool_ else ref[0]
    return tuple(view(i, ref, *types) for i, (ref, types) in enumerate(zip(aux_refs, dtypes)))


@dataclasses.dataclass(frozen=True)
class TileMods:
    """The call's score_mod and mask_mod on one program's tiles (batch row ``b``, global query
    head ``h``). ``gradient``: ``score`` also gives d score_mod / dS (the backward kernels)."""

    cfg: object
    b: jax.Array
    h: jax.Array
    aux: tuple
    gradient: bool = False

    @classmethod
    def create(cls, cfg, b, h, aux_refs, aux_types, gradient=False) -> "TileMods | None":
        if not cfg.has_mods:
            return None
        return cls(cfg, jnp.asarray(b, jnp.int32), jnp.asarray(h, jnp.int32),
                   kernel_mod_aux(aux_refs, aux_types), gradient)

    def at_head(self, h) -> "TileMods":
        return dataclasses.replace(self, h=jnp.asarray(h, jnp.int32))

    def allowed(self, rows, cols):
        return mods.allowed(self.cfg, self.b, self.h, rows, cols, self.aux)

    def score(self, s, rows, cols):
        """(score_mod(s), its elementwise derivative or None) for a tile of final logits s."""
        if self.cfg.score_mod is None:
            return s, None
        apply = lambda s: mods.score(self.cfg, s, self.b, self.h, rows, cols, self.aux)
        if not self.gradient:
            return apply(s), None
        return jax.jvp(apply, (s,), (jnp.ones_like(s),))


def mod_aux_types(aux):
    """Static (dtype, shape) of each mod_aux entry, for kernel_mod_aux."""
    return tuple((jnp.dtype(jnp.result_type(x)), tuple(jnp.shape(x))) for x in aux)
