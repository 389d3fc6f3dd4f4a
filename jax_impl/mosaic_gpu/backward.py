"""The backward kernels: FlashAttention-2's Algorithm 2 split in two, no atomics (by default:
the fused dQ below adds), in the warp-specialised style of forward.py (a TMA memory warpgroup
feeding two wgmma compute warpgroups through an mbarrier ring).

- **dK/dV** (``_dkdv_consumer``): a work item is ``2 * block_kv`` keys (one tile per compute
  warpgroup, K and V by TMA once) of one (batch row, kv head). The memory warpgroup streams,
  for each query head of the kv head's group in turn, every query tile the CTA's keys may see
  (``masking.q_block_range``): Q, dO and the three row vectors (row max, row log-sum, delta).
  The tiles are transposed, so that both products with the streamed side are plain:
  S^T = K Q^T and dP^T = V dO^T (both operands in shared memory), then dV += P^T dO and
  dK += dS^T Q (P^T and dS^T from registers). The group's heads are summed in the
  accumulators, in a fixed order: GQA/MQA need no second pass and no atomics.
- **dQ** (``_dq_consumer``): a work item is ``2 * block_q`` query rows of one (batch row, query
  head), like the forward's; Q, dO and the row vectors by TMA once; the memory warpgroup
  streams K, V and the keys' poison (below) of every key tile the rows may see: S = Q K^T,
  dP = dO V^T, dQ += dS K, accumulated in fp32 registers. Each dQ row is written by one CTA
  from one ordered walk: the result is bitwise repeatable.
- **Fused dQ** (``BackwardConfig(dq="fused")``, opt-in; ``_add_fused_dq``): no dQ kernel. After
  dV and dK, the dK/dV warpgroup writes dS^T to shared memory and takes dS K (its own K tile)
  in a wgmma of its own, stages the fp32 tile in shared memory and adds it into a zeroed fp32
  dQ in global memory by TMA reduce-add: FlashAttention-3's 5 GEMMs per tile pair instead of
  7, but the adds land in whatever order the CTAs finish: not bitwise repeatable.

P is recomputed from the forward's natural-log ``RowStats`` in base 2, the row max subtracted
first, exactly as ``online_softmax.recomputed_probs`` does, and the gradient of the logits follows
``online_softmax.logits_gradient`` (the soft cap's derivative; dS exactly 0 where P is 0 on a
masked tile; dK's and dQ's scale applied once to the accumulator). In each kernel the memory
warpgroup and both compute warpgroups walk one ``TileWalk`` (tile_walk.py): the band, split by
each compute warpgroup's own rows (``q_block_split``, ``kv_block_split``: the band's edge tiles
evaluate the structural rule, the tiles inside it none, the CTA's tiles outside a warpgroup's
own range only keep the ring in step), or the tile lists (partial, then full). A compute
warpgroup's state is explicit (``_DkdvWarpgroup`` / ``_DqWarpgroup`` for every item,
``_DkdvItem`` / ``_DqItem`` for one), and its tile step a function of it (``_dkdv_tile``,
``_dq_tile``).

The non-finite rule (online_softmax), prepared by one XLA pass: both kernels read q, k and v
with their non-finite entries as 0 (every product may read them at pairs that take no part);
a query row's poison (NaN where its row of q holds a non-finite value) is added to its saved
row max, so its recomputed P is NaN wherever the row attends and exactly 0 where the mask's
select excludes a pair; a key's poison (its row of K or V) is added to the rows of the dK/dV
kernel's K, which enters only S^T there, and reaches the dQ kernel's logits as a per-key
vector streamed with K and V (its K enters dQ += dS K too, so it stays finite). With the fused
dQ, dK/dV's K enters dS K as well: it stays finite, and the keys' poison is added to S^T's rows
from a per-key vector loaded once per item.

Segment ids (rule 4, on every tile): the side that stays loads its ids once per item (a plain
load, 2 values per thread); the streamed side's ids come through the ring by TMA with their
tile and are read from the slot where they are compared, so no tile's ids stay live in
registers across the loop (0 spills compiled), as in the forward.

A bias and a dense mask (``Geometry.pairwise_dtypes``): each kernel streams the CTA's tile of
each through its ring, as the forward does beside K, and each compute warpgroup reads its rows
(``forward.pairwise_tiles``). dQ's tiles are (queries, keys) as given, dK/dV's (keys, queries)
from one transposed copy made by XLA, its bias as float32. The mask's exclusions make dS 0
where P is 0 on every tile. With dbias (``Geometry.write_dbias``) dQ reads the bias as float32
too, and after each tile writes dS over its own rows of that tile in the ring slot and stores
them by TMA into a zeroed float32 ``[B, Hq, Lq, Lk]`` (each tile once: repeatable), before
releasing the slot.

Edges as in the forward: Lq and Lk are padded to multiples of 8 (the TMA descriptors' row
groups), TMA loads past them read zeros, stores are clipped, and ``masking.with_padding``
switches on the length rule; the row vectors are padded to whole CTAs.
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
from jax_impl.mosaic_gpu.config import CONSUMER_REGISTERS, CONSUMERS, PRODUCER_REGISTERS, BackwardConfig
from jax_impl.mosaic_gpu.forward import (pairwise_source, pairwise_tiles, rows_of_sixteen_bytes,
                                          tile_mods)
from jax_impl.kernel_tiles import TileRules, mod_aux_operand, mod_aux_types, tile_lists
from jax_impl.mosaic_gpu.scheduler import WorkOrder
from jax_impl.mosaic_gpu.tile_walk import TileWalk, band_bounds

_ROWS = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a WGMMA tile
_COLS = plgpu.Layout.WGMMA.reduce(0)  # one value per column
_MEMORY_WARPGROUP = CONSUMERS
ROW_MULTIPLE = 8


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The static shape of one backward call (Lq, Lk already padded to multiples of 8)."""

    batch: int
    lq: int
    lk: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: jnp.dtype
    config: BackwardConfig
    has_segments: bool = False
    bias_dtype: object = None  # the bias's dtype as the kernel reads it, or None: no bias
    has_mask: bool = False
    write_dbias: bool = False  # the dQ kernel writes dS (its bias is then float32)
    mod_aux_types: tuple = ()  # (dtype, shape) of each mod_aux entry (common.mod_aux_types)

    @property
    def pairwise_dtypes(self) -> tuple:
        """The dtypes of the pairwise rings: the bias's, then the mask's (int8)."""
        return tuple(dt for dt in (self.bias_dtype, jnp.int8 if self.has_mask else None)
                     if dt is not None)

    @property
    def streamed(self) -> int:
        """Operands of one ring step beyond the fixed ones (dK/dV: Q, dO, row max, log-sum,
        delta; dQ: K, V, the keys' poison): the streamed side's ids with segment ids, the bias
        tile and the mask tile. Each is a TMA copy with its produced barrier."""
        return int(self.has_segments) + len(self.pairwise_dtypes)

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    @property
    def q_pairs(self) -> int:
        return -(-self.lq // (CONSUMERS * self.config.block_q))

    @property
    def kv_pairs(self) -> int:
        return -(-self.lk // (CONSUMERS * self.config.block_kv))


def _swizzled(shape, dtype):
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)),
                                                plgpu.SwizzleTransform(128)))


def _wait_all(barriers, slot):
    for barrier in barriers:
        plgpu.barrier_wait(barrier.at[slot])


def _producer(order: WorkOrder, num_stages: int, walk, copies, consumed):
    """The memory warpgroup: for each item, ``walk(pair, head, b) -> (passes, tiles)``,
    ``tiles(p) -> (start, stop, index_of)`` (``TileWalk.streamed``): streamed tiles
    ``index_of(t)`` for ``t`` in ``[start, stop)`` in pass ``p``; ``copies(pair, head, b, p, j, slot)``
    issues one step's TMA copies into ring slot ``slot`` once both compute warpgroups have
    released it."""
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

    def item(pair, head, b, step):
        passes, tiles = walk(pair, head, b)

        def one_pass(p, step):
            def load(j, step):
                slot = lax.rem(step, num_stages)

                @pl.when(step >= num_stages)
                def _():
                    plgpu.barrier_wait(consumed.at[slot])
                copies(pair, head, b, p, j, slot)
                return step + 1

            start, stop, index_of = tiles(p)
            return lax.fori_loop(start, stop, lambda t, step: load(index_of(t), step), step)

        return lax.fori_loop(0, passes, one_pass, step)

    steps = order.loop(lax.axis_index("cta"), item, jnp.int32(0))
    # Every phase of the consumed barriers observed before they go (forward.py's tail).
    for back in range(num_stages, 0, -1):
        @pl.when(steps >= back)
        def _(back=back):
            plgpu.barrier_wait(consumed.at[lax.rem(steps - back, num_stages)])


