"""The forward kernel: FlashAttention-3's warp-specialised design in Pallas Mosaic GPU (sm_90a).

One CTA per work item (or, persistent, per SM walking the items: scheduler.py) runs three
warpgroups:

- the *memory* warpgroup (``_producer``) issues TMA copies of the K and V tiles that the mask
  structure allows (``masking.kv_block_range`` of the CTA's ``2 * block_q`` rows) into a ring
  of ``num_stages`` shared-memory stages, each guarded by a *produced* mbarrier (the TMA
  arrives on it) and a *consumed* one (both consumers arrive on it); it gives up registers
  (``set_max_registers`` down to 24);
- two *compute* warpgroups (``_consumer``) each own ``block_q`` query rows: Q by TMA into
  shared memory, S = Q K^T and O += P V on the tensor cores (``wgmma``, fp32 accumulators in
  registers, up to 240 per thread), the online softmax in base 2, the row max subtracted
  first (``online_softmax.online_step``). Their GEMMs ping-pong: a *schedule* mbarrier that both
  arrive on lets one warpgroup's softmax run under the other's GEMMs (warpgroup 1 starts one
  phase late, warpgroup 0 catches up at the end);
- the *epilogue* (``_store``) of each consumer writes O through the shared memory that held
  its Q, and the natural-log row statistics (``RowStats``), with TMA stores.

Producer and consumers walk one ``TileWalk`` (tile_walk.py): the CTA's band, or with segment
ids, a ``block_mask`` or a mod its tile lists (the partial tiles, then the full ones). The
producer loads each tile once for both consumers; a consumer walks the band in up to five
stretches (``masking.kv_block_split`` of its own rows): tiles outside its own range only keep
the ring and the schedule in step (``_pass_tile``), tiles at the band's edges apply the
structural mask rule (as two key bounds per row: ``masking.key_bounds_per_row``), the tiles
inside it apply none (segment ids and a dense mask, when given, apply on every tile: the key
tile's ids come by TMA with K into a ring of their own and are read from shared memory where
they are compared; dropout, when asked, drops P after its row sum by the library's hash:
``_Dropout``). A consumer's state is explicit: ``_Warpgroup`` (what it holds for every item),
``_ItemRows`` (for one item's rows) and ``_Carry`` (from tile to tile); each tile step is a
function of them. The attended tiles are pipelined (FA3's intra-warpgroup overlap,
``_next_tile`` over ``_pipelined_gemms``): tile j's S = Q K^T is issued with tile j-1's P V,
and tile j's softmax (``_tile_softmax``) runs while that P V is still on the tensor cores; the
first attended tile is the prologue (``_first_tile``: no P V yet), an epilogue (``_last_tile``)
adds the last P V. With ``Config.overlap=False`` (head_dim 256: O's accumulator takes half the
registers) each tile's P V is waited before the next S (``_sequential_tile``).
A bias and a dense mask (``_Pairwise``) come through the ring with K: the memory warpgroup
copies the CTA's ``[2 * block_q, block_kv]`` tile of each by TMA into a stage of their own ring
(one *produced* barrier for both, one *consumed* barrier that the consumers arrive on once their
softmax has read it), and each consumer reads its ``block_q`` rows in the WGMMA layout of S.
The mask travels as int8 (TMA moves no 1-bit elements: XLA converts it once per call).
Edges: a last query or key tile may run past Lq or Lk; TMA loads there read zeros and stores are
clipped by the hardware, and ``masking.with_padding`` switches on the length rule, so no operand
is padded and no shape needs to divide by a tile.

Every ring slot's barriers are waited once per use by every warpgroup that reads it: Mosaic GPU
tracks each mbarrier's phase per thread, so the tile counter ``step`` (which selects the slot)
runs on across the work items of a persistent CTA.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_impl import dropout_sinks, masking, online_softmax, vma
from jax_impl.config import AttentionConfig
from jax_impl.kernel_tiles import (ModAux, TileMods, TileRules, kernel_mod_aux, mod_aux_operand,
                                   mod_aux_types, tile_lists)
from jax_impl.mosaic_gpu.config import CONSUMER_REGISTERS, CONSUMERS, PRODUCER_REGISTERS, Config
from jax_impl.mosaic_gpu.scheduler import WorkOrder
from jax_impl.mosaic_gpu.tile_walk import TileWalk, band_bounds

_ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per query row of a WGMMA tile
_COLUMN = plgpu.Layout.WGMMA.reduce(0)  # one value per key column of a WGMMA tile
_MEMORY_WARPGROUP = CONSUMERS        # warpgroups 0 and 1 compute, 2 loads


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The static shape of one call."""

    batch: int
    lq: int
    lk: int
    heads: int      # query heads
    kv_heads: int
    head_dim: int
    dtype: jnp.dtype
    config: Config
    bias_dtype: object = None  # the bias's dtype, or None: no bias
    has_mask: bool = False
    has_segments: bool = False
    # Rows per query position: G where a kv head's G query heads are packed into the rows
    # (row r is query r // G of head r % G of the group: ``_packed``), else 1.
    group_rows: int = 1
    mod_aux_types: tuple = ()  # (dtype, shape) of each mod_aux entry (common.mod_aux_types)

    @property
    def rows_per_cta(self) -> int:
        return self.config.rows_per_cta

    def positions(self, first_row, num_rows: int):
        """(first query position, number of positions) of rows ``[first_row, + num_rows)``."""
        g = self.group_rows
        if g == 1:
            return first_row, num_rows
        first = lax.div(first_row, g)
        return first, lax.div(first_row + num_rows - 1, g) - first + 1

    @property
    def num_pairs(self) -> int:
        return -(-self.lq // self.rows_per_cta)

    @property
    def lq_stats(self) -> int:
        """Lq rounded up to whole CTAs: the row statistics are written in whole tiles (a TMA
        global stride must be a multiple of 16 bytes) and sliced back to Lq by XLA."""
        return self.num_pairs * self.rows_per_cta


def _scratch(geometry: Geometry):
    """Shared memory and mbarriers of one CTA, shared by its three warpgroups."""
    c, d, dtype = geometry.config, geometry.head_dim, geometry.dtype
    swizzled = lambda shape: plgpu.SMEM(shape, dtype, transforms=(
        plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    tiles = (swizzled((CONSUMERS, c.block_q, d)),              # Q, then O
             swizzled((c.num_stages, c.block_kv, d)),          # K ring
             swizzled((c.num_stages, c.block_kv, d)),          # V ring
             plgpu.SMEM((CONSUMERS, c.block_q), jnp.float32),  # row max
             plgpu.SMEM((CONSUMERS, c.block_q), jnp.float32))  # row log-sum
    barriers = (plgpu.Barrier(num_barriers=CONSUMERS),                          # Q loaded
                # K produced: with segment ids the key tile's ids arrive on it too
                plgpu.Barrier(num_arrivals=1 + geometry.has_segments, num_barriers=c.num_stages),
                plgpu.Barrier(num_barriers=c.num_stages),                       # V produced
                plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=c.num_stages),  # K consumed
                plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=c.num_stages),  # V consumed
                plgpu.Barrier(num_arrivals=CONSUMERS))                          # schedule
    # The bias and mask rings (plain row-major tiles: the consumers read them into the WGMMA
    # layout), one TMA arrival per operand on the produced barrier.
    rings = [plgpu.SMEM((c.num_stages, geometry.rows_per_cta, c.block_kv), dt) for dt in
             (geometry.bias_dtype, jnp.int8 if geometry.has_mask else None) if dt is not None]
    if rings:
        tiles += tuple(rings)
        barriers += (plgpu.Barrier(num_arrivals=len(rings), num_barriers=c.num_stages),
                     plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=c.num_stages))
    if geometry.has_segments:  # the key tiles' ids, a ring beside K's (read before its release)
        tiles += (plgpu.SMEM((c.num_stages, c.block_kv), jnp.int32),)
    return tiles, barriers


