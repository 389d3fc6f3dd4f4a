"""Pieces every Triton kernel uses: the dot, the key tile's logits, the specs of per-row and
per-head operands, the walk over a tile list; what all Pallas kernels share of a tile (its
rules, the tile lists, the mods) is in ``jax_impl.kernel_tiles``."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_impl import block_mask, dropout_sinks, masking, mods, online_softmax
from jax_impl.kernel_tiles import (  # noqa: F401  (the Triton kernels read them as common.X)
    FULL_TILE, PARTIAL_TILE, ModAux, TileMods, TileRules, broadcast_index, kernel_mod_aux,
    mod_aux_operand, mod_aux_types, per_head, tile_lists)
from jax_impl.pallas_triton.layout import load, within


def dot(a, b, precision, *, trans_a: bool = False, trans_b: bool = False):
    """a @ b (optionally transposed) with float32 accumulation.

    ``precision`` (a ``lax.Precision`` or a ``lax.DotAlgorithmPreset`` that flash_attention
    validated) applies to float32 operands only (HIGHEST: full fp32, never silent TF32;
    TF32_TF32_F32_X3 lowers to Triton's ``tf32x3``); 16-bit operands always use the tensor
    cores' native mode.
    """
    contract = (0 if trans_a else 1, 1 if trans_b else 0)
    precision = precision if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, ((contract[:1], contract[1:]), ((), ())),
                           precision=precision, preferred_element_type=jnp.float32)


class QueryTile(NamedTuple):
    """What the key loop of the forward and dQ kernels reads of its program's query tile."""
    q: jax.Array                    # [bq, Dp], a row holding a non-finite value all NaN
    rows: jax.Array                 # [bq, 1] query positions
    ok: jax.Array | None            # [bq] inside Lq (layout.within), None: all are
    segment_ids: jax.Array | None   # [bq]
    q_len: jax.Array
    kv_len: jax.Array
    offset: jax.Array | None        # position offset (ring), or None

    @classmethod
    def create(cls, q, rows, ok, segment_ids, q_len, kv_len, offset, poison=None) -> "QueryTile":
        """``poison`` ``[bq]``: the query rows' share of the non-finite rule (NaN or 0), added
        to q here once per program, or None where q comes with it (the forward's q, poisoned by
        XLA). q enters only S = q k^T in these kernels, so a poisoned row makes every logit of
        its row NaN, and the mask's select keeps it only at the allowed pairs, on every tile."""
        if poison is not None:
            q = q + online_softmax.per_row(poison).astype(q.dtype)
        return cls(q, rows, ok, segment_ids, q_len, kv_len, offset)


class KeyTile(NamedTuple):
    cols: jax.Array                 # [1, bk] key positions
    ok: jax.Array | None            # [bk] inside Lk, None: all are (or an interior tile)
    allowed: jax.Array | None       # [bq, bk] the mask rule, None: every pair
    s: jax.Array                    # [bq, bk] logits S (online_softmax.logits, then score_mod)
    capped: jax.Array | None        # what softmax.logits returns for the soft cap's gradient
    k: jax.Array                    # [bk, Dp]
    v: jax.Array                    # [bk, Dp], non-finite entries as 0 where a pair may be excluded
    slope: jax.Array | None = None  # [bq, bk] d score_mod / dS (TileMods.score), or None


def key_tile_logits(cfg, layout, query: QueryTile, refs, j, block_k: int,
                    masked, *, finite_kv: bool, page_slot=None, mods=None) -> KeyTile:
    """Key tile ``j`` of the forward and dQ kernels: its loads (masked at the edges), the mask
    rule and the logits. ``refs``: (k, v, kv segment ids, mask, bias, key poison); segment ids,
    mask and bias may be None. ``masked``: the tile's ``TileRules``, or a bool (``TileRules.band``).

    The non-finite rule: every tile adds the per-key poison ``[Lk]`` (NaN where the key's row
    of K or V holds a non-finite value, taken once per call in XLA) to its logits, and the query
    rows' poison came with q (``QueryTile``). ``finite_kv``: k and v are copies with their
    non-finite entries as 0 (the dQ kernel, whose dq = dS k reads k at excluded pairs too);
    else (the forward) a masked tile makes v finite, as P V reads it where P = 0, and k stays as
    loaded (S's excluded entries are replaced).
    ``page_slot``: (page id, first slot) of the page that holds this whole tile (paged decode:
    k, v ``[num_pages, page_size, Dp]``, key poison ``[num_pages, page_size]``); the mask still
    sees logical key positions. ``mods``: the call's ``TileMods`` (score_mod, mask_mod), or None."""
    rules = masked if isinstance(masked, TileRules) else TileRules.band(masked)
    k_ref, v_ref, kv_seg_ref, mask_ref, bias_ref, key_poison_ref = refs
    keys = pl.ds(j * block_k, block_k)
    # Where the tile's K, V and key poison rows lie: logical keys, or slots of one page.
    cache_rows = (keys,) if page_slot is None else (page_slot[0], pl.ds(page_slot[1], block_k))
    key_positions = j * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [bk]
    # An interior tile (structural=False) lies below kv_len <= Lk: no load of it needs a mask.
    key_ok = within(key_positions, layout.lk) if rules.structural else None
    cols = key_positions[None, :]
    pair_tile = lambda ref: None if ref is None else load(ref.at[:, keys], query.ok, key_ok)
    segments = rules.segments and kv_seg_ref is not None
    allowed = masking.allowed(
        cfg.mask, query.rows, cols, query.q_len, query.kv_len,
        query.segment_ids if segments else None,
        load(kv_seg_ref.at[keys], key_ok) if segments else None,
        pair_tile(mask_ref), structural=rules.structural, position_offset=query.offset)
    if mods is not None and rules.mask_mod:
        allowed = masking.all_of([allowed, mods.allowed(query.rows, cols)])
    feature_ok = layout.features_within()
    k, v = (load(ref.at[(*cache_rows, slice(None))], key_ok, feature_ok) for ref in (k_ref, v_ref))  # [bk, Dp]
    if (allowed is not None or mods is not None) and not finite_kv:
        v = online_softmax.finite_or_zero(v)  # a score_mod may exclude pairs too (-inf)
    qk = dot(query.q, k, cfg.precision, trans_b=True)                # [bq, bk]
    key_poison = online_softmax.per_row(load(key_poison_ref.at[cache_rows], key_ok), transposed=True)
    s, capped = online_softmax.logits(qk, cfg, pair_tile(bias_ref), key_poison)
    slope = None
    if mods is not None:
        s, slope = mods.score(s, query.rows, cols)
    return KeyTile(cols, key_ok, allowed, s, capped, k, v, slope)


@dataclasses.dataclass(frozen=True)
class TileOrder:
    """Which tile the program at position ``p`` of the grid's first axis takes: ``p``, or with
    ``heavy_last`` (work grows with the tile index: masking.later_*_tiles_heavier) the tile
    ``num_tiles - 1 - p``, so that the longest programs start first and the short ones fill
    the tail of the launch instead of one long program running alone at its end."""

    num_tiles: int
    heavy_last: bool

    def tile(self, program):
        return self.num_tiles - 1 - program if self.heavy_last else program

    def spec(self, spec):
        """A BlockSpec of the grid (tile, ...) as one of the grid (program, ...); None stays None."""
        if spec is None:
            return None
        if isinstance(spec, tuple):  # the specs of a tuple operand (tile lists, mod_aux)
            return tuple(map(self.spec, spec))
        return pl.BlockSpec(spec.block_shape, lambda p, *rest: spec.index_map(self.tile(p), *rest))


# --- MaskInputs.position_offset (ring attention) ------------------------------------------
# One int32 per batch row, read like q_len/kv_len; absent (None ref) outside a ring, so the
# kernels of an ordinary call are unchanged.

def per_row_spec(offset, batch: int):
    """BlockSpec of the ``[B]`` position offset, or None when there is none."""
    return None if offset is None else pl.BlockSpec((batch,), lambda *_: (0,))


def position_offset(offset_ref, b):
    """Batch row ``b``'s position offset, or None (masking treats None as 0)."""
    return None if offset_ref is None else offset_ref[b]


# --- Sinks and dropout (dropout_sinks.py) ---------------------------------------------------------
# Both arrive as whole [Bs, Hs] arrays (Bs in {1, B}, Hs in {1, Hq}); a kernel reads its one
# scalar per (batch, head).

def per_head_spec(x):
    return None if x is None else pl.BlockSpec(x.shape, lambda *_: (0, 0))


def dropout_offset_spec(x):
    """BlockSpec of the ring's ``[2]`` dropout offset, or None when there is none."""
    return None if x is None else pl.BlockSpec((2,), lambda *_: (0,))


def dropout_keep(cfg, seed, rows, cols, offset_ref=None):
    """The keep mask of absolute query indices ``rows`` x key indices ``cols`` ([bq, 1] x [1, bk],
    or [1, bq] x [bk, 1] for a transposed tile: the same hash, so the same pattern), or None
    without dropout. ``offset_ref``: the ring's [2] global (query, key) index of local (0, 0),
    added before hashing, so that each ring step draws its slice of the one-device pattern."""
    if not cfg.dropout_rate:
        return None
    if offset_ref is not None:
        rows, cols = rows + offset_ref[0], cols + offset_ref[1]
    return dropout_sinks.keep(seed, rows, cols, cfg.dropout_rate)


# --- Block-sparse tiles (block_mask.py) -----------------------------------------------------
# With segment ids or a block_mask, block_mask.tile_classes says per tile of a kernel's grid
# whether it is empty (skipped), partial (every mask rule evaluated) or full (none: rules 1-4
# hold for every pair and the tile lies inside Lq and Lk). The wrapper turns the classes into
# FlexAttention's index lists; a program reads its row of them (int32 refs in global memory,
# [Bc, Hc, ...] with Bc, Hc broadcast) and loops over the partial tiles, then the full ones.
# Without them (None) the kernels walk the band (masking.kv_block_split) as before.


def tile_lists_spec(lists):
    """BlockSpecs of ``tile_lists`` (whole arrays: a program reads a few scalars), or None."""
    return None if lists is None else tuple(
        pl.BlockSpec(x.shape, lambda *_, n=x.ndim: (0,) * n) for x in lists)


def visit_tiles(lists_refs, band, b, h, tile, body, carry):
    """Run ``body(index, carry, rules)`` over the tiles program ``(tile, b, h)`` visits: from the
    tile lists when there are any (``rules``: PARTIAL_TILE, then FULL_TILE), else over the
    band (``(lo, full_lo, full_hi, hi)``, computed by the kernel only when ``lists_refs`` is None:
    masking.split_fori_loop)."""
    if lists_refs is None:
        return masking.split_fori_loop(band, lambda i, c, masked: body(i, c, TileRules.band(masked)),
                                       carry)
    counts, indices, full_counts, full_indices = lists_refs
    for count_ref, index_ref, rules in ((counts, indices, PARTIAL_TILE),
                                        (full_counts, full_indices, FULL_TILE)):
        row = (broadcast_index(count_ref, 0, b), broadcast_index(count_ref, 1, h), tile)
        carry = lax.fori_loop(0, count_ref[row], lambda t, c, index_ref=index_ref, row=row,
                              rules=rules: body(index_ref[(*row, t)], c, rules), carry)
    return carry


# --- score_mod and mask_mod (mods.py) ---------------------------------------------------------
# The mods are traced into the kernels on each tile, with the tile's b, h (the global query
# head), q_idx and kv_idx (int32, [bq, 1] and [1, bk], or transposed in dK/dV) and its final
# logits. The mod_aux arrays arrive as whole refs; the mods read them through ModAux, whose
# indexing is a gather load.

def mod_aux_specs(aux):
    """BlockSpecs of the mod_aux operands: whole arrays (the mods gather from them)."""
    return tuple(pl.BlockSpec(x.shape, lambda *_, n=x.ndim: (0,) * n) for x in aux)


def logits_gradient(p, dp, delta, capped, cfg, slope, *, transposed: bool = False,
                    exclusions: bool = False):
    """online_softmax.logits_gradient, unscaled, through score_mod: ``slope`` its elementwise
    derivative (TileMods.score), or None without one. Where P = 0 the slope may be NaN (a
    poisoned logit): the exclusions' select makes dS 0 there."""
    return online_softmax.logits_gradient(
        p, dp, delta, capped, cfg, scaled=False, transposed=transposed,
        exclusions=exclusions or slope is not None,
        score_vjp=None if slope is None else (lambda ds: ds * slope))


def compiler_params(num_warps: int, num_stages: int):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# The Triton kernels exist only for CUDA (platform.requires_cuda refuses other lowerings).
PLATFORM_ERROR = (
    "implementation='pallas_triton' runs only on a CUDA GPU (the call is being lowered for "
    "{platform!r}). Use implementation='xla' (linear memory on any device), "
    "implementation=None to choose automatically, or interpret=True to run the kernel in "
    "the Pallas interpreter.")