def _tile_lists(refs):
    """The kernel's tile-list refs (``common.tile_lists``), or None: the band walk."""
    names = ("counts", "indices", "full_counts", "full_indices")
    return None if refs["counts"] is None else tuple(refs[n] for n in names)


def _pass_step(produced, consumed, num_stages):
    """A streamed tile that none of this warpgroup's own rows may pair with."""
    def body(_, carry):
        *acc, step = carry
        slot = lax.rem(step, num_stages)
        _wait_all(produced, slot)
        plgpu.barrier_arrive(consumed.at[slot])
        return (*acc, step + 1)
    return body


def _accumulate(acc, lhs, rhs_tile, interpreted: bool):
    """acc += lhs @ rhs_tile: lhs (16-bit) in registers, rhs in shared memory, one wgmma into the
    accumulator itself. Interpreted, a plain dot (forward._accumulate_values says why)."""
    if interpreted:
        return acc + jnp.dot(lhs, rhs_tile[...], preferred_element_type=jnp.float32)

    def accumulate(acc_ref):
        plgpu.wgmma(acc_ref, lhs, rhs_tile)

    return pl.run_state(accumulate)(plgpu.ACC.init(acc))


def _product(shape, a, b_t):
    """a @ b_t^T, both in shared memory, into fp32 registers."""
    def product(acc_ref):
        plgpu.wgmma(acc_ref, a, b_t.T)
        return acc_ref[...]

    return pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))


def _product_from_smem(shape, a, b):
    """a @ b, both in shared memory (``a`` may be a transposed view), into fp32 registers."""
    def product(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))


def _two_products(shape, a, b_t, c, d_t):
    """(a @ b_t^T, c @ d_t^T) from shared memory into fp32 registers, one wgmma group."""
    def products(refs):
        first, second = refs
        plgpu.wgmma(first, a, b_t.T)
        plgpu.wgmma(second, c, d_t.T)
        return first[...], second[...]

    return pl.run_scoped(products, (plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32)))


def _accumulate_two(acc_a, lhs_a, rhs_a, acc_b, lhs_b, rhs_b, interpreted: bool):
    """(acc_a + lhs_a @ rhs_a, acc_b + lhs_b @ rhs_b): left operands (16-bit) in registers,
    right ones in shared memory, one wgmma group. Interpreted, plain dots (``_accumulate``)."""
    if interpreted:
        return (_accumulate(acc_a, lhs_a, rhs_a, True), _accumulate(acc_b, lhs_b, rhs_b, True))

    def both(refs):
        a_ref, b_ref = refs
        plgpu.wgmma(a_ref, lhs_a, rhs_a)
        plgpu.wgmma(b_ref, lhs_b, rhs_b)

    return pl.run_state(both)((plgpu.ACC.init(acc_a), plgpu.ACC.init(acc_b)))


def _probs(cfg, qk, broadcast, row_max, log_sum, allowed, bias=None, poison=None,
           score_mod=None):
    """(P, the soft cap's tanh term, score_mod's derivative or None): P recomputed as
    ``online_softmax.recomputed_probs`` does (exactly 0 where ``allowed`` is False);
    ``broadcast`` takes a per-query vector to the tile; ``poison``: the streamed keys'
    (``online_softmax.logits``); ``score_mod(s) -> (score, d score / ds)`` on the final logits
    (``TileMods.score``), or None."""
    s, capped = online_softmax.logits(qk, cfg, bias, poison)
    s, slope = (s, None) if score_mod is None else score_mod(s)
    stats = online_softmax.RowStats(row_max, log_sum)
    # Unclamped: this backward runs only compiled (interpreted calls take pallas_triton's),
    # where the clamp's min cost dK/dV 8 spill bytes beside a bias and a mask (sm_90a).
    p = online_softmax.recomputed_probs(s, stats, allowed, base2=True, to_tile=broadcast,
                                        at_most_one=False)
    return p, capped, slope


def _logits_gradient(p, dp, capped, broadcast, delta, masked: bool, slope=None):
    """(dS, d(q.k) without the scale): ``online_softmax.logits_gradient(scaled=False)``, both
    exactly 0 where P is 0 on a tile with excluded pairs (also in a NaN row); through
    score_mod's elementwise derivative ``slope`` where given (NaN where a logit is poisoned,
    so its P = 0 is excluded too)."""
    ds = p * (dp - broadcast(delta))
    if slope is not None:
        ds, masked = ds * slope, True
    dqk = ds if capped is None else ds * (1.0 - capped * capped)
    if masked:
        excluded = p == 0
        ds = jnp.where(excluded, 0.0, ds)
        dqk = ds if capped is None else jnp.where(excluded, 0.0, dqk)
    return ds, dqk


def _excludes(cfg, rules: TileRules, has_segments: bool, has_mask: bool) -> bool:
    """Whether a tile may hold excluded pairs (``_logits_gradient``'s ``masked``): a masked
    edge of the band, every tile with segment ids or a mask_mod in the band walk, a listed
    partial tile, every tile with a dense mask."""
    return (rules.structural or (has_segments and rules.segments) or has_mask
            or (cfg.mask_mod is not None and rules.mask_mod))


def _same_segment(own_ids, streamed_ids, tile):
    """Rule 4 on a tile (``masking.segments_equal``): the warpgroup's own ids (one per row of
    the tile, held per item) against the streamed tile's (one per column, read from its ring
    slot where they are compared)."""
    return (lax.broadcast_in_dim(own_ids, tile, (0,))
            == lax.broadcast_in_dim(streamed_ids, tile, (1,)))


def _pairwise_scratch(g: Geometry, rows: int, cols: int):
    """The rings of a constant bias and a dense mask (int8): per stage the CTA's tile of each,
    ``rows`` (both compute warpgroups' own rows) x ``cols`` (the streamed tile), plain
    row-major, read into the WGMMA layout of the logits as the forward's are."""
    return tuple(plgpu.SMEM((g.config.num_stages, rows, cols), dt) for dt in g.pairwise_dtypes)


def _unpack_extras(g: Geometry, rest):
    """The scratch after a kernel's fixed buffers: (the two position buffers, the streamed ids'
    ring or None, the pairwise rings, what follows: the fused dQ's buffers)."""
    positions, rest = rest[:2], rest[2:]
    ids, rest = (rest[0] if g.has_segments else None), rest[g.has_segments:]
    pairs = len(g.pairwise_dtypes)
    return positions, ids, rest[:pairs], rest[pairs:]


def _pairwise_sources(g: Geometry, refs, b, head, rows, cols):
    """The bias's and the mask's tiles ``(rows, cols)`` in global memory for one ring step."""
    return tuple(pairwise_source(refs[name], b, head, rows, cols)
                 for name, given in (("bias", g.bias_dtype is not None), ("mask", g.has_mask))
                 if given)


def _position_scratch(c: BackwardConfig):
    """0..n-1 per compute warpgroup for a tile's rows and for its columns (int32)."""
    return (plgpu.SMEM((CONSUMERS, max(c.block_q, c.block_kv)), jnp.int32),
            plgpu.SMEM((CONSUMERS, max(c.block_q, c.block_kv)), jnp.int32))


def _opaque_warpgroup(wg, step):
    """``wg``, in a form the compiler cannot prove loop-invariant (``step`` is never negative):
    the wgmma descriptors of a warpgroup's own tiles indexed by it are then formed inside the
    loop instead of being hoisted and kept live in registers across every loop (D=128:
    spills)."""
    return jnp.where(step >= 0, wg, 0)