def pairwise_source(src, b, head, rows, cols):
    """Tile ``(rows, cols)`` of a bias or mask ``[Bx, Hx, Lq, Lk]`` (or its transpose) for batch
    row ``b`` and query head ``head``: its batch and head axes may be broadcast (size 1)."""
    return src.at[0 if src.shape[0] == 1 else b, 0 if src.shape[1] == 1 else head, rows, cols]


def pairwise_tiles(rings, slot, rows, has_bias: bool, has_mask: bool):
    """A warpgroup's ``rows`` of the bias and mask tiles in ring stage ``slot`` (the bias's ring
    first), in the WGMMA layout of the logits: (bias or None, the mask as bool or None)."""
    loaded = [plgpu.load(ring.at[slot, rows], layout=plgpu.Layout.WGMMA, optimized=False)
              for ring in rings]
    bias = loaded.pop(0) if has_bias else None
    mask = loaded.pop(0) != 0 if has_mask else None
    return bias, mask


class _Pairwise:
    """The bias and the dense mask of a call (either may be absent), streamed by key tile
    through a ring beside K and V. Each stage holds the CTA's ``[2 * block_q, block_kv]`` tile
    of each operand; every warpgroup waits and releases every stage once per use (``pass_``
    too), so that the mbarriers' phases stay in step."""

    def __init__(self, refs, smem, barriers):
        self.gmem = [x for x in (refs.bias, refs.mask) if x is not None]
        self.has_bias, self.has_mask = refs.bias is not None, refs.mask is not None
        self.rings = smem[5:5 + len(self.gmem)]
        self.produced, self.consumed = barriers[6:] if self.gmem else (None, None)

    def load(self, b, head, rows, keys, slot, step, num_stages: int):
        """The memory warpgroup: tile (rows, keys) of each operand into stage ``slot``."""
        if not self.gmem:
            return

        @pl.when(step >= num_stages)  # the stage's previous tiles were read by both consumers
        def _():
            plgpu.barrier_wait(self.consumed.at[slot])
        for src, ring in zip(self.gmem, self.rings):
            plgpu.copy_gmem_to_smem(pairwise_source(src, b, head, rows, keys), ring.at[slot],
                                    self.produced.at[slot])

    def drain(self, slot):
        """The memory warpgroup's tail: the consumers' last release of a stage."""
        if self.gmem:
            plgpu.barrier_wait(self.consumed.at[slot])

    def read(self, slot, rows):
        """A consumer: (its bias tile or None, its mask tile as bool or None) from stage
        ``slot``, in the WGMMA layout of S. ``release`` must follow once they are used."""
        if not self.gmem:
            return None, None
        plgpu.barrier_wait(self.produced.at[slot])
        return pairwise_tiles(self.rings, slot, rows, self.has_bias, self.has_mask)

    def release(self, slot):
        if self.gmem:
            plgpu.barrier_arrive(self.consumed.at[slot])

    def pass_(self, slot):
        """A tile the warpgroup does not read: the stage's barriers as if it did."""
        if self.gmem:
            plgpu.barrier_wait(self.produced.at[slot])
            plgpu.barrier_arrive(self.consumed.at[slot])


class _Item:
    """One work item as a warpgroup sees it: its rows, its batch row's scalars, the CTA's key
    range and its own split of it."""

    def __init__(self, cfg: AttentionConfig, geometry: Geometry, refs, pair, head, b, wg=None):
        c = geometry.config
        self.pair, self.head, self.b = pair, head, b
        self.q_len, self.kv_len = refs.q_len[b], refs.kv_len[b]
        self.offset = None if refs.offset is None else refs.offset[b]
        cta_start = pair * geometry.rows_per_cta
        self.lo, self.hi = masking.kv_block_range(
            cfg.mask, *geometry.positions(cta_start, geometry.rows_per_cta), c.block_kv,
            self.q_len, self.kv_len, self.offset)
        if wg is not None:
            self.q_start = cta_start + wg * c.block_q  # a row (a position unless packed)
            split = masking.kv_block_split(cfg.mask, *geometry.positions(self.q_start, c.block_q),
                                           c.block_kv, self.q_len, self.kv_len, self.offset)
            self.bounds = band_bounds(self.lo, self.hi, split)  # the own range's five stretches


