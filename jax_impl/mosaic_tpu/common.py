"""What every Mosaic TPU kernel of this package does on one (query tile, key tile) pair: the
tile's positions, its mask rule, its logits, the lane-broadcast online softmax, and the tile
lists that the grid's key axis reads through scalar prefetch.

Layout inside the kernels: q ``[B, Hq, Lq_pad, D_pad]``, k/v ``[B, Hkv, Lk_pad, D_pad]``; a
tile is ``[bq, bk]`` float32 with queries on sublanes and keys on lanes, or with
``transposed=True`` (a dK/dV kernel's S^T) ``[bk, bq]`` with keys on sublanes. Per-row state
(m, l) is kept lane-broadcast ``[rows, NUM_LANES]`` (one vreg column per row either way, and
the rescales become plain elementwise ops).

The logits are natural-log, as every backend's (``online_softmax.logits``: S = softcap(scale *
q.k) + bias, then score_mod): a kernel may recompute them bit for bit from the RowStats
(natural max and log-sum) the forward writes. The non-finite rule: the forward poisons q's
rows in VMEM, and K's and V's tiles when a flag says they hold a non-finite value
(forward.py); the backward adds each tile's poison (backward.py). The mask's select keeps a
NaN only at the allowed pairs.

Padding: Lq, Lk are padded to whole tiles and D to the lanes; the spec the kernels receive has
``masking.with_padding`` applied, so the padded positions fail rule 1 (lengths) on the tiles
that hold them (which ``tile_classes`` never calls FULL).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_impl import block_mask, masking, mods, online_softmax
from jax_impl.kernel_tiles import (  # noqa: F401  (the kernels read them as common.X)
    FULL_TILE, PARTIAL_TILE, TileRules, per_head)
from jax_impl.config import AttentionConfig

NUM_LANES = 128


def tile_inside(block: int, length: int, mask_tile: int | None) -> int | None:
    """The kernel's tile along one axis: ``block`` at most the sequence rounded up to the lanes,
    or with a block_mask of ``mask_tile`` the largest such multiple of 128 that divides it (its
    tiles then carry over exactly: the kernels evaluate no block_mask pair by pair); None where
    there is none."""
    block = min(block, round_up(length, NUM_LANES))
    if mask_tile is None:
        return block
    fits = [b for b in range(NUM_LANES, block + 1, NUM_LANES) if mask_tile % b == 0]
    return max(fits) if fits else None


def mask_tiles(masks) -> tuple[int, int] | None:
    """The (block_q, block_kv) of the call's block_mask, or None."""
    tiles = masks.block_mask
    return None if tiles is None else (tiles.block_q, tiles.block_kv)


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


# --- Positions and the mask rule of one tile ---------------------------------------------------

class TilePositions(NamedTuple):
    """The global query and key positions of a tile, int32, each the tile's full shape
    (``[bq, bk]``, or ``[bk, bq]`` when transposed): what the mask rules and the mods read."""

    rows: jax.Array   # query positions
    cols: jax.Array   # key positions

    @classmethod
    def create(cls, q_tile, kv_tile, block_q: int, block_k: int, *,
               transposed: bool = False) -> "TilePositions":
        """Positions of query tile ``q_tile`` x key tile ``kv_tile`` (traced ints: the key
        tile is the global index read from the tile list, never the grid's step)."""
        shape = (block_k, block_q) if transposed else (block_q, block_k)
        q_axis, k_axis = (1, 0) if transposed else (0, 1)
        rows = q_tile * block_q + lax.broadcasted_iota(jnp.int32, shape, q_axis)
        cols = kv_tile * block_k + lax.broadcasted_iota(jnp.int32, shape, k_axis)
        return cls(rows, cols)