def _write_positions(positions, wg, rows: int, cols: int):
    """Writes a tile's row and column offsets (0..n-1) to shared memory once and returns
    loaders of them in the tile's row and column layouts. An edge tile's mask reads them from
    shared memory inside its loop: built from iotas, the compiler hoists every thread's
    per-element positions out of all loops and keeps them live (D=128: spills). A loader's
    ``mine`` (``_opaque_warpgroup``) reads them at an address formed inside the loop too."""
    row_ref, col_ref = (ref.at[wg] for ref in positions)
    row_ref[...] = plgpu.broadcasted_iota(jnp.int32, row_ref.shape, 0, layout=_ROWS)
    col_ref[...] = plgpu.broadcasted_iota(jnp.int32, col_ref.shape, 0, layout=_COLS)
    plgpu.commit_smem()
    at = lambda ref, all_, mine: ref if mine is None else all_.at[mine]
    return (lambda mine=None: plgpu.load(at(row_ref, positions[0], mine).at[pl.ds(0, rows)],
                                         layout=_ROWS),
            lambda mine=None: plgpu.load(at(col_ref, positions[1], mine).at[pl.ds(0, cols)],
                                         layout=_COLS))


# --- Dropout (the forward's hash; dV from the dropped P, dP dropped the same way) ----------

def _dropout(cfg, refs, b, head):
    """-> drop(x, queries, keys, query_axis): x times 1 / (1 - rate) where the library's hash
    keeps pair (query, key) and 0 where it drops it (``dropout_sinks.apply_dropout``'s
    product: a NaN row stays NaN), or None without dropout; ``x`` a tuple of tiles: each
    dropped by one hash. ``queries`` and ``keys`` are the
    tile's local indices as vectors in its row or column layout; ``query_axis`` is the tile's
    axis of queries (1: the transposed tiles of dK/dV). Global indices: the ring's offset is
    added. One mix per query and per pair, as ``dropout_sinks.keep`` factors it."""
    seeds = refs.get("seeds")
    if seeds is None:
        return None
    seed = seeds[0 if seeds.shape[0] == 1 else b, 0 if seeds.shape[1] == 1 else head]
    offset = refs.get("dropout_offset")

    def drop(x, queries, keys, query_axis: int):
        if offset is not None:
            queries, keys = queries + offset[0], keys + offset[1]
        xs = x if isinstance(x, tuple) else (x,)
        spread = lambda v, axis: lax.broadcast_in_dim(v, xs[0].shape, (axis,))
        bits = dropout_sinks.mix(spread(dropout_sinks.row_key(seed, queries), query_axis)
                                 ^ spread(dropout_sinks.column_key(seed, keys), 1 - query_axis))
        keep = dropout_sinks.kept(bits, cfg.dropout_rate)
        out = tuple(dropout_sinks.apply_dropout(y, keep, cfg.dropout_rate) for y in xs)
        return out if isinstance(x, tuple) else out[0]

    return drop


# --- dK/dV ----------------------------------------------------------------------------------

def _dkdv_scratch(g: Geometry):
    c, d = g.config, g.head_dim
    tiles = (_swizzled((CONSUMERS, c.block_kv, d), g.dtype),  # K, then dK
             _swizzled((CONSUMERS, c.block_kv, d), g.dtype),  # V, then dV
             _swizzled((c.num_stages, c.block_q, d), g.dtype),  # Q ring
             _swizzled((c.num_stages, c.block_q, d), g.dtype),  # dO ring
             *[plgpu.SMEM((c.num_stages, c.block_q), jnp.float32)] * 3,  # max, log-sum, delta
             *_position_scratch(c),
             *[plgpu.SMEM((c.num_stages, c.block_q), jnp.int32)] * g.has_segments,  # query ids
             *_pairwise_scratch(g, CONSUMERS * c.block_kv, c.block_q),  # transposed tiles
             *_fused_dq_scratch(g))
    barriers = (plgpu.Barrier(num_barriers=CONSUMERS), plgpu.Barrier(num_barriers=CONSUMERS),
                *[plgpu.Barrier(num_barriers=c.num_stages) for _ in range(5 + g.streamed)],
                plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=c.num_stages))
    return tiles, barriers


def _fused_dq_scratch(g: Geometry):
    """With ``dq="fused"``, per consumer: dS^T (16-bit: dK's left operand, and transposed
    dQ's, which wgmma cannot take transposed from registers) and the fp32 dQ tile that the TMA
    reduce-add reads (swizzled: 32 fp32 are 128 bytes)."""
    c = g.config
    if c.dq != "fused":
        return ()
    return (_swizzled((CONSUMERS, c.block_kv, c.block_q), g.dtype),
            plgpu.SMEM((CONSUMERS, c.block_q, g.head_dim), jnp.float32,
                       transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))))


def _add_fused_dq(cfg, g: Geometry, refs, ds_t_all, dq_all, k_all, ds_t, wg, step, rows, head,
                  b, interpreted):
    """dQ's part of one tile pair, dS K (dS = ds_t^T, the warpgroup's own K tile; compiled,
    dS^T is in ``ds_t_all`` already), added into the fp32 dQ in global memory: by TMA
    reduce-add (the adds of the CTAs land in any order).
    The interpreter has no reduce-add; there each warpgroup reads, adds and writes a dQ of its
    own (``refs["dq_sum"]`` has a leading axis of CONSUMERS, summed after the call): sound only
    because the interpreter runs one CTA at a time, and the two warpgroups of a CTA never touch
    the same slice."""
    c = g.config
    mine = _opaque_warpgroup(wg, step)
    if interpreted:
        dq = jnp.dot(ds_t.T, k_all.at[mine][...], preferred_element_type=jnp.float32)
        target = refs["dq_sum"].at[wg, b, rows, head]
        target[...] = target[...] + dq
        return
    dq_own = dq_all.at[wg]
    dq = _product_from_smem((c.block_q, g.head_dim), ds_t_all.at[mine].T, k_all.at[mine])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's reduce-add has read
    dq_own[...] = dq
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dq_own, refs["dq_sum"].at[b, rows, head], reduction_op="add")


@dataclasses.dataclass(frozen=True)
class _DkdvWarpgroup:
    """A dK/dV compute warpgroup as each of its tile steps sees it: its own key tile's K and V
    (then dK and dV) in shared memory, the rings of the streamed query tiles, the barriers and
    the per-tile constants."""

    cfg: AttentionConfig
    g: Geometry
    refs: dict
    wg: object               # this warpgroup's index (traced)
    k_all: object            # [CONSUMERS, block_kv, D] smem: each warpgroup's K, then its dK
    v_all: object            # [CONSUMERS, block_kv, D] smem: V, then dV
    k_own: object            # this warpgroup's K / dK and V / dV
    v_own: object
    rings: tuple             # [num_stages, ...] Q, dO, row max, row log-sum, delta
    q_ids_ring: object       # [num_stages, block_q] the query tiles' segment ids, or None
    pairwise: tuple          # the bias and mask rings (transposed tiles)
    ds_t_all: object         # fused dQ: [CONSUMERS, block_kv, block_q] dS^T, else None
    dq_all: object           # fused dQ: [CONSUMERS, block_q, D] float32 dQ tile, else None
    own_keys: object         # this warpgroup's rows of a pairwise tile (pl.ds)
    barriers: tuple          # K loaded, V loaded, the ring's produced ones..., consumed
    key_offsets: object      # _write_positions' loaders: 0..block_kv-1 and 0..block_q-1
    query_offsets: object
    interpreted: bool

    @classmethod
    def create(cls, cfg, g: Geometry, refs, smem, barriers, interpreted) -> "_DkdvWarpgroup":
        c = g.config
        wg = lax.axis_index("wg")
        k_all, v_all, *rings, rest = (*smem[:7], smem[7:])
        positions, q_ids_ring, pairwise, rest = _unpack_extras(g, rest)
        ds_t_all, dq_all = rest if c.dq == "fused" else (None, None)
        own_keys = pl.ds(wg * c.block_kv, c.block_kv)
        k_own, v_own = k_all.at[wg], v_all.at[wg]
        offsets = _write_positions(positions, wg, c.block_kv, c.block_q)
        return cls(cfg, g, refs, wg, k_all, v_all, k_own, v_own, tuple(rings), q_ids_ring,
                   tuple(pairwise), ds_t_all, dq_all, own_keys, tuple(barriers), *offsets,
                   interpreted)

    @property
    def tile(self) -> tuple[int, int]:
        return self.g.config.block_kv, self.g.config.block_q  # transposed: keys x queries

    @property
    def fused(self) -> bool:
        return self.g.config.dq == "fused"

    @property
    def produced(self) -> tuple:
        return self.barriers[2:-1]

    @property
    def consumed(self):
        return self.barriers[-1]

    def cols(self, x):
        """A per-query vector across the (transposed) tile."""
        return lax.broadcast_in_dim(x, self.tile, (1,))