def _split_refs(refs, has_offset: bool, has_sinks: bool, has_segments: bool,
                has_seeds: bool = False, has_dropout_offset: bool = False,
                has_bias: bool = False, has_mask: bool = False, has_tiles: bool = False,
                num_aux: int = 0):
    refs = list(refs)
    q, k, v, q_len, kv_len = refs[:5]
    rest = refs[5:]
    offset = rest.pop(0) if has_offset else None
    sinks = rest.pop(0) if has_sinks else None
    q_segments, kv_segments = (rest.pop(0), rest.pop(0)) if has_segments else (None, None)
    seeds = rest.pop(0) if has_seeds else None
    dropout_offset = rest.pop(0) if has_dropout_offset else None
    bias = rest.pop(0) if has_bias else None
    mask = rest.pop(0) if has_mask else None
    tiles = tuple(rest.pop(0) for _ in range(4)) if has_tiles else None
    mod_aux = tuple(rest.pop(0) for _ in range(num_aux))
    out, row_max, log_sum = rest
    return _KernelRefs(q, k, v, q_len, kv_len, offset, sinks, out, row_max, log_sum,
                       q_segments, kv_segments, seeds, dropout_offset, bias, mask, tiles,
                       mod_aux)


@dataclasses.dataclass(frozen=True)
class _KernelRefs:
    q: object         # [B, Lq, Hq, D] GMEM
    k: object         # [B, Lk, Hkv, D]
    v: object         # [B, Lk, Hkv, D]
    q_len: object     # [B] int32
    kv_len: object    # [B] int32
    offset: object    # [B] int32 or None
    sinks: object     # [Bs, Hs] float32 (packed: [Bs, Hs, lq_stats], per row) or None
    out: object       # [B, Lq, Hq, D]
    row_max: object   # [B, Hq, lq_stats] float32
    log_sum: object   # [B, Hq, lq_stats] float32
    q_segments: object = None   # [B, lq_stats] int32 or None (padded: every row a load reads)
    kv_segments: object = None  # [B, whole key tiles] int32 or None
    seeds: object = None        # [Bs, Hs] uint32 dropout seeds (dropout_sinks.head_seeds) or None
    dropout_offset: object = None  # [2] int32: the global (query, key) index of local (0, 0)
    bias: object = None         # [Bb, Hb, Lq, Lk] float or None (Bb in {1, B}, Hb in {1, Hq})
    mask: object = None         # [Bm, Hm, Lq, Lk] int8 (nonzero: may attend) or None
    tiles: object = None        # the item's tile lists (tile_lists) or None: the band walk
    mod_aux: tuple = ()         # the mods' arrays (mod_aux_operand), read by scalar indices


class ScalarModAux(ModAux):
    """A mod_aux array in the Mosaic GPU kernels: indexed by scalars only (``slopes[h]``,
    ``table[b, h]``: one load from global memory); an index array (``q_idx``, ``kv_idx``, or
    one made from them) would be a gather, which these kernels do not do."""

    def __getitem__(self, key):
        for index in key if isinstance(key, tuple) else (key,):
            if jnp.ndim(index):
                raise self._refuse_gather(index)
        return super().__getitem__(key)

    def _refuse_gather(self, index):
        return TypeError(f"mod_aux[{self._position}] (shape {self.shape}) is indexed with an "
                         f"array of shape {jnp.shape(index)}: in the mosaic_gpu kernels a mod_aux "
                         "array is read with scalar indices only (b, h, constants); "
                         "implementation='pallas_triton' or 'xla' gathers by q_idx and kv_idx")


def tile_mods(cfg, b, head, aux_refs, aux_types, gradient: bool = False):
    """The call's mods on an item's tiles (``common.TileMods``: batch row ``b``, query head
    ``head``), their mod_aux read as ``ScalarModAux``; None without mods."""
    if not cfg.has_mods:
        return None
    views = tuple(ScalarModAux(x._ref, x.dtype, i) if isinstance(x, ModAux) else x
                  for i, x in enumerate(kernel_mod_aux(aux_refs, aux_types)))
    return TileMods(cfg, jnp.asarray(b, jnp.int32), jnp.asarray(head, jnp.int32), views, gradient)


def _producer(cfg, geometry: Geometry, order: WorkOrder, refs: _KernelRefs, smem, barriers):
    """The memory warpgroup: every allowed K and V tile of each item, in order, into the ring."""
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
    c = geometry.config
    _, k_smem, v_smem, _, _ = smem[:5]
    _, k_produced, v_produced, k_consumed, v_consumed, _ = barriers[:6]
    key_ids = smem[-1] if geometry.has_segments else None
    pairwise = _Pairwise(refs, smem, barriers)
    groups = geometry.heads // geometry.kv_heads

    def item(pair, head, b, step):
        it = _Item(cfg, geometry, refs, pair, head, b)
        kv_head = lax.div(head, groups)
        rows = pl.ds(pair * geometry.rows_per_cta, geometry.rows_per_cta)

        def load(j, step):
            slot = lax.rem(step, c.num_stages)
            keys = (b, pl.ds(j * c.block_kv, c.block_kv), kv_head)
            for src, dst, produced, consumed in ((refs.k, k_smem, k_produced, k_consumed),
                                                 (refs.v, v_smem, v_produced, v_consumed)):
                @pl.when(step >= c.num_stages)  # the slot's previous tile was read by both
                def _(consumed=consumed):
                    plgpu.barrier_wait(consumed.at[slot])
                plgpu.copy_gmem_to_smem(src.at[keys], dst.at[slot], produced.at[slot])
                if src is refs.k and key_ids is not None:
                    plgpu.copy_gmem_to_smem(refs.kv_segments.at[b, keys[1]], key_ids.at[slot],
                                            produced.at[slot])
                if src is refs.k:  # the bias and mask, read with S
                    pairwise.load(b, head, rows, pl.ds(j * c.block_kv, c.block_kv), slot, step,
                                  c.num_stages)
            return step + 1

        start, stop, index_of = TileWalk.of(refs.tiles, (it.lo, it.hi), b, head, pair).streamed()
        return lax.fori_loop(start, stop, lambda t, step: load(index_of(t), step), step)

    steps = order.loop(lax.axis_index("cta"), item, jnp.int32(0))
    # The tail (FA3's load_tail): wait until the consumers have read the last tile of every
    # slot, so that every phase of the consumed barriers is observed before they go.
    for back in range(c.num_stages, 0, -1):
        @pl.when(steps >= back)
        def _(back=back):
            slot = lax.rem(steps - back, c.num_stages)
            plgpu.barrier_wait(k_consumed.at[slot])
            pairwise.drain(slot)
            plgpu.barrier_wait(v_consumed.at[slot])


# --- A compute warpgroup: its state, its tile steps, its item --------------------------------

