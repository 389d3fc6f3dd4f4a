"""Pieces every kernel uses: the dot, the key tile's logits, block indices of broadcast operands."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_impl import dropout_sinks, masking, online_softmax
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
    s: jax.Array                    # [bq, bk] logits S (online_softmax.logits)
    capped: jax.Array | None        # what softmax.logits returns for the soft cap's gradient
    k: jax.Array                    # [bk, Dp]
    v: jax.Array                    # [bk, Dp], non-finite entries as 0 where a pair may be excluded


def key_tile_logits(cfg, layout, query: QueryTile, refs, j, block_k: int,
                    masked: bool, *, finite_kv: bool, page_slot=None) -> KeyTile:
    """Key tile ``j`` of the forward and dQ kernels: its loads (masked at the edges), the mask
    rule and the logits. ``refs``: (k, v, kv segment ids, mask, bias, key poison); segment ids,
    mask and bias may be None.

    The non-finite rule: every tile adds the per-key poison ``[Lk]`` (NaN where the key's row
    of K or V holds a non-finite value, taken once per call in XLA) to its logits, and the query
    rows' poison came with q (``QueryTile``). ``finite_kv``: k and v are copies with their
    non-finite entries as 0 (the dQ kernel, whose dq = dS k reads k at excluded pairs too);
    else (the forward) a masked tile makes v finite, as P V reads it where P = 0, and k stays as
    loaded (S's excluded entries are replaced).
    ``page_slot``: (page id, first slot) of the page that holds this whole tile (paged decode:
    k, v ``[num_pages, page_size, Dp]``, key poison ``[num_pages, page_size]``); the mask still
    sees logical key positions."""
    k_ref, v_ref, kv_seg_ref, mask_ref, bias_ref, key_poison_ref = refs
    keys = pl.ds(j * block_k, block_k)
    # Where the tile's K, V and key poison rows lie: logical keys, or slots of one page.
    cache_rows = (keys,) if page_slot is None else (page_slot[0], pl.ds(page_slot[1], block_k))
    key_positions = j * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [bk]
    # An interior tile (masked=False) lies below kv_len <= Lk: no load of it needs a mask.
    key_ok = within(key_positions, layout.lk) if masked else None
    cols = key_positions[None, :]
    pair_tile = lambda ref: None if ref is None else load(ref.at[:, keys], query.ok, key_ok)
    allowed = masking.allowed(
        cfg.mask, query.rows, cols, query.q_len, query.kv_len, query.segment_ids,
        None if kv_seg_ref is None else load(kv_seg_ref.at[keys], key_ok),
        pair_tile(mask_ref), structural=masked, position_offset=query.offset)
    feature_ok = layout.features_within()
    k, v = (load(ref.at[(*cache_rows, slice(None))], key_ok, feature_ok) for ref in (k_ref, v_ref))  # [bk, Dp]
    if allowed is not None and not finite_kv:
        v = online_softmax.finite_or_zero(v)
    qk = dot(query.q, k, cfg.precision, trans_b=True)                # [bq, bk]
    key_poison = online_softmax.per_row(load(key_poison_ref.at[cache_rows], key_ok), transposed=True)
    s, capped = online_softmax.logits(qk, cfg, pair_tile(bias_ref), key_poison)
    return KeyTile(cols, key_ok, allowed, s, capped, k, v)


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
        return pl.BlockSpec(spec.block_shape, lambda p, *rest: spec.index_map(self.tile(p), *rest))


def broadcast_index(x, axis: int, index):
    """Block index along a mask/bias axis that may be broadcast (size 1): then always 0."""
    return index if x.shape[axis] > 1 else 0


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


def per_head(ref, b, h):
    """The entry of (batch b, query head h) of a [Bs, Hs] sinks/seeds ref, or None."""
    if ref is None:
        return None
    return ref[broadcast_index(ref, 0, b), broadcast_index(ref, 1, h)]


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


def compiler_params(num_warps: int, num_stages: int):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# The Triton kernels exist only for CUDA (platform.requires_cuda refuses other lowerings).
PLATFORM_ERROR = (
    "implementation='pallas_triton' runs only on a CUDA GPU (the call is being lowered for "
    "{platform!r}). Use implementation='xla' (linear memory on any device), "
    "implementation=None to choose automatically, or interpret=True to run the kernel in "
    "the Pallas interpreter.")
