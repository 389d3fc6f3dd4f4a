"""Which (query i, key j) pairs may interact: the one description every implementation uses.

A pair is allowed when all of these hold (docs/semantics.md):

1. ``i < q_len[b]`` and ``j < kv_len[b]`` (sequence lengths; the full length when not given);
2. causal: ``j <= i + offset[b]``;
3. window ``(left, right)``: ``i + offset[b] - left <= j <= i + offset[b] + right``;
4. segment ids: ``q_segment_ids[b, i] == kv_segment_ids[b, j]``;
5. the dense boolean mask, True = may attend;

where ``offset[b]`` is 0 for the top-left causal alignment and ``kv_len[b] - q_len[b]`` for
bottom-right, plus ``MaskInputs.position_offset[b]`` when given (ring attention: a block of
queries starting at global position ``qs`` against keys starting at ``ks`` passes
``qs - ks``, so local indices keep their global meaning). Rules 1-3 are a band ``d_lo <= j - i <= d_hi`` inside the valid rectangle, so
they also give, for any tile of queries, the range of key tiles that can hold an allowed pair
(and the converse): the kernels skip every tile outside it instead of computing and masking.
Rules 4 and 5 depend on data and are applied per element only.

The functions below use only jnp/lax ops that lower inside Pallas Triton kernels as well as
in XLA, and broadcast: a kernel passes scalars for one batch row, XLA passes ``[B, 1, ...]``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """The static part of the mask: structure known at trace time."""

    is_causal: bool = False
    bottom_right: bool = False
    window_left: int | None = None   # None: unbounded to the left
    window_right: int | None = None  # None: unbounded to the right
    has_q_lengths: bool = False   # query_seq_lengths given (else every query is valid)
    has_kv_lengths: bool = False  # key_value_seq_lengths given
    has_block_mask: bool = False  # MaskInputs.block_mask given (block_mask.tile_classes reads it)
    # The block_mask was evaluated from the call's mask_mod (BlockMask.mask_mod): its tiles are
    # exact on any grid (block_mask.on_grid).
    block_mask_of_mask_mod: bool = False

    @property
    def has_band(self) -> bool:
        """Whether ``diagonal_band`` bounds either side: tiles outside the band can be skipped."""
        return self.is_causal or self.window_left is not None or self.window_right is not None

    @property
    def varies_by_row(self) -> bool:
        """Whether rules 1-3 depend on the query row (a band, or query lengths): only then
        does ``key_bounds_per_row`` read its ``rows``."""
        return self.has_band or self.has_q_lengths

    @property
    def restricts(self) -> bool:
        """Whether rules 1-3 can refuse any pair (``structural_allowed`` is not None)."""
        return self.has_band or self.has_q_lengths or self.has_kv_lengths


def diagonal_band(spec: MaskSpec, q_len, kv_len, position_offset=None):
    """(d_lo, d_hi) with ``d_lo <= j - i <= d_hi``; an unbounded side is None.

    ``position_offset`` (traced int, or None): added to the alignment's offset.
    """
    offset = kv_len - q_len if spec.bottom_right else 0
    if position_offset is not None:
        offset = offset + position_offset
    d_hi = None
    if spec.is_causal:
        d_hi = offset
    if spec.window_right is not None:
        right = offset + spec.window_right
        d_hi = right if d_hi is None else jnp.minimum(d_hi, right)
    d_lo = offset - spec.window_left if spec.window_left is not None else None
    return d_lo, d_hi


def with_padding(spec: MaskSpec, *, queries_padded: bool, keys_padded: bool) -> MaskSpec:
    """The spec a blocked implementation uses when its last tiles reach past the sequences
    (padded, or read through masked loads): those queries and keys sit at or past the lengths,
    so the length rule is switched on."""
    return dataclasses.replace(spec, has_q_lengths=spec.has_q_lengths or queries_padded,
                               has_kv_lengths=spec.has_kv_lengths or keys_padded)


def structural_allowed(spec: MaskSpec, rows, cols, q_len, kv_len, position_offset=None):
    """Rules 1-3 element-wise. rows ``[..., Tq, 1]``, cols ``[..., 1, Tk]`` absolute positions.

    Returns None when every pair passes, so that the unmasked case costs no select. The length
    rules are evaluated only where lengths were given or the sequence was padded
    (``with_padding``).
    """
    conditions = []
    if spec.has_q_lengths:
        conditions.append(rows < q_len)
    if spec.has_kv_lengths:
        conditions.append(cols < kv_len)
    d_lo, d_hi = diagonal_band(spec, q_len, kv_len, position_offset)
    if d_lo is not None:
        conditions.append(cols - rows >= d_lo)
    if d_hi is not None:
        conditions.append(cols - rows <= d_hi)
    return all_of(conditions)


def key_bounds_per_row(spec: MaskSpec, rows, first_col, q_len, kv_len, position_offset=None):
    """Rules 1-3 as bounds on a tile's local key index ``c >= 0`` (absolute key
    ``first_col + c``) per row of ``rows``: (lo, hi), each of ``rows``'s shape, a scalar or None
    (unbounded), with ``structural_allowed`` true exactly where ``lo <= c <= hi``
    (``within_bounds``). A kernel then compares its column iota with two values per row, where
    ``cols - rows`` per pair, hoisted out of a loop, costs a register per pair (the Mosaic GPU
    forward spilled so with segment ids, a mask or dropout). ``rows`` may be None where the
    spec does not vary by row (``MaskSpec.varies_by_row``)."""
    lo = hi = None
    d_lo, d_hi = diagonal_band(spec, q_len, kv_len, position_offset)
    if d_hi is not None:
        hi = rows + (d_hi - first_col)
    if d_lo is not None:
        lo = rows + (d_lo - first_col)
    if spec.has_kv_lengths:
        last = kv_len - 1 - first_col
        hi = last if hi is None else jnp.minimum(hi, last)
    if spec.has_q_lengths:  # a row past q_len allows no key: an empty range
        hi = jnp.where(rows < q_len, jnp.int32(2**30) if hi is None else hi, -1)
    return lo, hi


def query_bounds_per_key(spec: MaskSpec, keys, first_row, q_len, kv_len, position_offset=None):
    """``key_bounds_per_row`` transposed: rules 1-3 as bounds on a tile's local query index
    ``r >= 0`` (absolute query ``first_row + r``) per key of ``keys``: (lo, hi), each of
    ``keys``'s shape, a scalar or None, with ``structural_allowed`` true exactly where
    ``lo <= r <= hi``. For kernels whose tiles are keys x queries (the Mosaic GPU dK/dV).
    Written out beside its mirror rather than through one helper: the helper's form of the
    same integers (``keys + (-d_hi - first_row)``) changed dK/dV's compiled spills (16 to 12
    bytes in one row, 80 to 76 in another), and the committed report is this form's."""
    lo = hi = None
    d_lo, d_hi = diagonal_band(spec, q_len, kv_len, position_offset)
    if d_hi is not None:  # key - query <= d_hi
        lo = keys - (d_hi + first_row)
    if d_lo is not None:  # key - query >= d_lo
        hi = keys - (d_lo + first_row)
    if spec.has_q_lengths:
        last = q_len - 1 - first_row
        hi = last if hi is None else jnp.minimum(hi, last)
    if spec.has_kv_lengths:  # a key past kv_len allows no query: an empty range
        hi = jnp.where(keys < kv_len, jnp.int32(2**30) if hi is None else hi, -1)
    return lo, hi