@dataclasses.dataclass(frozen=True)
class _Warpgroup:
    """A compute warpgroup as each of its tile steps sees it: the call, its own slices of
    shared memory, the ring's barriers and the per-tile constants."""

    cfg: AttentionConfig
    geometry: Geometry
    refs: _KernelRefs
    wg: object             # this warpgroup's index (traced)
    q_all: object          # [CONSUMERS, block_q, D] smem: each warpgroup's Q, then its O
    q_smem: object         # this warpgroup's Q / O, row max and row log-sum in smem
    max_smem: object
    log_sum_smem: object
    k_smem: object         # [num_stages, block_kv, D] the K ring
    v_smem: object         # [num_stages, block_kv, D] the V ring
    key_ids: object        # [num_stages, block_kv] the key tiles' segment ids, or None
    barriers: tuple        # Q loaded, K produced, V produced, K consumed, V consumed, schedule
    pairwise: _Pairwise    # the bias and mask rings
    own_rows: object       # this warpgroup's rows of a pairwise tile (pl.ds)
    unit: float            # online_softmax.logits_unit: the logits are held as S / unit
    interpreted: bool
    # The ping-pong: arrive on the schedule barrier, wait for the other warpgroup (one function
    # for the whole kernel: each pl.when of it traces one branch).
    schedule_sync: object

    @classmethod
    def create(cls, cfg, geometry: Geometry, refs: _KernelRefs, smem, barriers,
               interpreted: bool) -> "_Warpgroup":
        c = geometry.config
        wg = lax.axis_index("wg")
        q_all, k_smem, v_smem, max_smem, log_sum_smem = smem[:5]
        key_ids = smem[-1] if geometry.has_segments else None
        schedule = barriers[5]

        def schedule_sync():
            plgpu.barrier_arrive(schedule)
            plgpu.barrier_wait(schedule)

        return cls(cfg, geometry, refs, wg, q_all, q_all.at[wg], max_smem.at[wg],
                   log_sum_smem.at[wg], k_smem, v_smem, key_ids, tuple(barriers[:6]),
                   _Pairwise(refs, smem, barriers), pl.ds(wg * c.block_q, c.block_q),
                   online_softmax.logits_unit(cfg, refs.bias is not None), interpreted,
                   schedule_sync)

    @property
    def config(self) -> Config:
        return self.geometry.config

    @property
    def tile(self) -> tuple[int, int]:
        return self.config.block_q, self.config.block_kv

    q_loaded = property(lambda self: self.barriers[0])
    k_produced = property(lambda self: self.barriers[1])
    v_produced = property(lambda self: self.barriers[2])
    k_consumed = property(lambda self: self.barriers[3])
    v_consumed = property(lambda self: self.barriers[4])
    schedule = property(lambda self: self.barriers[5])

    def own_q(self, step):
        """Q as S = Q K^T reads it, indexed by ``wg`` in a form the compiler cannot prove
        loop-invariant (``step`` is never negative): its wgmma descriptor is formed beside each
        GEMM instead of hoisted out of the loop over work items and kept live (D=128 causal
        with segment ids: 12 bytes spilled); backward._opaque_warpgroup does the same."""
        return self.q_all.at[jnp.where(step >= 0, self.wg, 0)]

    def key_iota(self):
        return plgpu.broadcasted_iota(jnp.int32, self.tile, 1, layout=plgpu.Layout.WGMMA)

    def row_positions(self, first):
        """The query position of each of the warpgroup's rows from ``first`` (packed: G rows
        per position)."""
        rows = first + plgpu.broadcasted_iota(jnp.int32, (self.config.block_q,), 0, layout=_ROW)
        g = self.geometry.group_rows
        return rows if g == 1 else lax.div(rows, jnp.int32(g))


class _ItemRows(NamedTuple):
    """What a compute warpgroup holds for one item's rows across its key tiles."""

    it: _Item
    q_segments: object    # [block_q] int32 in the row layout, or None
    dropout: object       # _Dropout or None
    mods: object          # kernel_tiles.TileMods or None


class _Carry(NamedTuple):
    """A compute warpgroup's state from key tile to key tile (``online_softmax.online_step``'s
    m and l, O's accumulator, the P whose P V is still to come)."""

    acc: object       # [block_q, D] float32: O times l
    row_max: object   # [block_q] float32 (in units of ``_Warpgroup.unit``)
    row_sum: object   # [block_q] float32
    p_prev: object    # [block_q, block_kv] 16-bit: the last tile's P, its P V not yet added
    step: object      # the ring's tile counter: it selects the slot


def _structural_allowed(w: _Warpgroup, it: _Item, s, j):
    """The structural mask rule on key tile ``j`` as two key bounds per row
    (``masking.key_bounds_per_row``): bool, S's shape."""
    # (With key lengths alone the bounds do not read the rows: an unused iota fails layout
    # inference.)
    rows = w.row_positions(it.q_start) if w.cfg.mask.varies_by_row else None
    lo, hi = masking.key_bounds_per_row(w.cfg.mask, rows, j * w.config.block_kv, it.q_len,
                                        it.kv_len, it.offset)
    per_row = lambda x: x if x is None or jnp.ndim(x) == 0 else \
        online_softmax.rows_to(x, s)  # a bound may be absent or one scalar
    return masking.within_bounds(w.key_iota(), per_row(lo), per_row(hi))


def _tile_softmax(w: _Warpgroup, rows: _ItemRows, s, j, slot, rules: TileRules, row_max,
                  row_sum):
    """The online softmax of key tile ``j``'s logits (in ring stage ``slot``), the per-pair
    ``rules`` applied: (rescale, P in fp32, m, l). Releases K's stage once its key ids are
    read, and the pairwise stage once its tiles are."""
    same = None
    if rows.q_segments is not None and rules.segments:  # the band walk: on every tile
        kv_segments = plgpu.load(w.key_ids.at[slot], layout=_COLUMN, optimized=False)
        same = (online_softmax.rows_to(rows.q_segments, s)
                == lax.broadcast_in_dim(kv_segments, w.tile, (1,)))
    plgpu.barrier_arrive(w.k_consumed.at[slot])
    bias, allowed = w.pairwise.read(slot, w.own_rows)
    t = s if w.unit != 1.0 else online_softmax.logits(s, w.cfg, bias)[0]
    if rows.mods is not None:  # on the fragment's global indices
        q_idx = online_softmax.rows_to(w.row_positions(rows.it.q_start), s)
        kv_idx = j * w.config.block_kv + w.key_iota()
        t = rows.mods.score(t, q_idx, kv_idx)[0]
        if rules.mask_mod:
            allowed = masking.all_of([allowed, rows.mods.allowed(q_idx, kv_idx)])
    if rules.structural and w.cfg.mask.restricts:
        allowed = masking.all_of([allowed, _structural_allowed(w, rows.it, s, j)])
    allowed = masking.all_of([allowed, same])
    rescale, p, row_max, row_sum = online_softmax.online_step(
        row_max, row_sum, t, allowed, base2=True, unit=w.unit)
    w.pairwise.release(slot)
    return rescale, p, row_max, row_sum