def tile_allowed(cfg: AttentionConfig, pos: TilePositions, rules: TileRules, *, b, h, q_len,
                 kv_len, position_offset=None, q_segment_ids=None, kv_segment_ids=None,
                 mask_tile=None, mod_aux=()):
    """The pairs of a tile that may attend (bool, the tile's shape), or None for all.

    ``cfg.mask`` must already carry ``masking.with_padding`` for the padded sequences.
    ``q_segment_ids``/``kv_segment_ids``: the tile's ids shaped to broadcast against it
    (``[bq, 1]`` and ``[1, bk]``, or transposed ``[1, bq]`` and ``[bk, 1]``), or None.
    ``mask_tile``: the dense mask's tile (int8 or bool, the tile's shape), or None. ``b`` and
    ``h`` (the global query head) are what a mask_mod receives."""
    conditions = []
    if rules.structural:
        conditions.append(masking.structural_allowed(cfg.mask, pos.rows, pos.cols, q_len, kv_len,
                                                     position_offset))
    if rules.segments and q_segment_ids is not None:
        conditions.append(q_segment_ids == kv_segment_ids)
    if rules.mask_mod and cfg.mask_mod is not None:
        conditions.append(jnp.broadcast_to(
            mods.allowed(cfg, b, h, pos.rows, pos.cols, mod_aux), pos.rows.shape))
    if mask_tile is not None:
        conditions.append(mask_tile if mask_tile.dtype == jnp.bool_ else mask_tile != 0)
    return masking.all_of(conditions)


# --- Products and logits ----------------------------------------------------------------------

def mxu_precision(cfg: AttentionConfig, dtype):
    """The ``precision=`` of the kernels' dots. 16-bit operands: None (one native MXU pass,
    float32 accumulation). float32 operands: ``cfg.precision`` where Mosaic honours it, DEFAULT
    (one bf16 pass: the inputs rounded to bf16) or HIGHEST (a multi-pass fp32 emulation, ~5x
    the MXU time); ``precision_unsupported`` refuses the others before a kernel is built."""
    if jnp.dtype(dtype) != jnp.float32:
        return None
    return lax.Precision.HIGHEST if cfg.precision == lax.Precision.HIGHEST else lax.Precision.DEFAULT


def precision_unsupported(cfg: AttentionConfig, dtype) -> str | None:
    """Why the Mosaic TPU dots cannot honour ``cfg.precision`` for float32 operands, or None:
    Pallas TPU (jax 0.10) lowers only DEFAULT and HIGHEST."""
    if dtype is None or jnp.dtype(dtype) != jnp.float32:
        return None
    if cfg.precision in (lax.Precision.DEFAULT, lax.Precision.HIGHEST):
        return None
    name = getattr(cfg.precision, "name", cfg.precision)
    return (f"precision={name} with float32 inputs: Pallas TPU's dots take only DEFAULT (one bf16 "
            "pass) or HIGHEST (fp32 emulation)")


