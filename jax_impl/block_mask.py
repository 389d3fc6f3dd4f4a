"""Block-sparse attention masks: which (query tile, key tile) pairs an implementation visits.

A ``BlockMask`` is PyTorch FlexAttention's ``BlockMask`` for JAX. The ``[Lq, Lk]`` pairs are cut
into tiles of ``block_q`` queries by ``block_kv`` keys, and every tile is in one of three classes:

- empty (``EMPTY``): no pair may attend; the tile is skipped;
- partial (``PARTIAL``): some pairs may attend; the mask is evaluated per pair there;
- full (``FULL``): every pair may attend; no mask is evaluated.

The last tile of a sequence whose length is not a multiple of the block ("ragged") reaches past
it; the pairs past ``Lq`` or ``Lk`` count as masked (as FlexAttention pads its mask with False), so
a ragged tile is never full: a kernel still masks the columns past ``Lk`` there.

Made by ``create_block_mask`` from an element rule ``mask_mod``, or by ``block_mask_from_bounds``
from what ``flash_attention`` already knows (causal, windows, lengths, segment ids) without
evaluating pairs.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_impl import masking, mods

EMPTY, PARTIAL, FULL = 0, 1, 2
# Pairs in one mask_mod evaluation (a slab of query tiles x key tiles x batch x heads): bounds
# create_block_mask's memory whatever the sequence lengths.
SLAB_ELEMENTS = 1 << 20

_ARRAY_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
_STATIC_FIELDS = ("q_len", "kv_len", "block_q", "block_kv", "mask_mod")


@functools.partial(jax.tree_util.register_dataclass, data_fields=list(_ARRAY_FIELDS),
                   meta_fields=list(_STATIC_FIELDS))
@dataclasses.dataclass(frozen=True, eq=False)
class BlockMask:
    """The tiles of attention that may hold an allowed pair, as index lists (FlexAttention's layout).

    A JAX pytree: the arrays are its leaves (they may be traced, e.g. built under ``jit`` from
    traced ``mod_aux``), the lengths and block sizes static. With ``nq = ceil(q_len / block_q)``
    query tiles and ``nk = ceil(kv_len / block_kv)`` key tiles, all int32:

    - ``kv_num_blocks [B, H, nq]``, ``kv_indices [B, H, nq, nk]``: per query tile, how many
      partial key tiles it has and which (the first ``kv_num_blocks`` entries);
    - ``full_kv_num_blocks``, ``full_kv_indices``: the same for its full key tiles;
    - ``q_num_blocks [B, H, nk]``, ``q_indices [B, H, nk, nq]``, ``full_q_num_blocks``,
      ``full_q_indices``: the transpose, per key tile its query tiles (the dK/dV pass).

    B (batch) or H (query heads) of size 1 means the same tiles for every batch row or head.
    The valid entries of a row are sorted ascending. The entries past the count are padding that
    repeats the last valid index (0 when the count is 0), so a kernel that prefetches the next
    tile's index reads a tile it already has: no extra copy, never out of range.

    ``q_len``, ``kv_len``: the sequence lengths Lq and Lk it was built for; ``block_q``,
    ``block_kv``: the tile sizes; ``mask_mod``: the rule it was evaluated from
    (``create_block_mask``), whose EMPTY tiles it holds nowhere and FULL tiles everywhere, or
    None (made from tile classes or bounds). A call with the same mask_mod reads the tiles as
    they are; with another (or none), by the meaning pair by pair (``PairRule``).
    """

    kv_num_blocks: Any
    kv_indices: Any
    full_kv_num_blocks: Any
    full_kv_indices: Any
    q_num_blocks: Any
    q_indices: Any
    full_q_num_blocks: Any
    full_q_indices: Any
    q_len: int
    kv_len: int
    block_q: int
    block_kv: int
    mask_mod: Callable | None = None

    @classmethod
    def from_tile_classes(cls, classes, q_len: int, kv_len: int, block_q: int, block_kv: int,
                          mask_mod: Callable | None = None):
        """The BlockMask of ``classes [B, H, nq, nk]`` (``EMPTY``/``PARTIAL``/``FULL`` per tile);
        ``mask_mod``: the rule they were evaluated from (see the class), if any."""
        transposed = jnp.swapaxes(classes, -1, -2)
        return cls(*index_lists(classes == PARTIAL), *index_lists(classes == FULL),
                   *index_lists(transposed == PARTIAL), *index_lists(transposed == FULL),
                   q_len, kv_len, block_q, block_kv, mask_mod)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, H, q_len, kv_len)``; B or H is 1 where the mask is the same for all."""
        return (*self.kv_num_blocks.shape[:2], self.q_len, self.kv_len)

    @property
    def num_tiles(self) -> tuple[int, int]:
        """``(nq, nk)``: query tiles and key tiles."""
        return _cdiv(self.q_len, self.block_q), _cdiv(self.kv_len, self.block_kv)

    def sparsity(self):
        """The fraction of tiles skipped (empty), a float32 scalar array."""
        visited = self.kv_num_blocks.sum() + self.full_kv_num_blocks.sum()
        return 1.0 - visited.astype(jnp.float32) / self.kv_indices.size

    def to_dense(self):
        """The tile classes ``[B, H, nq, nk]`` int8 (``EMPTY``/``PARTIAL``/``FULL``), read back from
        the query-tile lists. For tests and debugging: it builds ``[B, H, nq, nk, nk]``."""
        return (_marked(self.kv_num_blocks, self.kv_indices)
                + FULL * _marked(self.full_kv_num_blocks, self.full_kv_indices))


@jax.jit
def _marked(counts, indices):
    """``[..., n]`` 1 at the first ``counts`` entries of each row of ``indices``, else 0."""
    n = indices.shape[-1]
    valid = jnp.arange(n) < counts[..., None]
    return ((indices[..., None] == jnp.arange(n)) & valid[..., None]).sum(-2, dtype=jnp.int8)


@jax.jit
def index_lists(selected):
    """``selected [..., n]`` bool -> (counts ``[...]``, indices ``[..., n]``) int32: the selected
    positions ascending, then the last of them repeated (0 when none) as padding."""
    n = selected.shape[-1]
    counts = selected.sum(-1, dtype=jnp.int32)
    order = jnp.argsort(~selected, axis=-1, stable=True).astype(jnp.int32)  # selected first
    last = jnp.take_along_axis(order, jnp.maximum(counts - 1, 0)[..., None], -1)
    last = jnp.where(counts[..., None] > 0, last, 0)
    return counts, jnp.where(jnp.arange(n) < counts[..., None], order, last)


def made_from(block_mask, mask_mod) -> bool:
    """Whether ``block_mask`` was evaluated from ``mask_mod`` (``BlockMask.mask_mod``)."""
    return (block_mask is not None and mask_mod is not None
            and getattr(block_mask, "mask_mod", None) is mask_mod)


def check_block_mask(block_mask, *, batch: int, heads: int, q_len: int, kv_len: int,
                     block_q: int | None = None, block_kv: int | None = None) -> None:
    """Raise unless ``block_mask`` fits a call with these batch rows, query heads, sequence
    lengths and (where given) tile sizes. The error names ``block_mask`` and what differs."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError("block_mask must be a jax_impl.block_mask.BlockMask (create_block_mask or "
                        f"block_mask_from_bounds); got {type(block_mask).__name__}")
    built = (block_mask.q_len, block_mask.kv_len)
    if built != (q_len, kv_len):
        raise ValueError(f"block_mask was built for (Lq, Lk)={built}; the call has "
                         f"(Lq, Lk)={(q_len, kv_len)}")
    for name, want in (("block_q", block_q), ("block_kv", block_kv)):
        if want is not None and getattr(block_mask, name) != want:
            raise ValueError(f"block_mask.{name}={getattr(block_mask, name)} must equal the "
                             f"implementation's {name}={want}")
    counts_shape = getattr(block_mask.kv_num_blocks, "shape", None)
    if counts_shape is None or len(counts_shape) != 3:
        raise ValueError(f"block_mask.kv_num_blocks must be int32 [B, H, nq]; got shape {counts_shape}")
    b, h = counts_shape[:2]
    if b not in (1, batch) or h not in (1, heads):
        raise ValueError(f"block_mask has (B, H)=({b}, {h}) (kv_num_blocks.shape="
                         f"{block_mask.kv_num_blocks.shape}); each must be 1 or the call's "
                         f"(batch, heads)=({batch}, {heads})")
    nq, nk = block_mask.num_tiles
    for name in _ARRAY_FIELDS:
        rows, cols = (nq, nk) if name.startswith(("kv", "full_kv")) else (nk, nq)
        want = (b, h, rows) if name.endswith("num_blocks") else (b, h, rows, cols)
        x = getattr(block_mask, name)
        if x.shape != want or x.dtype != jnp.int32:
            raise ValueError(f"block_mask.{name} must be int32 {want} for (Lq, Lk)={built} in "
                             f"tiles of {(block_mask.block_q, block_mask.block_kv)}; got "
                             f"{x.dtype} {x.shape}")


def create_block_mask(mask_mod: Callable, B: int | None, H: int | None, Lq: int, Lk: int, *,
                      block_size: int | tuple[int, int] = 128, mod_aux=()) -> BlockMask:
    """The BlockMask of an element rule, evaluated tile by tile (FlexAttention's ``create_block_mask``).

    ``mask_mod(b, h, q_idx, kv_idx, *mod_aux) -> bool`` (True = may attend) is written
    elementwise: ``b [B, 1, 1, 1]``, ``h [1, H, 1, 1]``, ``q_idx [1, 1, Q, 1]``, ``kv_idx
    [1, 1, 1, K]`` are int32 index arrays and the result must be bool and broadcast to
    ``[B, H, Q, K]``, e.g. ``lambda b, h, q, kv, doc: (kv <= q) & (doc[b, q] == doc[b, kv])``
    with ``mod_aux=(doc,)``. It only ever sees indices below Lq and Lk. B or H None: 1 (the
    same mask for every batch row or head).

    Arrays the rule reads go in ``mod_aux`` (a tuple, its entries passed after the indices):
    they are arguments of one compiled function per (mask_mod, B, H, Lq, Lk, block_size) and
    aux shapes, so new values reuse the compilation, also under ``jit``. A rule that closes over
    a traced array is refused; one that closes over a concrete array compiles it in as a
    constant (a new array recompiles). Pass the same function object to reuse the compilation.

    The pairs are evaluated in slabs of whole tiles, all B and H at once, of at most
    ``SLAB_ELEMENTS`` pairs (or one tile pair where that is more), never ``[Lq, Lk]`` at once. ``block_size``: an int, or ``(block_q, block_kv)``.
    """
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be a function (b, h, q_idx, kv_idx, *mod_aux) -> bool; "
                        f"got {type(mask_mod).__name__}")
    batch, heads = (_positive_int(name, 1 if x is None else x) for name, x in (("B", B), ("H", H)))
    Lq, Lk = _positive_int("Lq", Lq), _positive_int("Lk", Lk)
    if not isinstance(mod_aux, (tuple, list)):
        raise TypeError(f"mod_aux must be a tuple of the arrays mask_mod reads; got "
                        f"{type(mod_aux).__name__}")
    if B is None or H is None:
        try:
            reads = _reads_batch_and_head(mask_mod, batch, heads, tuple(mod_aux))
        except Exception:  # a mod that does not trace: _create's check names what is wrong
            reads = (False, False)
        for name, given, read in (("B", B, reads[0]), ("H", H, reads[1])):
            if given is None and read:
                raise ValueError(f"{name}=None (one mask for every {'batch row' if name == 'B' else 'head'}) "
                                 f"but mask_mod reads {'b' if name == 'B' else 'h'}: its tiles "
                                 f"would be those of the first only; pass {name}")
    return _create(mask_mod, batch, heads, Lq, Lk, *_block_size(block_size), tuple(mod_aux))


@functools.partial(jax.jit, static_argnums=range(7))
def _create(mask_mod, batch, heads, lq, lk, block_q, block_kv, mod_aux):
    return BlockMask.from_tile_classes(
        _evaluated_tile_classes(mask_mod, batch, heads, lq, lk, block_q, block_kv, mod_aux),
        lq, lk, block_q, block_kv, mask_mod)


def _reads_batch_and_head(mask_mod, batch: int, heads: int, mod_aux) -> tuple[bool, bool]:
    """Whether ``mask_mod``'s result depends on ``b`` and on ``h`` (read from its jaxpr)."""
    index = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    jaxpr = jax.make_jaxpr(mask_mod)(index(batch, 1, 1, 1), index(1, heads, 1, 1),
                                     index(1, 1, 1, 1), index(1, 1, 1, 1),
                                     *(jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
                                       for x in mod_aux)).jaxpr
    used = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
    return tuple(id(jaxpr.invars[i]) in used for i in (0, 1))


def of_mask_mod(mask_mod, batch: int, heads: int, lq: int, lk: int, mod_aux,
                block_size: int = 128) -> BlockMask:
    """The BlockMask that ``flash_attention`` builds for a call with a ``mask_mod`` and no
    ``block_mask`` (so that its empty tiles are skipped): ``create_block_mask``'s evaluation,
    over B and H only where ``mask_mod`` reads ``b`` and ``h`` (else one row or head stands
    for all: a mask that ignores the head costs 1/H of the pairs)."""
    reads_b, reads_h = _reads_batch_and_head(mask_mod, batch, heads, mod_aux)
    return _create(mask_mod, batch if reads_b else 1, heads if reads_h else 1, lq, lk,
                   block_size, block_size, tuple(mod_aux))


def _evaluated_tile_classes(mask_mod, batch, heads, lq, lk, block_q, block_kv, mod_aux):
    """``[B, H, nq, nk]`` tile classes, mask_mod evaluated one slab of tiles at a time."""
    nq, nk = _cdiv(lq, block_q), _cdiv(lk, block_kv)
    tile = batch * heads * block_q * block_kv
    kv_tiles = min(nk, max(1, SLAB_ELEMENTS // tile))  # as many key tiles as fit, then queries
    q_tiles = min(nq, max(1, SLAB_ELEMENTS // (tile * kv_tiles)))
    q_chunks, kv_chunks = _cdiv(nq, q_tiles), _cdiv(nk, kv_tiles)
    rows_per_chunk, cols_per_chunk = q_tiles * block_q, kv_tiles * block_kv
    b = jnp.arange(batch, dtype=jnp.int32).reshape(-1, 1, 1, 1)
    h = jnp.arange(heads, dtype=jnp.int32).reshape(1, -1, 1, 1)
    slab = (batch, heads, rows_per_chunk, cols_per_chunk)
    mods.check_function("mask_mod", "(b, h, q_idx, kv_idx, *mod_aux) -> bool", mask_mod,
                        (b, h, jnp.zeros((1, 1, rows_per_chunk, 1), jnp.int32),
                         jnp.zeros((1, 1, 1, cols_per_chunk), jnp.int32)), mod_aux, slab,
                        lambda dtype: dtype == jnp.bool_, "a bool array (True = may attend)")

    def classify(chunk):
        q_chunk, kv_chunk = chunk // kv_chunks, chunk % kv_chunks
        rows = q_chunk * rows_per_chunk + jnp.arange(rows_per_chunk, dtype=jnp.int32)
        cols = kv_chunk * cols_per_chunk + jnp.arange(cols_per_chunk, dtype=jnp.int32)
        allowed = mask_mod(b, h, jnp.minimum(rows, lq - 1).reshape(1, 1, -1, 1),
                           jnp.minimum(cols, lk - 1).reshape(1, 1, 1, -1), *mod_aux)
        in_range = (rows < lq)[:, None] & (cols < lk)[None, :]  # past Lq or Lk: masked
        tiles = (jnp.broadcast_to(allowed, slab) & in_range).reshape(
            batch, heads, q_tiles, block_q, kv_tiles, block_kv)
        return jnp.where(tiles.all((3, 5)), FULL,
                         jnp.where(tiles.any((3, 5)), PARTIAL, EMPTY)).astype(jnp.int8)

    classes = lax.map(classify, jnp.arange(q_chunks * kv_chunks, dtype=jnp.int32))
    classes = classes.reshape(q_chunks, kv_chunks, batch, heads, q_tiles, kv_tiles)
    classes = classes.transpose(2, 3, 0, 4, 1, 5).reshape(
        batch, heads, q_chunks * q_tiles, kv_chunks * kv_tiles)
    return classes[:, :, :nq, :nk]


def block_mask_from_bounds(spec: masking.MaskSpec, q_len: int, kv_len: int, *,
                           block_size: int | tuple[int, int] = 128, q_lengths=None,
                           kv_lengths=None, position_offset=None, q_segment_ids=None,
                           kv_segment_ids=None) -> BlockMask:
    """The BlockMask of ``flash_attention``'s structured rules, from per-tile bounds in
    ``O(nq * nk)`` without evaluating pairs. H is 1; B is that of the per-row arrays (1 if none).

    ``spec``: causal (either alignment) and window (``masking.MaskSpec``); ``q_lengths [B]`` and
    ``kv_lengths [B]``: valid queries and keys per row (None: all); ``position_offset [B]``: added
    to the diagonal as in ``masking.diagonal_band``; ``q_segment_ids [B, Lq]``,
    ``kv_segment_ids [B, Lk]``: only equal ids attend. The band and lengths
    (``masking.kv_block_split``) are exact. Segment ids use each tile's [min, max] id over its
    valid positions: disjoint ranges -> empty, one equal id on both sides -> full (where the
    band is), else partial. For packed documents (ids ascending) that is exact on tiles the band
    covers wholly; on a band edge tile it may say partial where no equal-id pair lies inside the
    band (a kernel then finds nothing to attend: slower, never wrong).
    """
    q_len, kv_len = _positive_int("q_len", q_len), _positive_int("kv_len", kv_len)
    block_q, block_kv = _block_size(block_size)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    per_row = {name: x for name, x in (
        ("q_lengths", q_lengths), ("kv_lengths", kv_lengths), ("position_offset", position_offset),
        ("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids)) if x is not None}
    batch = _common_batch(per_row, {"q_segment_ids": q_len, "kv_segment_ids": kv_len})
    # flash_attention's rule for lengths: concrete ones outside [0, L] refused, traced clamped.
    q_lens = masking.lengths("q_lengths", q_lengths, (batch,), q_len)
    kv_lens = masking.lengths("kv_lengths", kv_lengths, (batch,), kv_len)
    offset = None if position_offset is None else jnp.asarray(position_offset, jnp.int32)
    classes = _bounds_classes(spec, q_len, kv_len, block_q, block_kv, q_lens, kv_lens, offset,
                              q_segment_ids, kv_segment_ids)
    return BlockMask.from_tile_classes(jnp.broadcast_to(classes, (batch, *classes.shape[1:])),
                                       q_len, kv_len, block_q, block_kv)


def _bounds_classes(spec: masking.MaskSpec, q_len: int, kv_len: int, block_q: int, block_kv: int,
                    q_lens, kv_lens, offset, q_segment_ids, kv_segment_ids):
    """``[B|1, 1, nq, nk]`` int8 tile classes of the band, the lengths (``[B]``, traced ok) and
    the segment ids, from per-tile bounds (``block_mask_from_bounds`` says how)."""
    spec = masking.with_padding(spec, queries_padded=q_lens is not None or q_len % block_q != 0,
                                keys_padded=kv_lens is not None or kv_len % block_kv != 0)
    nq, nk = _cdiv(q_len, block_q), _cdiv(kv_len, block_kv)
    column = lambda x, full: jnp.asarray(full if x is None else x, jnp.int32).reshape(-1, 1)
    q_lens, kv_lens = column(q_lens, q_len), column(kv_lens, kv_len)
    offset = None if offset is None else column(offset, 0)
    q_tiles, kv_tiles = jnp.arange(nq, dtype=jnp.int32), jnp.arange(nk, dtype=jnp.int32)
    # Both projections of the band: kv_block_split's key-tile range per query tile and
    # q_block_split's query-tile range per key tile. Each alone keeps one tile past a window
    # that lies wholly beyond the sequence; their intersection is exact.
    key_ranges = masking.kv_block_split(spec, q_tiles * block_q, block_q, block_kv, q_lens,
                                        kv_lens, offset)
    query_ranges = masking.q_block_split(spec, kv_tiles * block_kv, block_kv, block_q,
                                         q_lens, kv_lens, offset)
    inside = lambda first, end, tile: (first[..., None] <= tile) & (tile < end[..., None])
    listed, full = (inside(key_ranges[first], key_ranges[end], kv_tiles)
                    & jnp.swapaxes(inside(query_ranges[first], query_ranges[end], q_tiles), -1, -2)
                    for first, end in ((0, 3), (1, 2)))  # (lo, full_lo, full_hi, hi)
    classes = jnp.where(full, FULL, jnp.where(listed, PARTIAL, EMPTY))
    if q_segment_ids is not None:
        q_min, q_max = _tile_id_range(q_segment_ids, q_lens, block_q)
        kv_min, kv_max = _tile_id_range(kv_segment_ids, kv_lens, block_kv)
        q_min, q_max, kv_min, kv_max = q_min[:, :, None], q_max[:, :, None], kv_min[:, None], kv_max[:, None]
        one_id = (q_min == q_max) & (kv_min == kv_max) & (q_min == kv_min)
        disjoint = (q_max < kv_min) | (kv_max < q_min)
        # The tile class of two rules together: empty if either is, full only if both are.
        classes = jnp.minimum(classes, jnp.where(one_id, FULL, jnp.where(disjoint, EMPTY, PARTIAL)))
    return classes.astype(jnp.int8)[:, None]


def tile_classes(spec: masking.MaskSpec, masks: masking.MaskInputs, q_len: int, kv_len: int,
                 block_q: int, block_kv: int, *, mask_mod: bool = False, band_only: bool = False):
    """The class of every tile of an implementation's grid, ``[B|1, H|1, nq, nk]`` int8, or None
    when the call has neither segment ids nor a block_mask (the band alone: the
    implementations' own band loops skip its tiles).

    Combines the band and lengths of ``spec`` and ``masks`` (``masks.q_len`` etc., ring position
    offsets included), the segment ids and ``masks.block_mask`` regridded to these tiles
    (``regrid``). ``mask_mod``: whether the call has one; without a block_mask no tile is then
    FULL (mask_mod is evaluated on every visited tile). FULL: every pair passes rules 1-4 and
    the block_mask's full tiles; a dense mask and the non-finite rule still apply there.
    ``band_only``: the classes also where they come from the band alone (instead of None).
    """
    if masks.q_segment_ids is None and masks.block_mask is None and not band_only:
        return None
    spec = dataclasses.replace(spec, has_q_lengths=True, has_kv_lengths=True)
    classes = _bounds_classes(spec, q_len, kv_len, block_q, block_kv, masks.q_len, masks.kv_len,
                              masks.position_offset, masks.q_segment_ids, masks.kv_segment_ids)
    if masks.block_mask is not None:
        classes = jnp.minimum(classes, regrid(masks.block_mask, block_q, block_kv))
    elif mask_mod:
        classes = jnp.minimum(classes, jnp.int8(PARTIAL))
    return classes


@dataclasses.dataclass(frozen=True)
class PairRule:
    """The meaning of a block_mask, pair by pair (FlexAttention's): a pair in an EMPTY tile is
    excluded, one in a FULL tile allowed, one in a PARTIAL tile allowed where ``mask_mod`` says
    (every pair, without one). A mask_mod over the tile classes, which arrive as the last
    mod_aux entry (int32 ``[Bc, Hc, nq, nk]``, ``dense_classes``): ``on_grid`` gives it to a
    kernel whose tiles the block_mask's tiles cannot describe exactly."""

    mask_mod: Callable | None
    block_q: int
    block_kv: int

    def __call__(self, b, h, q_idx, kv_idx, *mod_aux):
        *mod_aux, classes = mod_aux
        pick = lambda index, size: index if size > 1 else 0 * index
        # lax.div, not //: indices are never negative, and the C++ mod programs have no floor.
        tile = classes[pick(b, classes.shape[0]), pick(h, classes.shape[1]),
                       lax.div(q_idx, jnp.int32(self.block_q)),
                       lax.div(kv_idx, jnp.int32(self.block_kv))]
        allowed = tile == FULL
        if self.mask_mod is None:
            return allowed | (tile == PARTIAL)
        return allowed | ((tile == PARTIAL) & self.mask_mod(b, h, q_idx, kv_idx, *mod_aux))


@dataclasses.dataclass(frozen=True)
class _BesidePairRule:
    """A score_mod beside a PairRule: it does not see the tile classes' mod_aux entry."""

    score_mod: Callable

    def __call__(self, score, b, h, q_idx, kv_idx, *mod_aux):
        return self.score_mod(score, b, h, q_idx, kv_idx, *mod_aux[:-1])


def needs_pair_rule(cfg, tiles: tuple[int, int], shape: tuple[int, int], grids, *,
                    has_segment_ids: bool, varies: bool = False) -> bool:
    """Whether a kernel with tiles ``grids`` must evaluate a block_mask of ``tiles`` (block_q,
    block_kv) over ``shape`` (Lq, Lk) pair by pair (``PairRule``) to give its meaning; it reads
    the block_mask's tiles, regridded to its own (``tile_classes``), as they are where:

    - the call's mask_mod is the one the block_mask was made from
      (``cfg.mask.block_mask_of_mask_mod``): the mask_mod holds on FULL tiles and nowhere on
      EMPTY ones, so evaluating it on any tile changes nothing;
    - or every kernel tile lies inside one block_mask tile, the kernel walks each batch row and
      head's own tiles (``varies``: the block_mask differs across the rows and heads that one
      kernel step walks together, as xla's steps do) and, with a mask_mod, no other rule (a band,
      lengths, segment ids, a ragged last tile) can make a tile inside a FULL one partial, where
      the kernel would evaluate the mask_mod that a FULL tile does not consult."""
    if cfg.mask_mod is not None and cfg.mask.block_mask_of_mask_mod:
        return False
    nested = all(tiles[0] % bq == 0 and tiles[1] % bk == 0 for bq, bk in grids)
    if not nested or varies:
        return True
    if cfg.mask_mod is None:
        return False
    spec = cfg.mask
    splits = (spec.has_band or spec.has_q_lengths or spec.has_kv_lengths or has_segment_ids
              or any(shape[0] % bq or shape[1] % bk for bq, bk in grids))
    return bool(splits)


def on_grid(cfg, masks, extras, grids, *, per_row_and_head: bool = True):
    """(cfg, extras) with which a kernel whose tiles are ``grids`` (``(block_q, block_kv)``
    each) runs a call with a block_mask exactly: unchanged where it can read the block_mask's
    tiles as they are (``needs_pair_rule``), else ``with_pair_rule``'s. ``per_row_and_head``:
    False for a kernel that walks several batch rows or heads at once (xla's steps take the
    union of their tiles). A backward keeps the cotangents of the caller's mod_aux entries only."""
    tiles = masks.block_mask
    if tiles is None:
        return cfg, extras
    varies = not per_row_and_head and tiles.kv_num_blocks.shape[:2] != (1, 1)
    if not needs_pair_rule(cfg, (tiles.block_q, tiles.block_kv), (tiles.q_len, tiles.kv_len),
                           grids, has_segment_ids=masks.q_segment_ids is not None, varies=varies):
        return cfg, extras
    return with_pair_rule(cfg, masks, extras)


def with_pair_rule(cfg, masks, extras):
    """(cfg, extras) whose mask_mod is the block_mask's ``PairRule`` (the caller's mask_mod
    inside it), with ``dense_classes`` as the last mod_aux entry."""
    classes = dense_classes(masks.block_mask).astype(jnp.int32)
    extras = extras._replace(mod_aux=(*extras.mod_aux, classes))
    score_mod = None if cfg.score_mod is None else _BesidePairRule(cfg.score_mod)
    aux_gradients = None if cfg.aux_gradients is None else (*cfg.aux_gradients, False)
    rule = PairRule(cfg.mask_mod, masks.block_mask.block_q, masks.block_mask.block_kv)
    return dataclasses.replace(cfg, mask_mod=rule, score_mod=score_mod,
                               aux_gradients=aux_gradients), extras


def dense_classes(block_mask: BlockMask):
    """``[B, H, nq, nk]`` int8 tile classes of ``block_mask``, scattered from its query-tile
    lists in ``O(B * H * nq * nk)``."""
    nq, nk = block_mask.num_tiles

    def scatter(counts, indices, value):
        valid = jnp.arange(nk) < counts[..., None]
        onto = jnp.where(valid, indices, nk)  # past the end: dropped
        rows = jnp.zeros(counts.shape + (nk + 1,), jnp.int8)
        rows = jnp.put_along_axis(rows, onto, jnp.int8(value), axis=-1, inplace=False)
        return rows[..., :nk]

    return jnp.maximum(scatter(block_mask.kv_num_blocks, block_mask.kv_indices, PARTIAL),
                       scatter(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, FULL))


def regrid(block_mask: BlockMask, block_q: int, block_kv: int):
    """``block_mask``'s classes on tiles of ``(block_q, block_kv)``, ``[B, H, nq, nk]`` int8: a
    tile is EMPTY where every block_mask tile it overlaps is, FULL where every one is, else
    PARTIAL. Exact when the tiles nest; conservative (more PARTIAL) otherwise."""
    classes = dense_classes(block_mask)
    if (block_mask.block_q, block_mask.block_kv) == (block_q, block_kv):
        return classes
    low, high = classes, classes
    for axis, length, mine, theirs in ((2, block_mask.q_len, block_mask.block_q, block_q),
                                       (3, block_mask.kv_len, block_mask.block_kv, block_kv)):
        covered = _covered_tiles(length, mine, theirs)  # [n, K] numpy
        take = lambda x: jnp.take(x, covered.reshape(-1), axis=axis).reshape(
            x.shape[:axis] + covered.shape + x.shape[axis + 1:])
        low, high = take(low).min(axis + 1), take(high).max(axis + 1)
    return jnp.where(low == FULL, FULL, jnp.where(high == EMPTY, EMPTY, PARTIAL)).astype(jnp.int8)


def _covered_tiles(length: int, block: int, new_block: int) -> np.ndarray:
    """``[n_new, K]``: for each tile of ``new_block`` over ``length``, the indices of the
    ``block`` tiles it overlaps, the last repeated to a common width K."""
    starts = np.arange(_cdiv(length, new_block)) * new_block
    first = starts // block
    last = (np.minimum(starts + new_block, length) - 1) // block
    width = int((last - first).max()) + 1
    return np.minimum(first[:, None] + np.arange(width), last[:, None])


def _tile_id_range(ids, lengths, block: int):
    """Per tile ``[B, n]`` the min and max id over the positions below the row's length
    (a tile with none: min > max, disjoint from every range). Segment reductions, not a padded
    copy: the lowered program holds no pad of the caller's ids."""
    seq_len = ids.shape[1]
    n = _cdiv(seq_len, block)
    valid = jnp.arange(seq_len) < lengths
    info = jnp.iinfo(jnp.int32)
    tile = jnp.arange(seq_len) // block
    reduce = lambda op, fill: op(jnp.where(valid, ids.astype(jnp.int32), fill).T, tile,
                                 num_segments=n, indices_are_sorted=True).T
    return reduce(jax.ops.segment_min, info.max), reduce(jax.ops.segment_max, info.min)


def _common_batch(per_row: dict, seq_lens: dict) -> int:
    """The batch size B that the per-row arrays share (1 if none is given)."""
    first = None
    for name, x in per_row.items():
        x = jnp.asarray(x)
        want = f"[B, {seq_lens[name]}]" if name in seq_lens else "[B]"
        if (not jnp.issubdtype(x.dtype, jnp.integer) or x.ndim != (2 if name in seq_lens else 1)
                or (name in seq_lens and x.shape[1] != seq_lens[name])):
            raise ValueError(f"{name} must be integers {want}; got {x.dtype} {x.shape}")
        if first is not None and x.shape[0] != first[1]:
            raise ValueError(f"{name} has batch {x.shape[0]} where {first[0]} has {first[1]}")
        first = first or (name, x.shape[0])
    return 1 if first is None else first[1]


def _block_size(block_size) -> tuple[int, int]:
    sizes = (block_size, block_size) if isinstance(block_size, (int, np.integer)) else block_size
    if (not isinstance(sizes, (tuple, list)) or len(sizes) != 2
            or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1
                   for s in sizes)):
        raise ValueError(f"{block_size=} must be an int >= 1 or a pair (block_q, block_kv) of "
                         "ints >= 1")
    return int(sizes[0]), int(sizes[1])


def _positive_int(name: str, x) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1:
        raise ValueError(f"{name}={x!r} must be an int >= 1 (it is static)")
    return int(x)


def _cdiv(x: int, block: int) -> int:
    return -(-x // block)