def _dropped(w: _Warpgroup, rows: _ItemRows, p, j):
    """P as P V reads it: dropout after the row sum (l is the undropped P's), and after
    P_{j-1} V's wait, so that the hash's registers are not taken while that GEMM holds O and
    P_{j-1}."""
    p = p if rows.dropout is None else rows.dropout.apply(p, j)
    return p.astype(w.geometry.dtype)


def _end_of_tile(w: _Warpgroup, slot, state):
    """After a tile's softmax: the other warpgroup's GEMMs go; then this tile's V."""
    # JAX's and tokamax's kernels: finishing the softmax before the barrier keeps the other
    # warpgroup's GEMMs from splitting it.
    state = lax.optimization_barrier(state)
    plgpu.barrier_arrive(w.schedule)
    plgpu.barrier_wait(w.v_produced.at[slot])
    plgpu.barrier_wait(w.schedule)
    return state


def _first_tile(w: _Warpgroup, rows: _ItemRows, j, carry: _Carry,
                rules: TileRules = TileRules.band(True)) -> _Carry:
    """The first key tile the warpgroup attends: S, its softmax, no P V yet (the pipeline's
    prologue; in the band walk the mask rule is applied, right for any tile)."""
    acc, row_max, row_sum, _, step = carry
    slot = lax.rem(step, w.config.num_stages)
    plgpu.barrier_wait(w.k_produced.at[slot])

    def logits(s_ref):
        plgpu.wgmma(s_ref, w.own_q(step), w.k_smem.at[slot].T)
        w.schedule_sync()  # the other warpgroup's GEMMs go next
        return s_ref[...]

    s = pl.run_scoped(logits, plgpu.ACC(w.tile, jnp.float32))
    rescale, p, row_max, row_sum = _tile_softmax(w, rows, s, j, slot, rules, row_max, row_sum)
    p = _dropped(w, rows, p, j)
    acc = acc * online_softmax.rows_to(rescale, acc)
    acc, row_max, row_sum, p = _end_of_tile(w, slot, (acc, row_max, row_sum, p))
    return _Carry(acc, row_max, row_sum, p, step + 1)


def _next_tile(w: _Warpgroup, rows: _ItemRows, j, carry: _Carry, rules: TileRules) -> _Carry:
    """Key tile ``j`` (FA3's intra-warpgroup pipelining): S_j = Q K_j^T and
    O += P_{j-1} V_{j-1} are issued together, tile j's softmax runs once S_j is ready while
    P V may still run on the tensor cores, then O takes tile j's rescale."""
    acc, row_max, row_sum, p_prev, step = carry
    c = w.config
    slot = lax.rem(step, c.num_stages)
    prev = lax.rem(step + c.num_stages - 1, c.num_stages)
    plgpu.barrier_wait(w.k_produced.at[slot])

    def between(s, row_max=row_max, row_sum=row_sum):
        return _tile_softmax(w, rows, s, j, slot, rules, row_max, row_sum)

    acc, (rescale, p, row_max, row_sum) = _pipelined_gemms(
        acc, w.own_q(step), w.k_smem.at[slot], p_prev, w.v_smem.at[prev], w.schedule_sync,
        between, w.interpreted)
    plgpu.barrier_arrive(w.v_consumed.at[prev])
    # P in 16 bits only now: registers that the next P V reads, written while this one runs,
    # make ptxas serialise every wgmma (its warning C7513).
    p = _dropped(w, rows, p, j)
    acc = acc * online_softmax.rows_to(rescale, acc)
    acc, row_max, row_sum, p = _end_of_tile(w, slot, (acc, row_max, row_sum, p))
    return _Carry(acc, row_max, row_sum, p, step + 1)


def _last_tile(w: _Warpgroup, carry: _Carry) -> _Carry:
    """The pipeline's epilogue: O += P V of the last attended tile."""
    prev = lax.rem(carry.step + w.config.num_stages - 1, w.config.num_stages)
    acc = _accumulate_values(carry.acc, carry.p_prev, w.v_smem.at[prev], w.interpreted)
    plgpu.barrier_arrive(w.v_consumed.at[prev])
    return carry._replace(acc=acc)


def _sequential_tile(w: _Warpgroup, rows: _ItemRows, j, carry: _Carry,
                     rules: TileRules) -> _Carry:
    """Key tile ``j`` without the overlap (``Config.overlap=False``): P_{j-1} V_{j-1} waited,
    then S_j and its softmax with no GEMM in flight beside them."""
    return _first_tile(w, rows, j, _last_tile(w, carry), rules)


def _pass_tile(w: _Warpgroup, j, carry: _Carry) -> _Carry:
    """A tile of the CTA's range that none of this warpgroup's rows may see: the ring's
    barriers and the schedule go on as if it were read."""
    slot = lax.rem(carry.step, w.config.num_stages)
    plgpu.barrier_wait(w.k_produced.at[slot])
    plgpu.barrier_arrive(w.k_consumed.at[slot])
    w.pairwise.pass_(slot)
    w.schedule_sync()
    plgpu.barrier_wait(w.v_produced.at[slot])
    plgpu.barrier_arrive(w.v_consumed.at[slot])
    w.schedule_sync()
    return carry._replace(step=carry.step + 1)