def within_bounds(cols, lo, hi):
    """``lo <= cols <= hi``; either bound may be None (unbounded), a scalar, or per-row values
    already broadcast to ``cols``."""
    return all_of([None if lo is None else cols >= lo, None if hi is None else cols <= hi])


def segments_equal(q_segment_ids, kv_segment_ids):
    """Rule 4: ``[..., Tq]`` and ``[..., Tk]`` ids -> ``[..., Tq, Tk]``, True where equal."""
    return q_segment_ids[..., :, None] == kv_segment_ids[..., None, :]


def allowed(spec: MaskSpec, rows, cols, q_len, kv_len, q_segment_ids=None, kv_segment_ids=None,
            mask=None, *, structural: bool = True, position_offset=None):
    """Rules 1-5 for one tile (or the whole ``[Lq, Lk]``), or None when every pair passes.

    ``structural=False`` for a tile inside the band (``kv_block_split``): rules 1-3 hold for
    every pair, so only segment ids and the dense mask (bool, or int8 in a kernel) are evaluated.
    """
    conditions = [structural_allowed(spec, rows, cols, q_len, kv_len, position_offset)
                  if structural else None]
    if q_segment_ids is not None:
        conditions.append(segments_equal(q_segment_ids, kv_segment_ids))
    if mask is not None:
        conditions.append(mask if mask.dtype == jnp.bool_ else mask != 0)
    return all_of(conditions)


def all_of(conditions):
    """The conjunction of the conditions that are not None; None if there are none."""
    allowed = None
    for condition in conditions:
        if condition is not None:
            allowed = condition if allowed is None else allowed & condition
    return allowed


def _cdiv(x, block: int):
    return lax.div(x + (block - 1), block)