def dot_nt(a, b, precision):
    """a @ b^T with float32 accumulation (contracting the last axis of both)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def dot_nn(a, b, precision):
    """a @ b with float32 accumulation."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def dot_tn(a, b, precision):
    """a^T @ b with float32 accumulation (contracting the first axis of both)."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def tile_logits(cfg: AttentionConfig, qk, pos: TilePositions, *, b, h, bias_tile=None, mod_aux=(),
                score_gradient: bool = False):
    """The final logits of a tile from its raw product ``qk`` (float32, the tile's shape):
    ``online_softmax.logits`` (scale, soft cap, bias) then ``cfg.score_mod`` with the tile's
    global positions. Returns (S, the soft cap's tanh term or None, d score_mod / dS or None;
    the derivative only with ``score_gradient``, for the backward)."""
    s, capped = online_softmax.logits(qk, cfg, bias_tile)
    if cfg.score_mod is None:
        return s, capped, None
    apply = lambda s: mods.score(cfg, s, b, h, pos.rows, pos.cols, mod_aux)
    if not score_gradient:
        return apply(s), capped, None
    s, slope = jax.jvp(apply, (s,), (jnp.ones_like(s),))
    return s, capped, slope


# --- The lane-broadcast online softmax -------------------------------------------------------

def lanes(x, width: int):
    """A lane-broadcast ``[rows, NUM_LANES]`` per-row value as ``[rows, width]`` (width a
    multiple of NUM_LANES, or below it)."""
    if width <= NUM_LANES:
        return x[:, :width]
    return jnp.tile(x, (1, width // NUM_LANES))


def online_step(row_max, row_sum, s, allowed, unit: float = 1.0):
    """``online_softmax.online_step`` for lane-broadcast state: fold the tile S ``[bq, bk]``
    (bk a multiple of NUM_LANES) into (m, l) ``[bq, NUM_LANES]``. Rows that have seen no
    allowed finite logit keep m = -inf and use 0 as the reference (no inf - inf; P exactly 0).
    ``unit``: s and m hold S / unit (plain logits as q.k: the scale folds into exp2's
    multiply, one multiply fewer per logit). Returns (rescale ``[bq, NUM_LANES]``, P, new m,
    new l)."""
    exp = lambda x: jnp.exp2(x * (unit * online_softmax.LOG2_E))
    if allowed is not None:
        s = jnp.where(allowed, s, -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(s, axis=-1, keepdims=True))   # [bq, 128]
    safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    rescale = exp(row_max - safe_max)
    p = exp(s - lanes(safe_max, s.shape[-1]))
    new_sum = rescale * row_sum + jnp.sum(p, axis=-1, keepdims=True)
    return rescale, p, new_max, new_sum


def initial_stats(rows: int, sink=None):
    """(m, l) ``[rows, NUM_LANES]`` before any key: (-inf, 0), or (sink, 1) with a sink
    (``dropout_sinks.initial_stats``; a -inf sink is no sink)."""
    shape = (rows, NUM_LANES)
    if sink is None:
        return jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32)
    sink = jnp.full(shape, sink, jnp.float32)
    return sink, jnp.where(sink > -jnp.inf, 1.0, 0.0).astype(jnp.float32)


def finalize(acc, row_max, row_sum):
    """``online_softmax.finalize`` for lane-broadcast state: (O = acc / l ``[bq, D]``, max,
    log_sum ``[bq, NUM_LANES]``); an empty row (l = 0) gives O = 0, max = +inf, log_sum = 0."""
    empty = row_sum == 0
    safe_sum = jnp.where(empty, 1.0, row_sum)
    out = acc * lanes(1.0 / safe_sum, acc.shape[-1])
    return out, jnp.where(empty, jnp.inf, row_max), jnp.log(safe_sum)


def recomputed_probs(s, row_max, log_sum, allowed):
    """Backward: P = exp(S - max - log_sum) for a ``[bq, bk]`` tile from lane-broadcast
    RowStats ``[bq, NUM_LANES]`` (``online_softmax.recomputed_probs``), exactly 0 where not
    ``allowed``."""
    width = s.shape[-1]
    shifted = (s - lanes(row_max, width)) - lanes(log_sum, width)
    if allowed is not None:
        shifted = jnp.where(allowed, shifted, -jnp.inf)
    return jnp.exp(shifted)


# --- Tile lists (scalar prefetch) ---------------------------------------------------------------
# block_mask.tile_classes gives per tile of the grid EMPTY, PARTIAL or FULL. A kernel's grid
# walks, per (batch row, head, query tile), only the non-empty key tiles: the grid's key axis
# has ``steps`` entries (a static bound on the non-empty count, ``static_steps``); the index
# maps read the list, entries past the count repeat the last index (no new DMA), and the
# kernel skips their compute under pl.when. The lists are flat int32 arrays (SMEM pads a
# 2-D array's last axis to 128 words).

class TileLists(NamedTuple):
    counts: jax.Array    # [Bc * Hc * n_rows] non-empty tiles per row
    indices: jax.Array   # [Bc * Hc * n_rows * steps] their indices ascending, then padding
    full: jax.Array      # [Bc * Hc * n_rows * steps] 1 where that tile is FULL, else 0
    batch: int           # Bc: 1 (the same for every batch row) or B
    heads: int           # Hc: 1 or Hq
    rows: int            # tiles along the kept axis (query tiles; key tiles when transposed)
    steps: int           # the grid's walking axis

    def row(self, b, h, i):
        """The flat row index of (batch b, query head h, tile i), broadcast axes read at 0."""
        b = b if self.batch > 1 else 0
        h = h if self.heads > 1 else 0
        return (b * self.heads + h) * self.rows + i

    def entry(self, b, h, i, step):
        return self.row(b, h, i) * self.steps + step

    def operands(self):
        return self.counts, self.indices, self.full

    # The schedule's reads, shared with IndexSchedule: ``refs`` are the three lists' scalar
    # prefetch refs (``operands()``'s order).
    num_operands = 3

    def count(self, refs, b, h, i):
        return refs[0][self.row(b, h, i)]

    def kv_tile(self, refs, b, h, i, step):
        return refs[1][self.entry(b, h, i, step)]

    def visited(self, refs, b, h, i, step):
        return step < self.count(refs, b, h, i)

    visited_tile = kv_tile  # the tile a visited step reads

    def is_full(self, refs, b, h, i, step):
        return refs[2][self.entry(b, h, i, step)] != 0


class IndexSchedule(NamedTuple):
    """The forward's key axis as index arithmetic on (query tile, step) instead of scalar
    prefetched lists: the same tiles in the same order as ``tile_lists``, for calls whose
    tiles follow from static values alone (``index_schedule_unsupported``). The forward takes
    it wherever it can (forward.schedule_of): the same grid, copies and compute as the lists,
    and no list built in XLA or prefetched."""

    d_hi: int | None     # the causal band's bound (key - query <= d_hi), None: whole rows
    block_q: int
    block_k: int
    q_len: int
    kv_len: int
    steps: int

    num_operands = 0

    @property
    def kv_tiles(self) -> int:
        return -(-self.kv_len // self.block_k)

    def count(self, refs, b, h, i):
        if self.d_hi is None:
            return self.kv_tiles  # static: every step is visited
        last_key = jnp.minimum((i + 1) * self.block_q, self.q_len) - 1 + self.d_hi
        tiles = lax.div(jnp.maximum(last_key, -1) + self.block_k, self.block_k)
        return jnp.minimum(tiles, self.kv_tiles)

    def kv_tile(self, refs, b, h, i, step):
        return jnp.minimum(step, jnp.maximum(self.count(refs, b, h, i) - 1, 0))

    def visited(self, refs, b, h, i, step):
        """``step < count`` without a division (a compare on the scalar unit): a static True for
        whole rows, else whether the step's first key is within the band of the tile's last
        query."""
        if self.d_hi is None:
            return True
        last_query = jnp.minimum((i + 1) * self.block_q, self.q_len) - 1
        return (step * self.block_k <= last_query + self.d_hi) & (step < self.kv_tiles)

    def visited_tile(self, refs, b, h, i, step):
        return step  # a visited step reads tile ``step``

    def is_full(self, refs, b, h, i, step):
        """Whether visited step ``step`` is FULL: a static True for whole rows of whole tiles."""
        ragged_q, ragged_k = self.q_len % self.block_q, self.kv_len % self.block_k
        if self.d_hi is None and not ragged_q and not ragged_k:
            return True
        j = step
        whole = ((i + 1) * self.block_q <= self.q_len) & ((j + 1) * self.block_k <= self.kv_len)
        if self.d_hi is None:
            return whole
        return whole & ((j + 1) * self.block_k - 1 <= i * self.block_q + self.d_hi)


def index_schedule_unsupported(cfg: AttentionConfig, masks: masking.MaskInputs) -> str | None:
    """Why the tiles of this call cannot be computed from static values (``IndexSchedule``):
    anything but full rows or a plain causal band with full lengths."""
    spec = cfg.mask
    reasons = [name for name, present in (
        ("a window", spec.window_left is not None or spec.window_right is not None),
        ("sequence lengths", spec.has_q_lengths or spec.has_kv_lengths),
        ("a block_mask", spec.has_block_mask or masks.block_mask is not None),
        ("segment ids", masks.q_segment_ids is not None),
        ("a position offset", masks.position_offset is not None),
        ("a mask_mod", cfg.mask_mod is not None)) if present]
    return None if not reasons else ("the index schedule takes full rows or a plain causal band; "
                                     "this call has " + ", ".join(reasons))


def index_schedule(cfg: AttentionConfig, masks: masking.MaskInputs, q_len: int, kv_len: int,
                   block_q: int, block_k: int) -> IndexSchedule:
    reason = index_schedule_unsupported(cfg, masks)
    if reason:
        raise ValueError(f"schedule='index': {reason}")
    d_hi = ((kv_len - q_len) if cfg.mask.bottom_right else 0) if cfg.mask.is_causal else None
    steps = static_steps(cfg.mask, masks, q_len, kv_len, block_q, block_k)
    return IndexSchedule(d_hi, block_q, block_k, q_len, kv_len, steps)


def static_steps(spec: masking.MaskSpec, masks: masking.MaskInputs, q_len: int, kv_len: int,
                 block_q: int, block_k: int, *, transposed: bool = False) -> int:
    """A bound, known at trace time, on the non-empty tiles of any row of the grid: the band's
    own count, from the static spec with full lengths (lengths, segment ids, a block_mask and a
    mask_mod only remove tiles). Where the band moves with traced values (a position offset;
    the bottom-right alignment with lengths) it is every tile of the row."""
    n_cols = -(-q_len // block_q) if transposed else -(-kv_len // block_k)  # the walked axis
    if not spec.has_band:
        return n_cols
    moves = masks.position_offset is not None or (
        spec.bottom_right and (spec.has_q_lengths or spec.has_kv_lengths))
    if moves:
        return n_cols
    # numpy on Python ints: no JAX computation runs here (under ``jax.sharding.set_mesh`` one
    # would be placed on the mesh's devices, which may be compile-only).
    offset = kv_len - q_len if spec.bottom_right else 0
    highs = ([offset] if spec.is_causal else []) + (
        [offset + spec.window_right] if spec.window_right is not None else [])
    d_hi = min(highs) if highs else None
    d_lo = offset - spec.window_left if spec.window_left is not None else None
    q_first = np.arange(0, q_len, block_q)[:, None]
    q_last = np.minimum(q_first + block_q, q_len) - 1
    k_first = np.arange(0, kv_len, block_k)[None, :]
    k_last = np.minimum(k_first + block_k, kv_len) - 1
    nonempty = np.ones((q_first.size, k_first.size), bool)  # some k - q in [d_lo, d_hi]
    if d_hi is not None:
        nonempty &= k_first - q_last <= d_hi
    if d_lo is not None:
        nonempty &= k_last - q_first >= d_lo
    return max(1, int(nonempty.sum(axis=0 if transposed else 1).max()))


def tile_lists(cfg: AttentionConfig, masks: masking.MaskInputs, q_len: int, kv_len: int,
               block_q: int, block_k: int, *, transposed: bool = False) -> TileLists:
    """The non-empty tiles of every row of the grid (``block_mask.tile_classes`` on the
    kernel's own tiles, band included), per query tile, or with ``transposed`` per key tile
    (a dK/dV kernel). ``cfg.mask`` is the call's spec (without the padding rule: the classes
    account for ragged tiles themselves)."""
    classes = block_mask.tile_classes(cfg.mask, masks, q_len, kv_len, block_q, block_k,
                                      mask_mod=cfg.mask_mod is not None, band_only=True)
    if transposed:
        classes = jnp.swapaxes(classes, -1, -2)
    steps = static_steps(cfg.mask, masks, q_len, kv_len, block_q, block_k, transposed=transposed)
    counts, indices = block_mask.index_lists(classes != block_mask.EMPTY)
    full = jnp.take_along_axis(classes, indices, axis=-1) == block_mask.FULL
    batch, heads, rows = classes.shape[:3]
    flat = lambda x: x[..., :steps].astype(jnp.int32).reshape(-1)
    return TileLists(counts.reshape(-1), flat(indices), flat(full), batch, heads, rows, steps)


def cost_estimate(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, *,
                  matmuls: int, exps: int, bytes_accessed: int, causal: bool):
    """A ``pl.CostEstimate`` of ``matmuls`` [Lq, Lk, D] products and ``exps`` exponentials
    per pair, halved for a causal band (what the tile lists visit, roughly)."""
    from jax.experimental import pallas as pl
    pairs = batch * heads * q_len * kv_len * (0.5 if causal else 1.0)
    return pl.CostEstimate(flops=int(2 * matmuls * pairs * head_dim),
                           transcendentals=int(exps * pairs), bytes_accessed=int(bytes_accessed))


__all__ = ["NUM_LANES", "TilePositions", "TileRules", "PARTIAL_TILE", "FULL_TILE", "tile_allowed",
           "mxu_precision", "precision_unsupported", "dot_nt", "dot_nn", "dot_tn", "tile_logits",
           "lanes", "online_step", "initial_stats", "per_head", "finalize", "recomputed_probs", "TileLists",
           "IndexSchedule", "index_schedule", "index_schedule_unsupported",
           "static_steps", "tile_lists", "cost_estimate", "round_up"]