def _consumer_item(w: _Warpgroup, pair, head, b, step):
    """One work item's ``block_q`` rows: Q in, the item's tiles walked as the producer streams
    them (``TileWalk``), O and the row statistics out. -> the ring's step after it."""
    c, refs = w.config, w.refs
    it = _Item(w.cfg, w.geometry, refs, pair, head, b, w.wg)
    plgpu.copy_gmem_to_smem(refs.q.at[b, pl.ds(it.q_start, c.block_q), head], w.q_smem,
                            w.q_loaded.at[w.wg])
    sink = None if refs.sinks is None else _sink(refs.sinks, b, head, it.q_start, c.block_q)
    row_max, row_sum = (plgpu.layout_cast(x, _ROW) for x in dropout_sinks.initial_stats(
        None if sink is None else sink / w.unit, (c.block_q,)))
    # Segment ids by plain loads from global memory (a few bytes per row and key).
    q_segments = None if refs.q_segments is None else plgpu.load(
        refs.q_segments.at[b, pl.ds(it.q_start, c.block_q)], layout=_ROW, optimized=False)
    dropout = None if refs.seeds is None else _Dropout.create(w.cfg, refs, it, c)
    rows = _ItemRows(it, q_segments, dropout,
                     tile_mods(w.cfg, b, head, refs.mod_aux, w.geometry.mod_aux_types))
    acc = plgpu.layout_cast(jnp.zeros((c.block_q, w.geometry.head_dim), jnp.float32),
                            plgpu.Layout.WGMMA)
    plgpu.barrier_wait(w.q_loaded.at[w.wg])
    pl.when(w.wg == 1)(w.schedule_sync)  # one phase behind warpgroup 0: the ping-pong
    p_prev = plgpu.layout_cast(jnp.zeros(w.tile, w.geometry.dtype), plgpu.Layout.WGMMA)
    # The band's five stretches (pass, masked, unmasked, masked, pass: the attended ones
    # contiguous), or the CTA's listed tiles, the partial ones then the full ones, the same
    # for both warpgroups and the producer. The first attended tile is the prologue.
    walk = TileWalk.of(refs.tiles, it.bounds, b, head, pair)
    carry = walk.visit_pipelined(
        functools.partial(_first_tile, w, rows),
        functools.partial(_next_tile if c.overlap else _sequential_tile, w, rows),
        functools.partial(_last_tile, w), functools.partial(_pass_tile, w),
        _Carry(acc, row_max, row_sum, p_prev, step))
    pl.when(w.wg == 0)(w.schedule_sync)
    _store(w.geometry, refs, it, carry.acc, carry.row_max * w.unit, carry.row_sum, w.q_smem,
           w.max_smem, w.log_sum_smem)
    return carry.step


def _consumer(cfg, geometry: Geometry, order: WorkOrder, refs: _KernelRefs, smem, barriers,
              interpreted: bool):
    """A compute warpgroup: its ``block_q`` rows of each item against the ring's key tiles."""
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    w = _Warpgroup.create(cfg, geometry, refs, smem, barriers, interpreted)
    order.loop(lax.axis_index("cta"), functools.partial(_consumer_item, w), jnp.int32(0))


def _sink(sinks, b, head, first_row, num_rows: int):
    """The sink of the item's head (``sinks`` [Bs, Hs]), or, packed, of each of its rows
    (``sinks`` [Bs, Hs, rows]: the head of each row, ``_packed``), in the row layout."""
    index = (0 if sinks.shape[0] == 1 else b, 0 if sinks.shape[1] == 1 else head)
    if sinks.ndim == 2:
        return sinks[index]
    return plgpu.load(sinks.at[(*index, pl.ds(first_row, num_rows))], layout=_ROW,
                      optimized=False)


class _Dropout:
    """Dropout on a consumer's P tiles, by the library's hash (dropout_sinks.keep, factored):
    the row keys of its ``block_q`` rows (one mix per row) are drawn once per item in the row
    layout; each key tile adds its column keys (a multiply and an add per column, in the
    column layout) and one mix per pair, in the WGMMA layout of S. Rows and columns are global:
    the ring's ``dropout_offset`` is added before hashing."""

    def __init__(self, rate, row_keys, seed, first_column, block_kv):
        self.rate, self.row_keys, self.seed = rate, row_keys, seed
        self.first_column, self.block_kv = first_column, block_kv

    @classmethod
    def create(cls, cfg, refs: _KernelRefs, it: _Item, c: Config):
        seeds = refs.seeds
        seed = seeds[0 if seeds.shape[0] == 1 else it.b, 0 if seeds.shape[1] == 1 else it.head]
        first_row, first_column = it.q_start, jnp.int32(0)
        if refs.dropout_offset is not None:
            first_row = first_row + refs.dropout_offset[0]
            first_column = refs.dropout_offset[1]
        rows = first_row + plgpu.broadcasted_iota(jnp.int32, (c.block_q,), 0, layout=_ROW)
        return cls(cfg.dropout_rate, dropout_sinks.row_key(seed, rows), seed, first_column,
                   c.block_kv)

    def apply(self, p, j):
        """P of key tile ``j`` times 1 / (1 - rate) where kept, 0 where dropped."""
        cols = (self.first_column + j * self.block_kv
                + plgpu.broadcasted_iota(jnp.int32, (self.block_kv,), 0, layout=_COLUMN))
        column_keys = dropout_sinks.column_key(self.seed, cols)
        bits = dropout_sinks.mix(online_softmax.rows_to(self.row_keys, p)
                                 ^ lax.broadcast_in_dim(column_keys, p.shape, (1,)))
        # A select, then the scale: dropout_sinks.apply_dropout's product in every finite P
        # (a NaN row's out is NaN through l all the same), and measured: the product form
        # spills 8 bytes at D=64 causal, this one none.
        return jnp.where(dropout_sinks.kept(bits, self.rate), p, 0.0) * (1.0 / (1.0 - self.rate))