class _DkdvItem(NamedTuple):
    """What a dK/dV compute warpgroup holds for one item (its key tile) across the query
    tiles of every head of the group."""

    b: object
    kv_head: object
    key_start: object     # the warpgroup's first key
    q_len: object
    kv_len: object
    offset: object        # the batch row's position offset, or None
    key_ids: object       # [block_kv] int32 in the row layout, or None
    key_poison: object    # fused dQ: [block_kv] float32 in the row layout, else None


def _ring_row(ring, slot):
    """A streamed per-query vector (row max, log-sum, delta, ids) in the tile's column layout."""
    return plgpu.load(ring.at[slot], layout=_COLS)


def _dkdv_allowed(w: _DkdvWarpgroup, item: _DkdvItem, i, slot, at, rules: TileRules, head):
    """The pairs of (transposed) tile ``(key tile, query tile i)`` that may attend and its
    pairwise tiles: (allowed or None, the bias tile or None, score_mod with its derivative or
    None), the mask rules ``rules`` applied."""
    cfg, c, tile = w.cfg, w.g.config, w.tile
    allowed = None
    if rules.structural and cfg.mask.restricts:  # two query bounds per key, as the forward's
        lo, hi = masking.query_bounds_per_key(cfg.mask, item.key_start + w.key_offsets(at),
                                              i * c.block_q, item.q_len, item.kv_len,
                                              item.offset)
        per_key = lambda x: x if x is None or jnp.ndim(x) == 0 else \
            lax.broadcast_in_dim(x, tile, (0,))
        allowed = masking.within_bounds(w.cols(w.query_offsets(at)), per_key(lo), per_key(hi))
    head_mods = tile_mods(cfg, item.b, head(), w.refs["mod_aux"], w.g.mod_aux_types,
                          gradient=True)
    score_mod = None
    if head_mods is not None:  # on the fragment's global indices (transposed)
        q_idx = w.cols(i * c.block_q + w.query_offsets(at))
        kv_idx = lax.broadcast_in_dim(item.key_start + w.key_offsets(at), tile, (0,))
        score_mod = functools.partial(head_mods.score, rows=q_idx, cols=kv_idx)
        if rules.mask_mod:
            allowed = masking.all_of([allowed, head_mods.allowed(q_idx, kv_idx)])
    if item.key_ids is not None and rules.segments:  # the band walk: on every tile
        allowed = masking.all_of([allowed, _same_segment(
            item.key_ids, _ring_row(w.q_ids_ring, slot), tile)])
    bias_t, mask_t = pairwise_tiles(w.pairwise, slot, w.own_keys, w.g.bias_dtype is not None,
                                    w.g.has_mask)
    return masking.all_of([allowed, mask_t]), bias_t, score_mod


def _dkdv_operands(w: _DkdvWarpgroup, item: _DkdvItem, i, slot, mine, at, rules: TileRules,
                   head, p_t, dp_t, capped, slope):
    """dV's and dK's 16-bit left operands of one tile, (P^T dropped, dS^T): dS^T from
    registers, or fused from its stage in shared memory. Dropout: dV from the dropped P^T,
    dP^T dropped alike."""
    cfg, g, c = w.cfg, w.g, w.g.config
    # With a tile streamed beside Q and dO (ids, a bias, a mask) P^T is dropped beside dP^T
    # (one hash) and dV's 16-bit operand made at once; without, and causal with one streamed
    # tile that is not a mask, after dS^T: each order the one that spills least (sm_90a,
    # D=128: causal, segment ids 0 bytes against 4, a bias 4 against 16, a mask 72 against 16;
    # not causal, segment ids 100 against 16).
    drop = _dropout(cfg, w.refs, item.b, head())
    dv_lhs = None
    if drop is not None:
        queries = i * c.block_q + w.query_offsets(at)
        keys = item.key_start + w.key_offsets(at)
        if g.streamed and not (cfg.mask.is_causal and g.streamed == 1 and not g.has_mask):
            dp_t, dv_lhs = drop((dp_t, p_t), queries, keys, 1)
            dv_lhs = dv_lhs.astype(g.dtype)
        else:
            dp_t = drop(dp_t, queries, keys, 1)
    _, dqk_t = _logits_gradient(p_t, dp_t, capped, w.cols, _ring_row(w.rings[4], slot),
                                _excludes(cfg, rules, item.key_ids is not None, g.has_mask),
                                slope)
    if dv_lhs is None:
        dv_lhs = (p_t if drop is None else drop(p_t, queries, keys, 1)).astype(g.dtype)
    ds_t = dqk_t.astype(g.dtype)
    ds_t_lhs = ds_t
    # Fused, dS^T goes to shared memory, dK's operand and dQ's: from registers too it spilled
    # (D=128 with dropout: 4 bytes).
    if w.fused and not w.interpreted:
        w.ds_t_all.at[w.wg][...] = ds_t
        plgpu.commit_smem()
        ds_t_lhs = w.ds_t_all.at[mine]
    return dv_lhs, ds_t, ds_t_lhs


def _dkdv_tile(w: _DkdvWarpgroup, item: _DkdvItem, i, carry, rules: TileRules, member=None):
    """Query tile ``i`` of head ``member`` of the group against the warpgroup's key tile:
    S^T = K Q^T and dP^T = V dO^T in one group, then P^T and dS^T in their registers, then
    dV += P^T dO and dK += dS^T Q in one group (two fp32 tiles live beside dK and dV at most:
    D=128 fits 240 registers)."""
    cfg, g, c = w.cfg, w.g, w.g.config
    q_ring, do_ring, max_ring, log_sum_ring, _ = w.rings
    dk, dv, step = carry
    slot = lax.rem(step, c.num_stages)
    _wait_all(w.produced, slot)
    mine = _opaque_warpgroup(w.wg, step)
    s_t, dp_t = _two_products(w.tile, w.k_all.at[mine], q_ring.at[slot], w.v_all.at[mine],
                              do_ring.at[slot])
    # With dropout beside segment ids alone, or a mask alone causal, the positions are read at
    # ``mine``'s address (D=128: segment ids 16 bytes spilled, not 20, and causal 0 with the
    # drop order of _dkdv_operands; a mask causal 8, not 16); elsewhere the hoisted address
    # spills less (a mask not causal: 12 against 24, every feature at once 76 loaded against 80).
    at = mine if cfg.dropout_rate and g.streamed == 1 and (
        g.has_segments or (g.has_mask and cfg.mask.is_causal)) else None
    head = lambda: item.kv_head * g.groups + member
    allowed, bias_t, score_mod = _dkdv_allowed(w, item, i, slot, at, rules, head)
    p_t, capped, slope = _probs(cfg, s_t, w.cols, _ring_row(max_ring, slot),
                                _ring_row(log_sum_ring, slot), allowed, bias_t,
                                None if item.key_poison is None else
                                lax.broadcast_in_dim(item.key_poison, w.tile, (0,)), score_mod)
    dv_lhs, ds_t, ds_t_lhs = _dkdv_operands(w, item, i, slot, mine, at, rules, head, p_t,
                                            dp_t, capped, slope)
    dv, dk = _accumulate_two(dv, dv_lhs, do_ring.at[slot], dk, ds_t_lhs, q_ring.at[slot],
                             w.interpreted)
    plgpu.barrier_arrive(w.consumed.at[slot])
    if w.fused:  # after dK and dV: dQ's fp32 tile is never live beside P^T and dS^T
        _add_fused_dq(cfg, g, w.refs, w.ds_t_all, w.dq_all, w.k_all, ds_t, w.wg, step,
                      pl.ds(i * c.block_q, c.block_q), head(), item.b, w.interpreted)
    return dk, dv, step + 1