def kv_block_range(spec: MaskSpec, q_start, q_size: int, block_k: int, q_len, kv_len, position_offset=None):
    """Key tiles ``[lo, hi)`` that can hold an allowed pair for queries ``[q_start, q_start + q_size)``.

    ``hi <= lo`` means the query tile has no allowed key at all.
    """
    d_lo, d_hi = diagonal_band(spec, q_len, kv_len, position_offset)
    q_last = jnp.minimum(q_start + q_size, q_len) - 1
    j_begin = jnp.zeros_like(q_len) if d_lo is None else jnp.maximum(q_start + d_lo, 0)
    j_end = kv_len if d_hi is None else jnp.minimum(kv_len, q_last + d_hi + 1)
    j_end = jnp.where(q_last >= q_start, j_end, 0)  # tile lies past the valid queries
    lo = lax.div(jnp.minimum(j_begin, kv_len), block_k)
    hi = jnp.maximum(_cdiv(jnp.maximum(j_end, 0), block_k), lo)
    return lo, hi


def q_block_range(spec: MaskSpec, k_start, k_size: int, block_q: int, q_len, kv_len, position_offset=None):
    """Query tiles ``[lo, hi)`` that can hold an allowed pair for keys ``[k_start, k_start + k_size)``."""
    d_lo, d_hi = diagonal_band(spec, q_len, kv_len, position_offset)
    k_last = jnp.minimum(k_start + k_size, kv_len) - 1
    i_begin = jnp.zeros_like(q_len) if d_hi is None else jnp.maximum(k_start - d_hi, 0)
    i_end = q_len if d_lo is None else jnp.minimum(q_len, k_last - d_lo + 1)
    i_end = jnp.where(k_last >= k_start, i_end, 0)
    lo = lax.div(jnp.minimum(i_begin, q_len), block_q)
    hi = jnp.maximum(_cdiv(jnp.maximum(i_end, 0), block_q), lo)
    return lo, hi


def kv_block_split(spec: MaskSpec, q_start, q_size: int, block_k: int, q_len, kv_len, position_offset=None):
    """``kv_block_range`` split FlashAttention-2 style: ``(lo, full_lo, full_hi, hi)``.

    Key tiles in ``[full_lo, full_hi)`` lie wholly inside the band and the valid rectangle
    (rules 1-3 hold for every pair), so they need no structural mask; only the tiles at the
    edges, ``[lo, full_lo)`` and ``[full_hi, hi)``, evaluate it.
    """
    lo, hi = kv_block_range(spec, q_start, q_size, block_k, q_len, kv_len, position_offset)
    d_lo, d_hi = diagonal_band(spec, q_len, kv_len, position_offset)
    q_last = q_start + q_size - 1
    full_lo, full_hi = lo, hi
    if d_lo is not None:  # every key j >= q_last + d_lo
        full_lo = jnp.maximum(full_lo, _cdiv(jnp.maximum(q_last + d_lo, 0), block_k))
    if d_hi is not None:  # every key j <= q_start + d_hi
        full_hi = jnp.minimum(full_hi, lax.div(jnp.maximum(q_start + d_hi + 1, 0), block_k))
    if spec.has_kv_lengths:
        full_hi = jnp.minimum(full_hi, lax.div(kv_len, block_k))
    if spec.has_q_lengths:  # a tile with invalid rows is never unmasked
        full_hi = jnp.where(q_last < q_len, full_hi, full_lo)
    return _clamp_split(lo, full_lo, full_hi, hi)


def q_block_split(spec: MaskSpec, k_start, k_size: int, block_q: int, q_len, kv_len, position_offset=None):
    """``q_block_range`` split like ``kv_block_split``: query tiles ``[full_lo, full_hi)``
    need no structural mask against keys ``[k_start, k_start + k_size)``."""
    lo, hi = q_block_range(spec, k_start, k_size, block_q, q_len, kv_len, position_offset)
    d_lo, d_hi = diagonal_band(spec, q_len, kv_len, position_offset)
    k_last = k_start + k_size - 1
    full_lo, full_hi = lo, hi
    if d_hi is not None:  # every query i >= k_last - d_hi
        full_lo = jnp.maximum(full_lo, _cdiv(jnp.maximum(k_last - d_hi, 0), block_q))
    if d_lo is not None:  # every query i <= k_start - d_lo
        full_hi = jnp.minimum(full_hi, lax.div(jnp.maximum(k_start - d_lo + 1, 0), block_q))
    if spec.has_q_lengths:
        full_hi = jnp.minimum(full_hi, lax.div(q_len, block_q))
    if spec.has_kv_lengths:  # a tile with invalid keys is never unmasked
        full_hi = jnp.where(k_last < kv_len, full_hi, full_lo)
    return _clamp_split(lo, full_lo, full_hi, hi)