def _pipelined_gemms(acc, q_tile, k_tile, p_prev, v_prev, after_issue, between,
                     interpreted: bool):
    """S = Q K^T and O = acc + P_prev V_prev, issued back to back (two wgmma groups);
    ``after_issue()`` runs once both are issued, ``between(S)`` once S is ready (``wait_group
    1``: the P V group may still run), and O is read last (``wait_group 0``). -> (O, what
    ``between`` returned). O lives in an accumulator initialised from ``acc``'s registers.
    Interpreted (the interpreter of jax 0.11 runs neither a register-operand wgmma nor a
    partial wait): S by a wgmma waited at once and P V as a plain dot, the same barrier order."""
    tile = (q_tile.shape[0], k_tile.shape[0])
    if interpreted:
        def logits(s_ref):
            plgpu.wgmma(s_ref, q_tile, k_tile.T)
            after_issue()
            return s_ref[...]

        s = pl.run_scoped(logits, plgpu.ACC(tile, jnp.float32))
        acc = acc + jnp.dot(p_prev, v_prev[...], preferred_element_type=jnp.float32)
        return acc, between(s)

    def gemms(o_ref, s_ref):
        o_ref[...] = acc
        plgpu.wgmma(s_ref, q_tile, k_tile.T)
        plgpu.wgmma(o_ref, p_prev, v_prev)
        after_issue()
        found = between(plgpu.wgmma_accumulator_load(s_ref, wait_n=1))
        return plgpu.wgmma_accumulator_load(o_ref, wait_n=0), found

    return pl.run_scoped(gemms, plgpu.ACC(acc.shape, jnp.float32), plgpu.ACC(tile, jnp.float32))


def _accumulate_values(acc, p, v_tile, interpreted: bool):
    """O += P V on the tensor cores, into the accumulator itself (``pl.run_state`` over
    ``plgpu.ACC.init(acc)``: one wgmma chain with P from registers). Interpreted, as a plain
    dot of P with the V tile read from shared memory, added to O: the Mosaic GPU interpreter of
    jax 0.11 runs neither ``run_state`` over an accumulator nor a wgmma whose left operand is
    in registers. The only difference between the compiled and the interpreted program."""
    if interpreted:
        return acc + jnp.dot(p, v_tile[...], preferred_element_type=jnp.float32)

    def accumulate(acc_ref):
        plgpu.wgmma(acc_ref, p, v_tile)

    return pl.run_state(accumulate)(plgpu.ACC.init(acc))


def _store(geometry: Geometry, refs: _KernelRefs, it: _Item, acc, row_max, row_sum, q_smem,
           max_smem, log_sum_smem):
    """The epilogue: O = acc / l and the RowStats, through shared memory, by TMA. Rows past Lq
    are clipped by the TMA store; the statistics' rows past Lq are sliced off by XLA."""
    block_q = geometry.config.block_q
    out, stats = online_softmax.finalize(acc, row_max, row_sum)
    q_smem[...] = out.astype(geometry.dtype)
    max_smem[...] = stats.max
    log_sum_smem[...] = stats.log_sum
    plgpu.commit_smem()
    rows = pl.ds(it.q_start, block_q)
    plgpu.copy_smem_to_gmem(q_smem, refs.out.at[it.b, rows, it.head])
    plgpu.copy_smem_to_gmem(max_smem, refs.row_max.at[it.b, it.head, rows])
    plgpu.copy_smem_to_gmem(log_sum_smem, refs.log_sum.at[it.b, it.head, rows])
    # The next item's Q lands where O is being read from.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def forward_call(cfg: AttentionConfig, geometry: Geometry, q, k, v, q_len, kv_len, offset=None,
                 sinks=None, q_segment_ids=None, kv_segment_ids=None, seeds=None,
                 dropout_offset=None, bias=None, mask=None, *, block_mask=None, mod_aux=(),
                 num_sms: int | None = None, interpret=None, pack_query_group: bool = False):
    """q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D] (16-bit), q_len/kv_len [B] int32, offset [B] int32
    or None, sinks [Bs, Hs] float32 or None, segment ids [B, Lq] and [B, Lk] int32 or None,
    dropout seeds [Bs, Hs] uint32 or None (dropout at ``cfg.dropout_rate``) and its offset [2]
    int32 or None, bias [Bb, Hb, Lq, Lk] float or None and mask [Bm, Hm, Lq, Lk] bool (True:
    may attend) or None (Bx in {1, B}, Hx in {1, Hq}; ``geometry`` names the bias's dtype and
    whether a mask is given) -> (out [B, Lq, Hq, D], row max and log-sum [B, Hq, Lq] float32,
    natural log). ``pack_query_group``: each kv head's query heads are packed into the rows of
    its work items (``config.packs_query_group`` says where it pays). With segment ids, a
    ``block_mask`` or a mod, an unpacked call walks the lists of its CTAs' non-empty key tiles
    (``common.tile_lists`` on ``2 * block_q`` x ``block_kv`` tiles; a packed one the band)."""
    if pack_query_group and geometry.heads > geometry.kv_heads:
        if (cfg.dropout_rate or bias is not None or mask is not None or block_mask is not None
                or cfg.has_mods):
            raise ValueError("pack_query_group=True: dropout, a bias, a dense mask, a block_mask "
                             "and the mods differ per query head within a packed tile's rows; "
                             "call it unpacked")
        q, q_segment_ids, sinks, packed = _packed(q, q_segment_ids, sinks, geometry)
        out, row_max, log_sum = forward_call(
            cfg, packed, q, k, v, q_len, kv_len, offset, sinks, q_segment_ids, kv_segment_ids,
            num_sms=num_sms, interpret=interpret)
        return _unpacked(out, row_max, log_sum, packed.group_rows)
    c = geometry.config
    lq, lk = geometry.lq, geometry.lk
    if (None if bias is None else jnp.dtype(bias.dtype)) != geometry.bias_dtype or (
            (mask is not None) != geometry.has_mask):
        raise ValueError(f"the geometry's bias_dtype={geometry.bias_dtype} and has_mask="
                         f"{geometry.has_mask} must describe the bias and mask given")
    bias = None if bias is None else rows_of_sixteen_bytes(bias)
    mask = None if mask is None else rows_of_sixteen_bytes(mask.astype(jnp.int8))
    listed = None if geometry.group_rows != 1 else tile_lists(
        cfg, masking.MaskInputs(q_len, kv_len, q_segment_ids, kv_segment_ids, None, offset,
                                block_mask), lq, lk, geometry.rows_per_cta, c.block_kv)
    q, k, v, geometry = _rows_of_eight(q, k, v, geometry)
    has_segments = q_segment_ids is not None
    mod_aux = tuple(mod_aux) if cfg.has_mods else ()
    geometry = dataclasses.replace(geometry, has_segments=has_segments,
                                   mod_aux_types=mod_aux_types(mod_aux))
    if has_segments:
        # Whole tiles, so that every row a tile's load reads exists; the padded rows and keys
        # lie past the lengths (the length rule is on there), their ids are never compared.
        pad = lambda ids, n, fill: jnp.pad(ids.astype(jnp.int32), ((0, 0), (0, n - ids.shape[1])),
                                           constant_values=fill)
        q_segment_ids = pad(q_segment_ids, geometry.lq_stats, -1)
        kv_segment_ids = pad(kv_segment_ids, -(-geometry.lk // c.block_kv) * c.block_kv, -2)
    cfg = dataclasses.replace(cfg, mask=masking.with_padding(
        cfg.mask, queries_padded=geometry.lq % geometry.rows_per_cta != 0 or geometry.lq != lq,
        keys_padded=geometry.lk % c.block_kv != 0 or geometry.lk != lk))
    order = WorkOrder.create(geometry.num_pairs, geometry.heads, geometry.batch,
                             masking.later_query_tiles_heavier(cfg.mask), c.persistent,
                             **({} if num_sms is None else {"num_sms": num_sms}))
    has_offset, has_sinks = offset is not None, sinks is not None
    if not cfg.dropout_rate:
        seeds = dropout_offset = None
    elif seeds is None:
        raise ValueError(f"dropout_rate={cfg.dropout_rate} needs the dropout seeds")
    has_seeds, has_dropout_offset = seeds is not None, dropout_offset is not None

    def entry(*refs):
        kernel_refs = _split_refs(refs, has_offset, has_sinks, has_segments, has_seeds,
                                  has_dropout_offset, bias is not None, mask is not None,
                                  listed is not None, len(mod_aux))

        def body(smem, barriers):
            wg = lax.axis_index("wg")
            pl.when(wg < CONSUMERS)(lambda: _consumer(cfg, geometry, order, kernel_refs, smem,
                                                      barriers, interpret is not None))
            pl.when(wg == _MEMORY_WARPGROUP)(lambda: _producer(cfg, geometry, order, kernel_refs,
                                                               smem, barriers))

        tiles, barriers = _scratch(geometry)
        pl.run_scoped(lambda *scoped: body(scoped[:len(tiles)], scoped[len(tiles):]),
                      *tiles, *barriers, collective_axes="wg")

    stats = jax.ShapeDtypeStruct((geometry.batch, geometry.heads, geometry.lq_stats), jnp.float32)
    operands = [q, k, v, q_len, kv_len] + [x for x in (
        offset, sinks, q_segment_ids, kv_segment_ids,
        None if seeds is None else seeds.astype(jnp.uint32),
        None if dropout_offset is None else dropout_offset.astype(jnp.int32), bias, mask)
        if x is not None] + list(listed or ()) + [mod_aux_operand(x) for x in mod_aux]
    kernel = plgpu.kernel(
        entry, out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype), stats, stats),
        grid=(order.num_ctas,), grid_names=("cta",), num_threads=CONSUMERS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **({} if interpret is None else {"interpret": interpret}))
    # Inside shard_map the outputs vary as the operands do: plgpu.kernel (jax 0.11) returns
    # them unvarying whatever out_type says (a custom VJP's check, or a collective, would then
    # take one device's result for every device's).
    out, row_max, log_sum = vma.like(kernel(*operands), vma.axes_of(*operands))
    return out[:, :lq], row_max[..., :lq], log_sum[..., :lq]