def _dkdv_item(w: _DkdvWarpgroup, pair, kv_head, b, step):
    """One work item: the warpgroup's key tile against every query tile of the group's heads
    that it may see, walked as the producer streams them (``TileWalk``); dK and dV out."""
    cfg, g, refs, c, wg = w.cfg, w.g, w.refs, w.g.config, w.wg
    k_loaded, v_loaded = w.barriers[:2]
    q_len, kv_len = refs["q_len"][b], refs["kv_len"][b]
    offset = None if refs["offset"] is None else refs["offset"][b]
    cta_start = pair * CONSUMERS * c.block_kv
    key_start = cta_start + wg * c.block_kv
    keys = (b, pl.ds(key_start, c.block_kv), kv_head)
    plgpu.copy_gmem_to_smem(refs["k"].at[keys], w.k_own, k_loaded.at[wg])
    plgpu.copy_gmem_to_smem(refs["v"].at[keys], w.v_own, v_loaded.at[wg])
    lo, hi = masking.q_block_range(cfg.mask, cta_start, CONSUMERS * c.block_kv, c.block_q,
                                   q_len, kv_len, offset)
    bounds = band_bounds(lo, hi, masking.q_block_split(cfg.mask, key_start, c.block_kv,
                                                       c.block_q, q_len, kv_len, offset))
    zeros = plgpu.layout_cast(jnp.zeros((c.block_kv, g.head_dim), jnp.float32),
                              plgpu.Layout.WGMMA)
    # The tile's own key ids once per item, by a plain load (a few bytes: 2 per thread).
    key_ids = None if w.q_ids_ring is None else plgpu.load(
        refs["kv_ids"].at[b, pl.ds(key_start, c.block_kv)], layout=_ROWS, optimized=False)
    # Fused, K stays finite (it enters dQ += dS K too) and its keys' poison is added to the
    # rows of S^T instead, loaded once per item like the key ids.
    key_poison = None if not w.fused else plgpu.load(
        refs["key_poison"].at[b, kv_head, pl.ds(key_start, c.block_kv)], layout=_ROWS,
        optimized=False)
    plgpu.barrier_wait(k_loaded.at[wg])
    plgpu.barrier_wait(v_loaded.at[wg])
    item = _DkdvItem(b, kv_head, key_start, q_len, kv_len, offset, key_ids, key_poison)
    skip = _pass_step(w.produced, w.consumed, c.num_stages)
    lists = _tile_lists(refs)

    def one_head(member, carry):  # the group's query heads, in order: their sum is fixed
        return TileWalk.of(lists, bounds, b, kv_head * g.groups + member, pair).visit(
            functools.partial(_dkdv_tile, w, item, member=member), skip, carry)

    dk, dv, step = lax.fori_loop(0, g.groups, one_head, (zeros, zeros, step))
    w.k_own[...] = (dk * cfg.scale).astype(g.dtype)
    w.v_own[...] = dv.astype(g.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(w.k_own, refs["dk"].at[keys])
    plgpu.copy_smem_to_gmem(w.v_own, refs["dv"].at[keys])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the next item's K, V land there
    return step


def _dkdv_consumer(cfg, g: Geometry, order, refs, smem, barriers, interpreted):
    """A dK/dV compute warpgroup: its key tile of each item against the streamed query tiles."""
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    w = _DkdvWarpgroup.create(cfg, g, refs, smem, barriers, interpreted)
    order.loop(lax.axis_index("cta"), functools.partial(_dkdv_item, w), jnp.int32(0))


def _dkdv_walk(cfg, g: Geometry, refs):
    c = g.config

    def walk(pair, kv_head, b):
        offset = None if refs["offset"] is None else refs["offset"][b]
        lo, hi = masking.q_block_range(cfg.mask, pair * CONSUMERS * c.block_kv,
                                       CONSUMERS * c.block_kv, c.block_q, refs["q_len"][b],
                                       refs["kv_len"][b], offset)
        return g.groups, lambda member: TileWalk.of(_tile_lists(refs), (lo, hi), b,
                                                    kv_head * g.groups + member, pair).streamed()

    def copies(pair, kv_head, b, member, i, slot, smem, produced):
        _, _, q_ring, do_ring, max_ring, log_sum_ring, delta_ring, *rest = smem
        _, ids_ring, pairwise, _ = _unpack_extras(g, rest)
        head = kv_head * g.groups + member
        rows = pl.ds(i * c.block_q, c.block_q)
        ids = ((refs["q_ids"].at[b, rows],), (ids_ring,)) if g.has_segments else ((), ())
        keys = pl.ds(pair * CONSUMERS * c.block_kv, CONSUMERS * c.block_kv)
        for src, dst, barrier in zip(
                (refs["q"].at[b, rows, head], refs["do"].at[b, rows, head],
                 refs["row_max"].at[b, head, rows], refs["log_sum"].at[b, head, rows],
                 refs["delta"].at[b, head, rows], *ids[0],
                 *_pairwise_sources(g, refs, b, head, keys, rows)),
                (q_ring, do_ring, max_ring, log_sum_ring, delta_ring, *ids[1], *pairwise),
                produced):
            plgpu.copy_gmem_to_smem(src, dst.at[slot], barrier.at[slot])

    return walk, copies


# --- dQ -------------------------------------------------------------------------------------

def _dq_scratch(g: Geometry):
    c, d = g.config, g.head_dim
    tiles = (_swizzled((CONSUMERS, c.block_q, d), g.dtype),  # Q, then dQ
             _swizzled((CONSUMERS, c.block_q, d), g.dtype),  # dO
             *[plgpu.SMEM((CONSUMERS, c.block_q), jnp.float32)] * 3,  # max, log-sum, delta
             _swizzled((c.num_stages, c.block_kv, d), g.dtype),  # K ring
             _swizzled((c.num_stages, c.block_kv, d), g.dtype),  # V ring
             plgpu.SMEM((c.num_stages, c.block_kv), jnp.float32),  # the keys' poison
             *_position_scratch(c),
             *[plgpu.SMEM((c.num_stages, c.block_kv), jnp.int32)] * g.has_segments,  # key ids
             *_pairwise_scratch(g, CONSUMERS * c.block_q, c.block_kv))
    barriers = (*[plgpu.Barrier(num_barriers=CONSUMERS) for _ in range(5)],
                *[plgpu.Barrier(num_barriers=c.num_stages) for _ in range(3 + g.streamed)],
                plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=c.num_stages))
    return tiles, barriers


@dataclasses.dataclass(frozen=True)
class _DqWarpgroup:
    """A dQ compute warpgroup as each of its tile steps sees it: its own query rows' Q, dO and
    row vectors in shared memory, the rings of the streamed key tiles, the barriers and the
    per-tile constants."""

    cfg: AttentionConfig
    g: Geometry
    refs: dict
    wg: object               # this warpgroup's index (traced)
    q_all: object            # [CONSUMERS, block_q, D] smem: each warpgroup's Q, then its dQ
    do_all: object           # [CONSUMERS, block_q, D] smem: dO
    row_vectors: tuple       # [CONSUMERS, block_q] smem: row max, row log-sum, delta
    rings: tuple             # [num_stages, ...] K, V, the keys' poison
    kv_ids_ring: object      # [num_stages, block_kv] the key tiles' segment ids, or None
    pairwise: tuple          # the bias and mask rings
    own_rows: object         # this warpgroup's rows of a pairwise tile (pl.ds)
    barriers: tuple          # 5 own loads (Q, dO, the row vectors), the ring's produced, consumed
    q_own: object            # this warpgroup's Q / dQ and dO
    do_own: object
    query_offsets: object    # _write_positions' loaders: 0..block_q-1 and 0..block_kv-1
    key_offsets: object
    interpreted: bool

    @classmethod
    def create(cls, cfg, g: Geometry, refs, smem, barriers, interpreted) -> "_DqWarpgroup":
        c = g.config
        wg = lax.axis_index("wg")
        q_all, do_all, *vectors_and_rings = smem[:8]
        positions, kv_ids_ring, pairwise, _ = _unpack_extras(g, smem[8:])
        own_rows = pl.ds(wg * c.block_q, c.block_q)
        q_own, do_own = q_all.at[wg], do_all.at[wg]
        offsets = _write_positions(positions, wg, c.block_q, c.block_kv)
        return cls(cfg, g, refs, wg, q_all, do_all, tuple(vectors_and_rings[:3]),
                   tuple(vectors_and_rings[3:]), kv_ids_ring, tuple(pairwise), own_rows,
                   tuple(barriers), q_own, do_own, *offsets, interpreted)

    @property
    def tile(self) -> tuple[int, int]:
        return self.g.config.block_q, self.g.config.block_kv

    @property
    def own_loaded(self) -> tuple:
        return self.barriers[:5]

    @property
    def produced(self) -> tuple:
        return self.barriers[5:-1]

    @property
    def consumed(self):
        return self.barriers[-1]

    def rows_of(self, x):
        """A per-query vector across the tile."""
        return lax.broadcast_in_dim(x, self.tile, (0,))