def _clamp_split(lo, full_lo, full_hi, hi):
    full_lo = jnp.minimum(jnp.maximum(full_lo, lo), hi)
    full_hi = jnp.minimum(jnp.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


def split_fori_loop(bounds, body, carry):
    """Run ``body(i, carry, masked)`` over ``[lo, hi)``: masked at the edges, unmasked inside."""
    lo, full_lo, full_hi, hi = bounds
    carry = lax.fori_loop(lo, full_lo, lambda i, c: body(i, c, True), carry)
    carry = lax.fori_loop(full_lo, full_hi, lambda i, c: body(i, c, False), carry)
    return lax.fori_loop(full_hi, hi, lambda i, c: body(i, c, True), carry)


def later_query_tiles_heavier(spec: MaskSpec) -> bool:
    """Whether a later query tile can see more key tiles than an earlier one (the band is
    bounded above: causal or a right window; with a left window too, the first tiles are the
    ones cut short at key 0). The forward and dQ kernels then take their tiles last first."""
    return spec.is_causal or spec.window_right is not None


def later_key_tiles_heavier(spec: MaskSpec) -> bool:
    """Whether a later key tile is seen by more query tiles (the band bounded below only):
    the dK/dV kernel then takes its tiles last first. A causal band is heaviest at key 0."""
    return spec.window_left is not None and not later_query_tiles_heavier(spec)


def dense_allowed(spec: MaskSpec, lq: int, lk: int, q_len, kv_len,
                  q_segment_ids=None, kv_segment_ids=None, mask=None):
    """The whole ``[B, Hm, Lq, Lk]`` boolean pattern (Hm = 1 unless a per-head mask is given).

    Used by the dense reference only: the blocked paths evaluate the same rules tile by tile.
    q_len, kv_len: ``[B]`` int32.
    """
    rows = jnp.arange(lq, dtype=jnp.int32)[None, None, :, None]
    cols = jnp.arange(lk, dtype=jnp.int32)[None, None, None, :]
    full = dataclasses.replace(spec, has_q_lengths=True, has_kv_lengths=True)
    segments = (None, None) if q_segment_ids is None else (q_segment_ids[:, None], kv_segment_ids[:, None])
    result = allowed(full, rows, cols, q_len[:, None, None, None], kv_len[:, None, None, None],
                     *segments, mask)
    return jnp.broadcast_to(result, jnp.broadcast_shapes(result.shape, (len(q_len), 1, lq, lk)))


class MaskInputs(NamedTuple):
    """The data part of the mask, canonical shapes (see flash_attention.normalize)."""

    q_len: jax.Array                  # [B] int32, clamped to [0, Lq]
    kv_len: jax.Array                 # [B] int32, clamped to [0, Lk]
    q_segment_ids: jax.Array | None   # [B, Lq] int32
    kv_segment_ids: jax.Array | None  # [B, Lk] int32
    mask: jax.Array | None            # [Bm, Hm, Lq, Lk] bool, Bm in {1, B}, Hm in {1, Hq}
    # [B] int32 added to the band's offset (diagonal_band); None: 0. Set by ring attention.
    position_offset: jax.Array | None = None
    # block_mask.BlockMask (FlexAttention's tiles: empty skipped, full unmasked), or None.
    block_mask: object | None = None


def lengths(name, lengths, batch_shape, seq_len):
    """[B] int32 lengths, clamped to [0, seq_len]: concrete values outside are refused; traced
    ones (under jit) cannot be checked, and past the sequence they mean the whole sequence."""
    b = math.prod(batch_shape)
    if lengths is None:
        return jnp.full((b,), seq_len, jnp.int32)
    values = concrete(lengths)  # before any cast: int64 values must not wrap
    lengths = jnp.asarray(lengths) if values is None else values
    if not np.issubdtype(lengths.dtype, np.integer):
        raise TypeError(f"{name} must be integers; got {lengths.dtype}")
    if lengths.shape != batch_shape:
        raise ValueError(f"{name}.shape={lengths.shape} must equal the batch shape {batch_shape}")
    if values is not None:
        if values.size and (values.min() < 0 or values.max() > seq_len):
            raise ValueError(f"{name} must lie in [0, {seq_len}]; got values in "
                             f"[{values.min()}, {values.max()}]")
        return jnp.asarray(values.reshape(b), jnp.int32)
    # Clamped before the int32 cast, which could wrap a traced int64 length.
    return jnp.clip(lengths, 0, seq_len).reshape(b).astype(jnp.int32)


def concrete(x):
    """x as numpy when its values are known at trace time, else None (traced under jit)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None