def _packed(q, q_segment_ids, sinks, geometry: Geometry):
    """The call with each kv head's G query heads packed into its rows (FlashAttention-3's
    PackGQA): q [B, Lq * G, Hkv, D] with row r = query r // G of the group's head r % G (one
    XLA transpose of q), each query's segment id repeated G times, per-head sinks laid out per
    row ([Bs, Hkv, lq_stats]), and the packed geometry. The mask's rules read a row's query
    position (``Geometry.group_rows``); K and V are read once per item for the whole group."""
    g = geometry.heads // geometry.kv_heads
    lq = q.shape[1]
    q = online_softmax.pack_query_groups(q, g)
    packed = dataclasses.replace(geometry, lq=lq * g, heads=geometry.kv_heads, group_rows=g)
    if q_segment_ids is not None:
        q_segment_ids = jnp.repeat(q_segment_ids, g, axis=1)
    if sinks is not None and sinks.shape[1] != 1:
        member = jnp.arange(packed.lq_stats) % g
        sinks = sinks.reshape(sinks.shape[0], geometry.kv_heads, g)[:, :, member]
    return q, q_segment_ids, sinks, packed


def _unpacked(out, row_max, log_sum, g: int):
    """``_packed``'s inverse on the results: out [B, Lq, Hq, D], statistics [B, Hq, Lq]."""
    stats = lambda x: jnp.swapaxes(
        online_softmax.unpack_query_groups(jnp.swapaxes(x, 1, 2), g), 1, 2)
    return online_softmax.unpack_query_groups(out, g), stats(row_max), stats(log_sum)


def rows_of_sixteen_bytes(x):
    """A bias or (int8) mask [Bx, Hx, Lq, Lk] with its key axis padded with zeros to a multiple
    of 16 bytes (a TMA descriptor's global strides must be; the padded keys lie past Lk, where
    the length rule is on). A multiple already is not copied."""
    pad = -x.shape[-1] % (16 // x.dtype.itemsize)
    return x if not pad else jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, pad)))


ROW_MULTIPLE = 8  # a TMA box of the swizzled (8, 64) tiling reads whole 8-row groups of gmem


def _rows_of_eight(q, k, v, geometry: Geometry):
    """q, k, v with Lq and Lk padded with zeros to a multiple of 8 (Mosaic's TMA descriptors
    of the (8, 64)-tiled tiles need whole 8-row groups in gmem; measured on an H200: an Lk of
    300 is refused at compile time), and the geometry of the padded call. The padded rows lie at
    or past the lengths (the mask's length rule is switched on) and are sliced off the
    results. Lengths that are multiples of 8 are not copied."""
    pad = lambda n: -n % ROW_MULTIPLE
    if not pad(geometry.lq) and not pad(geometry.lk):
        return q, k, v, geometry
    rows = lambda x, n: jnp.pad(x, ((0, 0), (0, pad(n)), (0, 0), (0, 0)))
    q, k, v = rows(q, geometry.lq), rows(k, geometry.lk), rows(v, geometry.lk)
    return q, k, v, dataclasses.replace(geometry, lq=q.shape[1], lk=k.shape[1])