class _DqItem(NamedTuple):
    """What a dQ compute warpgroup holds for one item (its query rows) across the key tiles."""

    b: object
    head: object
    q_start: object       # the warpgroup's first query row
    q_len: object
    kv_len: object
    offset: object        # the batch row's position offset, or None
    stats: tuple          # [block_q] row max, row log-sum, delta in the row layout
    query_ids: object     # [block_q] int32 in the row layout, or None
    drop: object          # _dropout's function, or None
    mods: object          # kernel_tiles.TileMods or None


def _dq_allowed(w: _DqWarpgroup, item: _DqItem, j, slot, rules: TileRules):
    """The pairs of tile ``(query rows, key tile j)`` that may attend and its pairwise tiles:
    (allowed or None, the bias tile or None, score_mod with its derivative or None), the mask
    rules ``rules`` applied."""
    cfg, c, tile = w.cfg, w.g.config, w.tile
    allowed = None
    if rules.structural:
        allowed = masking.structural_allowed(
            cfg.mask, lax.broadcast_in_dim(item.q_start + w.query_offsets(), tile, (0,)),
            lax.broadcast_in_dim(j * c.block_kv + w.key_offsets(), tile, (1,)), item.q_len,
            item.kv_len, item.offset)
    score_mod = None
    if item.mods is not None:  # on the fragment's global indices
        q_idx = w.rows_of(item.q_start + w.query_offsets())
        kv_idx = lax.broadcast_in_dim(j * c.block_kv + w.key_offsets(), tile, (1,))
        score_mod = functools.partial(item.mods.score, rows=q_idx, cols=kv_idx)
        if rules.mask_mod:
            allowed = masking.all_of([allowed, item.mods.allowed(q_idx, kv_idx)])
    if item.query_ids is not None and rules.segments:  # the band walk: on every tile
        allowed = masking.all_of([allowed, _same_segment(
            item.query_ids, plgpu.load(w.kv_ids_ring.at[slot], layout=_COLS), tile)])
    bias, mask = pairwise_tiles(w.pairwise, slot, w.own_rows, w.g.bias_dtype is not None,
                                w.g.has_mask)
    return masking.all_of([allowed, mask]), bias, score_mod


def _dq_tile(w: _DqWarpgroup, item: _DqItem, j, carry, rules: TileRules):
    """Key tile ``j`` against the warpgroup's rows: S = Q K^T and dP = dO V^T in one group,
    P and dS in registers, dQ += dS K (and, with dbias, dS out through its ring stage)."""
    cfg, g, c = w.cfg, w.g, w.g.config
    k_ring, v_ring, poison_ring = w.rings
    dq, step = carry
    slot = lax.rem(step, c.num_stages)
    _wait_all(w.produced, slot)
    mine = _opaque_warpgroup(w.wg, step)
    s, dp = _two_products(w.tile, w.q_all.at[mine], k_ring.at[slot], w.do_all.at[mine],
                          v_ring.at[slot])
    poison = plgpu.load(poison_ring.at[slot], layout=_COLS)
    allowed, bias, score_mod = _dq_allowed(w, item, j, slot, rules)
    row_max, log_sum, delta = item.stats
    p, capped, slope = _probs(cfg, s, w.rows_of, row_max, log_sum, allowed, bias,
                              lax.broadcast_in_dim(poison, w.tile, (1,)), score_mod)
    if item.drop is not None:  # dropout: dP dropped as the forward dropped P
        dp = item.drop(dp, item.q_start + w.query_offsets(), j * c.block_kv + w.key_offsets(), 0)
    ds, dqk = _logits_gradient(p, dp, capped, w.rows_of, delta,
                               _excludes(cfg, rules, item.query_ids is not None, g.has_mask),
                               slope)
    dq = _accumulate(dq, dqk.astype(g.dtype), k_ring.at[slot], w.interpreted)
    if g.write_dbias:  # dS, without the soft cap's factor
        rows = pl.ds(item.q_start, c.block_q)
        _write_dbias(w.refs["dbias"].at[item.b, item.head, rows, pl.ds(j * c.block_kv, c.block_kv)],
                     w.pairwise[0].at[slot, w.own_rows], ds, w.interpreted)
    plgpu.barrier_arrive(w.consumed.at[slot])
    return dq, step + 1


def _dq_item(w: _DqWarpgroup, pair, head, b, step):
    """One work item: the warpgroup's query rows against every key tile they may see, walked
    as the producer streams them (``TileWalk``); dQ out."""
    cfg, g, refs, c, wg = w.cfg, w.g, w.refs, w.g.config, w.wg
    q_len, kv_len = refs["q_len"][b], refs["kv_len"][b]
    offset = None if refs["offset"] is None else refs["offset"][b]
    cta_start = pair * CONSUMERS * c.block_q
    q_start = cta_start + wg * c.block_q
    rows = pl.ds(q_start, c.block_q)
    for src, dst, barrier in zip(
            (refs["q"].at[b, rows, head], refs["do"].at[b, rows, head],
             refs["row_max"].at[b, head, rows], refs["log_sum"].at[b, head, rows],
             refs["delta"].at[b, head, rows]),
            (w.q_own, w.do_own, *(ref.at[wg] for ref in w.row_vectors)), w.own_loaded):
        plgpu.copy_gmem_to_smem(src, dst, barrier.at[wg])
    lo, hi = masking.kv_block_range(cfg.mask, cta_start, CONSUMERS * c.block_q, c.block_kv,
                                    q_len, kv_len, offset)
    bounds = band_bounds(lo, hi, masking.kv_block_split(cfg.mask, q_start, c.block_q,
                                                        c.block_kv, q_len, kv_len, offset))
    _wait_all(w.own_loaded, wg)
    stats = tuple(plgpu.load(ref.at[wg], layout=_ROWS) for ref in w.row_vectors)
    # The tile's own query ids once per item, by a plain load (2 per thread).
    query_ids = None if w.kv_ids_ring is None else plgpu.load(
        refs["q_ids"].at[b, rows], layout=_ROWS, optimized=False)
    zeros = plgpu.layout_cast(jnp.zeros((c.block_q, g.head_dim), jnp.float32),
                              plgpu.Layout.WGMMA)
    drop = _dropout(cfg, refs, b, head)
    item = _DqItem(b, head, q_start, q_len, kv_len, offset, stats, query_ids, drop,
                   tile_mods(cfg, b, head, refs["mod_aux"], g.mod_aux_types, gradient=True))
    dq, step = TileWalk.of(_tile_lists(refs), bounds, b, head, pair).visit(
        functools.partial(_dq_tile, w, item), _pass_step(w.produced, w.consumed, c.num_stages),
        (zeros, step))
    w.q_own[...] = (dq * cfg.scale).astype(g.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(w.q_own, refs["dq"].at[b, rows, head])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the next item's Q lands there
    return step


def _dq_consumer(cfg, g: Geometry, order, refs, smem, barriers, interpreted):
    """A dQ compute warpgroup: its query rows of each item against the streamed key tiles."""
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    w = _DqWarpgroup.create(cfg, g, refs, smem, barriers, interpreted)
    order.loop(lax.axis_index("cta"), functools.partial(_dq_item, w), jnp.int32(0))


def _write_dbias(target, stage, ds, interpreted: bool):
    """One tile of dS into the zeroed float32 dbias in global memory: through ``stage``, the
    warpgroup's rows of the float32 bias tile it has just read (its ring slot, not released
    yet), by a TMA store that has read the stage before the slot is released. Each (head,
    query, key) tile is written by one warpgroup once: bitwise repeatable. Interpreted, a plain
    store (the interpreter runs one CTA at a time)."""
    if interpreted:
        target[...] = ds
        return
    stage[...] = ds
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(stage, target)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _dq_walk(cfg, g: Geometry, refs):
    c = g.config

    def walk(pair, head, b):
        offset = None if refs["offset"] is None else refs["offset"][b]
        lo, hi = masking.kv_block_range(cfg.mask, pair * CONSUMERS * c.block_q,
                                        CONSUMERS * c.block_q, c.block_kv, refs["q_len"][b],
                                        refs["kv_len"][b], offset)
        return 1, lambda _: TileWalk.of(_tile_lists(refs), (lo, hi), b, head, pair).streamed()

    def copies(pair, head, b, _, j, slot, smem, produced):
        k_ring, v_ring, poison_ring = smem[5:8]
        _, ids_ring, pairwise, _ = _unpack_extras(g, smem[8:])
        kv_head = lax.div(head, g.groups)
        keys = pl.ds(j * c.block_kv, c.block_kv)
        ids = ((refs["kv_ids"].at[b, keys],), (ids_ring,)) if g.has_segments else ((), ())
        rows = pl.ds(pair * CONSUMERS * c.block_q, CONSUMERS * c.block_q)
        for src, dst, barrier in zip(
                (refs["k"].at[b, keys, kv_head], refs["v"].at[b, keys, kv_head],
                 refs["key_poison"].at[b, kv_head, keys], *ids[0],
                 *_pairwise_sources(g, refs, b, head, rows, keys)),
                (k_ring, v_ring, poison_ring, *ids[1], *pairwise), produced):
            plgpu.copy_gmem_to_smem(src, dst.at[slot], barrier.at[slot])

    return walk, copies


# --- The calls --------------------------------------------------------------------------------

# "bias" and "mask": [Bx, Hx, Lq, Lk] for dQ, transposed ([Bx, Hx, Lk, Lq]) for dK/dV.
# "counts" ... "full_indices": the tile lists (common.tile_lists), dK/dV's transposed.
_LISTS = ("counts", "indices", "full_counts", "full_indices")
_DKDV_INPUTS = ("q", "do", "k", "v", "q_len", "kv_len", "offset", "row_max", "log_sum", "delta",
                "q_ids", "kv_ids", "seeds", "dropout_offset", "key_poison", "bias", "mask",
                *_LISTS, "dq_sum")
_DQ_INPUTS = ("q", "do", "k", "v", "q_len", "kv_len", "offset", "row_max", "log_sum", "delta",
              "key_poison", "q_ids", "kv_ids", "seeds", "dropout_offset", "bias", "mask",
              *_LISTS, "dbias")


def _aux_names(g: Geometry) -> list[str]:
    """The kernels' names of the mod_aux operands."""
    return [f"mod_aux{i}" for i in range(len(g.mod_aux_types))]


def _kernel(cfg, g: Geometry, inputs: dict, names, out_type, out_names, scratch, consumer,
            walk_of, order: WorkOrder, interpret, name: str):
    present = [n for n in (*names, *_aux_names(g)) if inputs.get(n) is not None]
    interpreted = interpret is not None

    def entry(*refs):
        refs = dict(zip(present + list(out_names), refs))
        refs["mod_aux"] = tuple(refs.pop(name) for name in _aux_names(g))
        for optional in ("offset", "q_ids", "kv_ids", "seeds", "dropout_offset", "key_poison",
                         "bias", "mask", *_LISTS, "dq_sum", "dbias"):
            refs.setdefault(optional, None)
        walk, copies = walk_of(cfg, g, refs)

        def body(smem, barriers):
            wg = lax.axis_index("wg")
            pl.when(wg < CONSUMERS)(lambda: consumer(cfg, g, order, refs, smem, barriers,
                                                     interpreted))
            streamed = (5 if name == "dkdv" else 3) + g.streamed
            produced, consumed = barriers[-1 - streamed:-1], barriers[-1]
            pl.when(wg == _MEMORY_WARPGROUP)(lambda: _producer(
                order, g.config.num_stages, walk,
                lambda *a: copies(*a, smem, produced), consumed))

        tiles, barriers = scratch(g)
        pl.run_scoped(lambda *scoped: body(scoped[:len(tiles)], scoped[len(tiles):]),
                      *tiles, *barriers, collective_axes="wg")

    kernel = plgpu.kernel(
        entry, out_type=out_type, grid=(order.num_ctas,), grid_names=("cta",),
        num_threads=CONSUMERS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **({} if interpret is None else {"interpret": interpret}))
    operands = [inputs[n] for n in present]
    return vma.like(kernel(*operands), vma.axes_of(*operands))  # as forward_call's outputs


def backward_call(cfg: AttentionConfig, config: BackwardConfig, q, k, v, d_out, stats, delta,
                  q_len, kv_len, offset=None, q_segment_ids=None, kv_segment_ids=None,
                  seeds=None, dropout_offset=None, bias=None, mask=None, *, block_mask=None,
                  mod_aux=(), num_sms: int | None = None, interpret=None):
    """q/d_out [B, Lq, Hq, D], k/v [B, Lk, Hkv, D] (16-bit), stats RowStats [B, Hq, Lq] f32,
    delta [B, Hq, Lq] f32, segment ids [B, Lq] and [B, Lk] int32 or None, dropout seeds
    [Bs, Hs] uint32 and their offset [2] int32 (or None; read only with ``cfg.dropout_rate``),
    a bias [Bb, Hb, Lq, Lk] float and a mask [Bm, Hm, Lq, Lk] bool (True: may attend) or None
    (Bx in {1, B}, Hx in {1, Hq}) -> (dq, dk, dv) in the operands' dtypes and dS [B, Hq, Lq,
    Lk] float32, the bias's gradient before its broadcast is summed (``cfg.bias_gradient``;
    else None). With segment ids, a ``block_mask`` or a mod, each kernel walks the lists of
    its CTAs' non-empty tiles (``common.tile_lists``) instead of the band."""
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    write_dbias = bias is not None and cfg.bias_gradient
    if write_dbias and config.dq == "fused":
        raise ValueError("BackwardConfig(dq='fused') has no dQ kernel to write dbias")
    if bias is not None and (jnp.dtype(bias.dtype).itemsize > 4 or write_dbias):
        # As the forward reads it; with dbias, dQ's bias tile is the stage of its dS tile.
        bias = bias.astype(jnp.float32)
    mask = None if mask is None else mask.astype(jnp.int8)  # TMA moves no 1-bit elements
    dq_pairwise, dkdv_pairwise = _pairwise_operands(bias, mask)
    batch, lq, heads, head_dim = q.shape
    lk, kv_heads = k.shape[1], k.shape[2]
    listed = masking.MaskInputs(q_len, kv_len, q_segment_ids, kv_segment_ids, None, offset,
                                block_mask)
    dq_lists = tile_lists(cfg, listed, lq, lk, CONSUMERS * config.block_q, config.block_kv)
    dkdv_lists = tile_lists(cfg, listed, lq, lk, config.block_q, CONSUMERS * config.block_kv,
                            transposed=True)
    dq_lists, dkdv_lists = (None if x is None else dict(zip(_LISTS, x))
                            for x in (dq_lists, dkdv_lists))
    cfg = dataclasses.replace(cfg, mask=masking.with_padding(
        cfg.mask, queries_padded=lq % (CONSUMERS * config.block_q) != 0,
        keys_padded=lk % (CONSUMERS * config.block_kv) != 0))
    query_poison, key_poison, q, k, v, poisoned_k, d_out = _finite_operands(q, k, v, d_out)
    g = Geometry(batch, q.shape[1], k.shape[1], heads, kv_heads, head_dim, jnp.dtype(q.dtype),
                 config, has_segments=q_segment_ids is not None,
                 bias_dtype=None if bias is None else jnp.dtype(bias.dtype),
                 has_mask=mask is not None, write_dbias=write_dbias,
                 mod_aux_types=mod_aux_types(mod_aux if cfg.has_mods else ()))
    per_query = CONSUMERS * config.block_q
    row_max = _pad_last(stats.max + query_poison, per_query, jnp.inf)
    log_sum = _pad_last(stats.log_sum, per_query, 0.0)
    delta = _pad_last(delta.astype(jnp.float32), per_query, 0.0)
    key_poison = _pad_last(key_poison, CONSUMERS * config.block_kv, 0.0)
    q_ids, kv_ids = _segment_operands(q_segment_ids, kv_segment_ids, config)
    sms = {} if num_sms is None else {"num_sms": num_sms}

    if not cfg.dropout_rate:
        seeds = dropout_offset = None
    elif seeds is None:
        raise ValueError(f"dropout_rate={cfg.dropout_rate} needs the dropout seeds")
    common = dict(q=q, do=d_out, v=v, q_len=q_len, kv_len=kv_len, offset=offset,
                  row_max=row_max, log_sum=log_sum, delta=delta, q_ids=q_ids, kv_ids=kv_ids,
                  seeds=None if seeds is None else seeds.astype(jnp.uint32),
                  dropout_offset=None if dropout_offset is None else dropout_offset.astype(jnp.int32),
                  **{name: mod_aux_operand(x) for name, x in zip(_aux_names(g), mod_aux)})
    kv_struct = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    order = WorkOrder.create(g.kv_pairs, kv_heads, batch, masking.later_key_tiles_heavier(cfg.mask),
                             True, **sms)
    g_dkdv = dataclasses.replace(g, write_dbias=False, bias_dtype=None if bias is None
                                 else jnp.dtype(jnp.float32))
    dkdv_pairwise = dict(dkdv_pairwise, **(dkdv_lists or {}))
    if config.dq == "fused":
        return (*_fused_call(cfg, g_dkdv, dict(common, **dkdv_pairwise), k, v, key_poison,
                             order, interpret, lq, lk), None)
    dk, dv = _kernel(cfg, g_dkdv, dict(common, k=poisoned_k, **dkdv_pairwise), _DKDV_INPUTS,
                     (kv_struct(k), kv_struct(v)), ("dk", "dv"), _dkdv_scratch, _dkdv_consumer,
                     _dkdv_walk, order, interpret, "dkdv")
    order = WorkOrder.create(g.q_pairs, heads, batch, masking.later_query_tiles_heavier(cfg.mask),
                             True, **sms)
    if interpret is not None:
        # One interpreted kernel at a time: XLA may start both callbacks at once, and two
        # interpreted kernels walking their CTAs side by side deadlock (seen with jax 0.11.2).
        dk, dv, common, k, key_poison, dq_pairwise = lax.optimization_barrier(
            (dk, dv, common, k, key_poison, dq_pairwise))
    dbias = None
    if write_dbias:
        # Zeros where no tile is written (the band's and the lengths' skipped tiles); whole
        # tiles, so that no store is clipped. Unvarying inside shard_map, as _fused_call's dQ.
        dbias = jax.new_ref(jnp.zeros((batch, heads, g.q_pairs * per_query,
                                       -(-g.lk // config.block_kv) * config.block_kv),
                                      jnp.float32))
    dq = _kernel(cfg, g, dict(common, k=k, key_poison=key_poison, dbias=dbias, **dq_pairwise,
                              **(dq_lists or {})),
                 _DQ_INPUTS, kv_struct(q), ("dq",), _dq_scratch, _dq_consumer, _dq_walk, order,
                 interpret, "dq")
    if dbias is not None:
        dbias = vma.like(dbias[...][:, :, :lq, :lk], vma.axes_of(k, v))
    return dq[:, :lq], dk[:, :lk], dv[:, :lk], dbias


def _pairwise_operands(bias, mask):
    """The bias and (int8) mask as each kernel streams them: ``{"bias": .., "mask": ..}`` for
    dQ and for dK/dV (None where absent). dQ's tiles are (queries, keys) as given; dK/dV's are
    (keys, queries): one XLA transpose, to float32 (a 16-bit bias converted in dK/dV's
    registers spilled 12-16 bytes at D=128; float32 none). The last axis padded to 16 bytes
    (TMA strides); the padded pairs lie past the lengths."""
    dq_pairwise = {name: None if x is None else rows_of_sixteen_bytes(x)
                   for name, x in (("bias", bias), ("mask", mask))}
    dkdv_pairwise = {name: None if x is None else rows_of_sixteen_bytes(jnp.swapaxes(x, 2, 3))
                     for name, x in (("bias", None if bias is None else bias.astype(jnp.float32)),
                                     ("mask", mask))}
    return dq_pairwise, dkdv_pairwise


def _finite_operands(q, k, v, d_out):
    """The non-finite rule (the module's docstring), one XLA pass: (query poison [B, Hq, Lq],
    key poison [B, Hkv, Lk], then q, k, v with their non-finite entries 0, K with its keys'
    poison, and d_out in q's dtype, those five with Lq and Lk padded to multiples of 8)."""
    query_poison = online_softmax.row_poison(q).transpose(0, 2, 1)       # [B, Hq, Lq]
    key_poison = online_softmax.key_poison(k, v).transpose(0, 2, 1)      # [B, Hkv, Lk]
    q, k, v = map(online_softmax.finite_or_zero, (q, k, v))
    poisoned_k = k + online_softmax.per_row(key_poison.transpose(0, 2, 1)).astype(k.dtype)
    d_out = d_out.astype(q.dtype)
    pad_rows = lambda x: jnp.pad(x, ((0, 0), (0, -x.shape[1] % ROW_MULTIPLE), (0, 0), (0, 0)))
    q, d_out, k, v, poisoned_k = map(pad_rows, (q, d_out, k, v, poisoned_k))
    return query_poison, key_poison, q, k, v, poisoned_k, d_out


def _pad_last(x, multiple: int, value):
    """``x`` [B, H, L] with L padded with ``value`` to a multiple of ``multiple``."""
    return jnp.pad(x, ((0, 0), (0, 0), (0, -x.shape[-1] % multiple)), constant_values=value)


def _segment_operands(q_segment_ids, kv_segment_ids, config: BackwardConfig):
    """The segment ids as the kernels read them (int32, whole CTAs, as the row vectors: every id
    a TMA copy or a load reads exists), or (None, None). The padded rows and keys lie past the
    lengths (the length rule is on there, and those tiles are always masked ones); distinct
    fills keep them apart all the same."""
    if q_segment_ids is None:
        return None, None
    pad_ids = lambda ids, multiple, fill: _pad_last(ids.astype(jnp.int32)[:, None], multiple,
                                                    fill)[:, 0]
    return (pad_ids(q_segment_ids, CONSUMERS * config.block_q, -1),
            pad_ids(kv_segment_ids, CONSUMERS * config.block_kv, -2))


def _fused_call(cfg, g: Geometry, common, k, v, key_poison, order, interpret, lq, lk):
    """``dq="fused"``: the dK/dV kernel alone, adding dS K into a zero-initialised fp32 dQ (a
    mutable operand: the kernel's reduce-adds land in it), whose scale and cast are one XLA
    pass after it. Its rows cover whole CTAs of queries, so no reduce-add is clipped."""
    rows = g.q_pairs * CONSUMERS * g.config.block_q
    copies = () if interpret is None else (CONSUMERS,)  # one per warpgroup: _add_fused_dq
    # Unvarying inside shard_map (jax 0.11's kernels refuse a varying Ref): dQ is marked
    # varying once read, below.
    dq_sum = jax.new_ref(jnp.zeros((*copies, g.batch, rows, g.heads, g.head_dim), jnp.float32))
    kv_struct = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    dk, dv = _kernel(cfg, g, dict(common, k=k, key_poison=key_poison, dq_sum=dq_sum),
                     _DKDV_INPUTS, (kv_struct(k), kv_struct(v)), ("dk", "dv"), _dkdv_scratch,
                     _dkdv_consumer, _dkdv_walk, order, interpret, "dkdv")
    dq = dq_sum[...]
    if interpret is not None:
        dq = dq.sum(0)
    dq = vma.like((dq[:, :lq] * cfg.scale).astype(g.dtype), vma.axes_of(k, v))
    return dq, dk[:, :lk], dv[:, :lk]
