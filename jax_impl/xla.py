"""Blocked attention in plain JAX: the same online-softmax algorithm as the Pallas kernels.

Memory is linear in the sequence length: the largest temporary is one logits tile
``[B, heads of one step, block_q, block_k]`` per chain: the heads run one block after another
(``kv_heads_per_step``), so that each step's tiles stay in the CPU's caches, in one
independent chain of blocks per host thread (``_over_head_blocks``). Loops are
``fori_loop``s with bounds from ``masking.kv_block_range``/``q_block_range``, so tiles the
causal/window/length structure rules out are skipped. The forward saves only (out, row
statistics); the backward recomputes P tile by tile.

With segment ids or a block_mask the loops instead walk lists of the key (query) tiles that
``block_mask.tile_classes`` says are not empty, one list per step (the union over the step's
batch rows and heads): the partial tiles masked, the full ones not. score_mod and mask_mod
(``mods``) are evaluated on each tile with its global indices; the backward sums the
cotangents of the floating ``mod_aux`` over the tiles in loop order.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_impl import block_mask as block_mask_lib
from jax_impl import dropout_sinks, masking, mods, online_softmax, platform, vma
from jax_impl.config import AttentionConfig

# Chunk sizes (block_q, block_k) of the XLA path, from measurements on the 2-core CPU against
# torch SDPA (B=1 H=8 D=64 fp32; benchmarks/README.md, "CPU: where the time goes"). XLA:CPU's
# matmul is efficient only on large products (a 512x256 tile's q.k^T ran at ~60 GFLOP/s where a
# 256x2048 one ran at 120-170), so a call with no causal or window band takes rows of up to 2048
# keys (a 256 x 2048 float32 tile is 2 MiB, one core's L2): forward+backward 2.6x -> 1.6x torch
# at L=2048 and 8192. Banded calls keep 256-key tiles, so that the tiles outside the band are
# skipped (2048-key rows ran causal calls 1.5-2x slower). The temporaries stay one tile per
# step whatever L is: memory linear in L.
DENSE_BLOCKS = (256, 2048)
BANDED_BLOCKS = (512, 256)


# (batch row, query head) pairs one loop step covers: the heads run one block after another
# (lax.map), so a step's [pairs, block_q, block_k] tiles stay in the caches. 1 measured fastest
# of 1, 2 and 8 (B=1 H=8 L=2048 D=64 fp32, single-thread CPU time against torch SDPA; forward
# 1.42x vs 1.58x vs 1.68x, forward+backward 1.82x vs 1.85x vs 2.4x; benchmarks/README.md,
# "CPU: where the time goes"). With 2 threads, 1, 2 and 8 were within each other's spread.
HEADS_PER_STEP = 1
CHAIN_MIN_PAIRS = 512 * 512  # (query, key) pairs per head from which heads run in chains (_over_head_blocks)


def kv_heads_per_step(batch: int, kv_heads: int, groups: int) -> int:
    """The largest divisor of ``kv_heads`` whose step covers at most ``HEADS_PER_STEP``
    (batch row, query head) pairs; at least one kv head with its query group."""
    fits = [n for n in range(1, kv_heads + 1)
            if kv_heads % n == 0 and batch * groups * n <= HEADS_PER_STEP]
    return max(fits, default=1)


def _split_heads(x, axis: int, blocks: int):  # [..., H, ...] -> [blocks, ..., H / blocks, ...]
    shape = x.shape[:axis] + (blocks, x.shape[axis] // blocks) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _merge_heads(x, axis: int):  # [blocks, ..., H / blocks, ...] -> [..., H, ...]
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def _over_head_blocks(fn, q, k, operands, head_axes):
    """``fn(*operands)`` as one call per block of consecutive kv heads with their query heads,
    in a ``lax.map``; returns its outputs stacked ``[blocks, ...]`` (``_merge_heads`` undoes it),
    or ``None`` when one block holds every head (then call ``fn`` directly).

    ``head_axes``: each operand's head axis (a pytree prefix of ``operands``); an operand whose
    axis is None, or whose head axis has size 1 (broadcast over heads), is shared by every block.
    """
    b, _, hq, _ = q.shape
    hkv = k.shape[2]
    blocks = hkv // kv_heads_per_step(b, hkv, hq // hkv)
    if blocks == 1:
        return None
    leaves, tree = jax.tree.flatten(operands, is_leaf=lambda x: x is None)
    axes = tree.flatten_up_to(head_axes)
    split = [x is not None and a is not None and x.shape[a] > 1 for x, a in zip(leaves, axes)]
    stacked = [_split_heads(x, a, blocks) for x, a, s in zip(leaves, axes, split) if s]

    def step(block):
        block = iter(block)
        return fn(*tree.unflatten([next(block) if s else x for x, s in zip(leaves, split)]))

    # Independent chains of blocks, one per host thread: XLA:CPU runs independent loops
    # concurrently (its thunk executor launches whatever is ready), where one loop's small
    # per-tile ops keep fewer threads busy. Short sequences keep one chain: a head's work
    # there (under a millisecond) does not repay compiling the loop once per chain.
    threads = platform.host_threads() if q.shape[1] * k.shape[1] >= CHAIN_MIN_PAIRS else 1
    chains = max(c for c in range(1, min(blocks, threads) + 1) if blocks % c == 0)
    if chains == 1:
        return lax.map(step, stacked)
    parts = [lax.map(step, [x.reshape(chains, blocks // chains, *x.shape[1:])[c] for x in stacked])
             for c in range(chains)]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def chunk_sizes(cfg: AttentionConfig, lq: int, lk: int, masks: masking.MaskInputs | None = None
                ) -> tuple[int, int]:
    """(block_q, block_k); calls whose tiles can be skipped (a band, segment ids, a
    block_mask) take the banded blocks."""
    if cfg.block_sizes:
        block_q, block_k = cfg.block_sizes.block_q, cfg.block_sizes.block_k
    else:
        sparse = (cfg.mask.has_band or cfg.mask.has_block_mask
                  or (masks is not None and masks.q_segment_ids is not None))
        block_q, block_k = BANDED_BLOCKS if sparse else DENSE_BLOCKS
    return min(block_q, lq), min(block_k, lk)


def _pad_axis(x, axis: int, size: int):
    if x is None or x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


class _Tiles:
    """Padded operands and per-tile accessors shared by the forward and backward loops."""

    def __init__(self, cfg, q, k, v, bias, masks, block_q, block_k, extras=None, classes=None,
                 heads=None):
        self.cfg, self.block_q, self.block_k = cfg, block_q, block_k
        b, lq, hq, d = q.shape
        self.lq, self.lk = lq, k.shape[1]
        # block_mask.tile_classes of these tiles ([Bc, Hc, nq, nk]) or None (the band loops);
        # the step's global query heads [Hq] (mods' h).
        self.classes = classes
        self.heads = jnp.arange(hq, dtype=jnp.int32) if heads is None else heads
        lk, hkv = k.shape[1], k.shape[2]
        self.b, self.hq, self.hkv, self.groups = b, hq, hkv, hq // hkv
        self.lq_pad, self.lk_pad = _round_up(lq, block_q), _round_up(lk, block_k)
        self.spec = masking.with_padding(cfg.mask, queries_padded=self.lq_pad != lq,
                                         keys_padded=self.lk_pad != lk)
        # The non-finite rule (online_softmax), once per call: every product reads q, k and v
        # with their non-finite entries as 0, and every tile adds the NaN-or-0 poison of its
        # query rows and key rows to its logits (rows of padding: 0).
        q_poison = _pad_axis(online_softmax.row_poison(q), 1, self.lq_pad)  # [B, Lq_pad, Hq]
        self.q_poison = jnp.moveaxis(q_poison.reshape(b, self.lq_pad, hkv, self.groups), 1, 3)
        kv_poison = _pad_axis(online_softmax.key_poison(k, v), 1, self.lk_pad)  # [B, Lk_pad, Hkv]
        self.kv_poison = jnp.swapaxes(kv_poison, 1, 2)  # [B, Hkv, Lk_pad]
        q, k, v = map(online_softmax.finite_or_zero, (q, k, v))
        # Head-major layout, transposed once: each tile's einsum is then a plain batched matmul.
        self.q = self.to_heads(_pad_axis(q, 1, self.lq_pad))            # [B, Hkv, G, Lq_pad, D]
        self.k = jnp.swapaxes(_pad_axis(k, 1, self.lk_pad), 1, 2)        # [B, Hkv, Lk_pad, D]
        self.v = jnp.swapaxes(_pad_axis(v, 1, self.lk_pad), 1, 2)
        # K^T and V^T, the right operands of S = Q K^T and dP = dO V^T: transposed once here, so
        # that no tile's product transposes a copy of its operand (XLA:CPU's dot would).
        self.k_t, self.v_t = (jnp.swapaxes(x, 2, 3) for x in (self.k, self.v))  # [B, Hkv, D, Lk_pad]
        self.bias = None if bias is None else _pad_axis(_pad_axis(bias, 2, self.lq_pad), 3, self.lk_pad)
        self.q_len = masks.q_len[:, None, None, None, None]     # [B, 1, 1, 1, 1]
        self.kv_len = masks.kv_len[:, None, None, None, None]
        self.offset = (None if masks.position_offset is None
                       else masks.position_offset[:, None, None, None, None])
        self.q_seg = _pad_axis(masks.q_segment_ids, 1, self.lq_pad)
        self.kv_seg = _pad_axis(masks.kv_segment_ids, 1, self.lk_pad)
        self.mask = None if masks.mask is None else _pad_axis(
            _pad_axis(masks.mask, 2, self.lq_pad), 3, self.lk_pad)
        self.masks = masks
        extras = extras or dropout_sinks.SinksAndDropout()
        # [Bs, Hs] -> [Bs, Hkv|1, G|1]: per-(batch, head) sinks and dropout seeds.
        self.sinks, self.seeds = (None if x is None else self.per_head(x)
                                  for x in (extras.sinks, extras.dropout_seeds))
        self.dropout_offset = extras.dropout_offset  # a ring step: global index of local 0
        self.mod_aux = extras.mod_aux

    def per_head(self, x):  # [Bs, Hq|1] -> [Bs, Hkv|1, G|1]
        return x.reshape(x.shape[0], self.hkv, self.groups) if x.shape[1] > 1 else x[:, :, None]

    def keep(self, i, j):
        """Dropout's keep mask ``[Bs, Hkv|1, G|1, bq, bk]`` of query tile i and key tile j
        (dropout_sinks.keep), or None without dropout."""
        if not self.cfg.dropout_rate:
            return None
        rows = (i * self.block_q + jnp.arange(self.block_q, dtype=jnp.int32))[:, None]
        cols = (j * self.block_k + jnp.arange(self.block_k, dtype=jnp.int32))[None, :]
        if self.dropout_offset is not None:
            rows, cols = rows + self.dropout_offset[0], cols + self.dropout_offset[1]
        keep = dropout_sinks.keep(self.seeds[..., None, None], rows, cols, self.cfg.dropout_rate)
        # Materialised once per tile: fused into its consumers, XLA would recompute the hash
        # for every (batch, head) that a broadcast pattern shares.
        return lax.optimization_barrier(keep)

    def to_heads(self, x):  # [B, L, Hq, D] -> [B, Hkv, G, L, D]
        b, length, _, d = x.shape
        return jnp.moveaxis(x.reshape(b, length, self.hkv, self.groups, d), 1, 3)

    def from_heads(self, x):  # [B, Hkv, G, L, D] -> [B, L, Hq, D]
        b, _, _, length, d = x.shape
        return jnp.moveaxis(x, 3, 1).reshape(b, length, self.hq, d)

    def q_tile(self, x, i):  # [B, Hkv, G, Lq_pad, D] -> [B, Hkv, G, block_q, D]
        return lax.dynamic_slice_in_dim(x, i * self.block_q, self.block_q, axis=3)

    def kv_tile(self, x, j):  # [B, Hkv, Lk_pad, D] -> [B, Hkv, block_k, D]
        return lax.dynamic_slice_in_dim(x, j * self.block_k, self.block_k, axis=2)

    def kv_tile_t(self, x, j):  # [B, Hkv, D, Lk_pad] -> [B, Hkv, D, block_k]
        return lax.dynamic_slice_in_dim(x, j * self.block_k, self.block_k, axis=3)

    def _pair_tile(self, x, i, j):  # [X, H, Lq_pad, Lk_pad] -> [X, Hkv|1, G|1, bq, bk]
        tile = lax.dynamic_slice(x, (0, 0, i * self.block_q, j * self.block_k),
                                 (x.shape[0], x.shape[1], self.block_q, self.block_k))
        heads = (self.hkv, self.groups) if x.shape[1] > 1 else (1, 1)
        return tile.reshape(x.shape[0], *heads, self.block_q, self.block_k)

    def mod_indices(self, i, j):
        """The mods' (b, h, q_idx, kv_idx) of tile (i, j), broadcasting to ``[B, Hkv, G, bq,
        bk]``; positions past Lq or Lk (padding, masked) read as the last valid one."""
        rows = jnp.minimum(i * self.block_q + jnp.arange(self.block_q, dtype=jnp.int32), self.lq - 1)
        cols = jnp.minimum(j * self.block_k + jnp.arange(self.block_k, dtype=jnp.int32), self.lk - 1)
        return (jnp.arange(self.b, dtype=jnp.int32).reshape(-1, 1, 1, 1, 1),
                self.heads.reshape(1, self.hkv, self.groups, 1, 1),
                rows.reshape(1, 1, 1, -1, 1), cols.reshape(1, 1, 1, 1, -1))

    def scored(self, s, i, j):
        """The logits S of tile (i, j) after the score_mod (S itself without one)."""
        return mods.score(self.cfg, s, *self.mod_indices(i, j), self.mod_aux)

    def logits(self, q_tile, i, j, masked: bool):
        """(S before any score_mod, soft-cap term, allowed or None) ``[B, Hkv, G, bq, bk]`` for
        query tile i (``q_tile``) and key tile j.

        ``masked=False``: the tile lies inside the band for every batch row (kv_range/q_range),
        so the structural rules are not evaluated; on the tile lists (``classes``) it is a full
        tile, where segment ids and mask_mod are not evaluated either. Every tile, masked or
        not, adds the poison of the non-finite rule (the operands are finite already:
        ``__init__``), and a dense mask applies.
        """
        rows = (i * self.block_q + jnp.arange(self.block_q, dtype=jnp.int32))[:, None]
        cols = (j * self.block_k + jnp.arange(self.block_k, dtype=jnp.int32))[None, :]
        segments = (None, None)
        if self.q_seg is not None and masked:  # [B, 1, 1, bq], [B, 1, 1, bk]
            segments = (lax.dynamic_slice_in_dim(self.q_seg, i * self.block_q, self.block_q, 1)[:, None, None],
                        lax.dynamic_slice_in_dim(self.kv_seg, j * self.block_k, self.block_k, 1)[:, None, None])
        allowed = masking.allowed(self.spec, rows, cols, self.q_len, self.kv_len, *segments,
                                  None if self.mask is None else self._pair_tile(self.mask, i, j),
                                  structural=masked, position_offset=self.offset)
        if masked or self.classes is None:  # without a block_mask every tile evaluates it
            allowed = masking.all_of([allowed, mods.allowed(self.cfg, *self.mod_indices(i, j),
                                                            self.mod_aux)])
        qk = jnp.einsum("bhgqd,bhdk->bhgqk", q_tile, self.kv_tile_t(self.k_t, j),
                        precision=self.cfg.precision, preferred_element_type=jnp.float32)
        bias = None if self.bias is None else self._pair_tile(self.bias, i, j)
        q_poison = lax.dynamic_slice_in_dim(self.q_poison, i * self.block_q, self.block_q, axis=3)
        kv_poison = lax.dynamic_slice_in_dim(self.kv_poison, j * self.block_k, self.block_k, axis=2)
        s, capped = online_softmax.logits(qk, self.cfg, bias,
                                          q_poison[..., :, None] + kv_poison[:, :, None, None, :])
        return s, capped, allowed

    def key_tile_loop(self, i, body, carry):
        """``body(j, carry, masked)`` over query tile i's key tiles: the band's (``kv_range``),
        or the lists of ``classes``."""
        if self.classes is None:
            return masking.split_fori_loop(self.kv_range(i), body, carry)
        return _list_loop(self.classes[:, :, i, :], body, carry)

    def query_tile_loop(self, j, body, carry):
        """``body(i, carry, masked)`` over key tile j's query tiles (``key_tile_loop``'s mirror)."""
        if self.classes is None:
            return masking.split_fori_loop(self.q_range(j), body, carry)
        return _list_loop(self.classes[:, :, :, j], body, carry)

    def kv_range(self, i):
        """Key tiles for query tile i, (lo, full_lo, full_hi, hi): the union over the batch of
        each row's range, unmasked only where every row's tile is inside its band."""
        return _across_batch(masking.kv_block_split(
            self.spec, i * self.block_q, self.block_q, self.block_k, self.masks.q_len,
            self.masks.kv_len, self.masks.position_offset))

    def q_range(self, j):
        return _across_batch(masking.q_block_split(
            self.spec, j * self.block_k, self.block_k, self.block_q, self.masks.q_len,
            self.masks.kv_len, self.masks.position_offset))


def _list_loop(classes, body, carry):
    """``body(t, carry, masked)`` over the tiles of one row of tile classes ``[Bc, Hc, n]``
    that any batch row or head of the step visits: the partial ones masked, then the ones full
    for every batch row and head unmasked."""
    visited = (classes != block_mask_lib.EMPTY).any((0, 1))
    full = (classes == block_mask_lib.FULL).all((0, 1))
    for selected, masked in ((visited & ~full, True), (full, False)):
        count, tiles = block_mask_lib.index_lists(selected)
        carry = lax.fori_loop(0, count, lambda n, c, tiles=tiles, masked=masked:
                              body(tiles[n], c, masked), carry)
    return carry


def _across_batch(bounds):
    lo, full_lo, full_hi, hi = bounds  # each [B]
    lo, hi = jnp.min(lo), jnp.max(hi)
    full_lo = jnp.clip(jnp.max(full_lo), lo, hi)
    return lo, full_lo, jnp.clip(jnp.min(full_hi), full_lo, hi), hi


# Head axes of the per-head inputs besides q, k, v (_over_head_blocks): the dense mask
# [Bm, Hm, Lq, Lk]; sinks and dropout seeds [Bs, Hs].
_MASK_HEAD_AXES = masking.MaskInputs(None, None, None, None, 1, None)


def _extras_head_axes(extras: dropout_sinks.SinksAndDropout):  # mod_aux: shared by every block
    return dropout_sinks.SinksAndDropout(sinks=1, dropout_seeds=1,
                                         mod_aux=tuple(None for _ in extras.mod_aux))


def _tile_plan(cfg: AttentionConfig, q, k, masks: masking.MaskInputs):
    """(masks without the block_mask, the tile classes of the call's tiles or None, global
    query heads ``[Hq]``): what the head blocks take (classes and heads split with them)."""
    lq, lk = q.shape[1], k.shape[1]
    classes = block_mask_lib.tile_classes(cfg.mask, masks, lq, lk, *chunk_sizes(cfg, lq, lk, masks),
                                          mask_mod=cfg.mask_mod is not None)
    return masks._replace(block_mask=None), classes, jnp.arange(q.shape[2], dtype=jnp.int32)


def _exact_on_tiles(cfg: AttentionConfig, q, k, masks: masking.MaskInputs, extras):
    """(cfg, extras) for these chunks (``block_mask.on_grid``: a step walks every batch row and
    the query heads of one kv head at once, through the union of their tiles)."""
    extras = extras or dropout_sinks.SinksAndDropout()
    return block_mask_lib.on_grid(cfg, masks, extras, [chunk_sizes(cfg, q.shape[1], k.shape[1], masks)],
                                  per_row_and_head=False)


def forward(cfg: AttentionConfig, q, k, v, bias, masks: masking.MaskInputs, extras=None):
    """-> (out ``[B, Lq, Hq, D]`` in q's dtype, RowStats of ``[B, Hq, Lq]`` float32)."""
    cfg, extras = _exact_on_tiles(cfg, q, k, masks, extras)
    masks, classes, heads = _tile_plan(cfg, q, k, masks)
    stacked = _over_head_blocks(functools.partial(_forward, cfg), q, k,
                                (q, k, v, bias, masks, extras, classes, heads),
                                (2, 2, 2, 1, _MASK_HEAD_AXES, _extras_head_axes(extras), 1, 0))
    if stacked is None:
        return _forward(cfg, q, k, v, bias, masks, extras, classes, heads)
    out, stats = stacked
    return _merge_heads(out, 2), online_softmax.RowStats(*(_merge_heads(x, 1) for x in stats))


def _forward(cfg: AttentionConfig, q, k, v, bias, masks: masking.MaskInputs, extras, classes, heads):
    b, lq, hq, d = q.shape
    block_q, block_k = chunk_sizes(cfg, lq, k.shape[1], masks)
    t = _Tiles(cfg, q, k, v, bias, masks, block_q, block_k, extras, classes, heads)
    stats_shape = (b, t.hkv, t.groups, block_q)
    axes = vma.axes_of(q, k, v, bias, masks)  # inside shard_map, loop carries vary like these

    def query_tile(i, outputs):
        out, stats = outputs
        q_tile = t.q_tile(t.q, i)

        def key_tile(j, carry, masked):
            acc, row_max, row_sum = carry
            s, _, allowed = t.logits(q_tile, i, j, masked)
            s = t.scored(s, i, j)
            rescale, p, row_max, row_sum = online_softmax.online_step(row_max, row_sum, s, allowed)
            v_tile = t.kv_tile(t.v, j)
            p_drop = dropout_sinks.apply_dropout(p, t.keep(i, j), cfg.dropout_rate)  # the sum keeps p
            pv = jnp.einsum("bhgqk,bhkd->bhgqd", p_drop.astype(v.dtype), v_tile,
                            precision=cfg.precision, preferred_element_type=jnp.float32)
            return rescale[..., None] * acc + pv, row_max, row_sum

        sink = None if t.sinks is None else t.sinks[..., None]
        init = vma.like((jnp.zeros(stats_shape + (d,), jnp.float32),
                         *dropout_sinks.initial_stats(sink, stats_shape)), axes)
        acc, row_max, row_sum = t.key_tile_loop(i, key_tile, init)
        o_tile, stats_tile = online_softmax.finalize(acc, row_max, row_sum)
        out = lax.dynamic_update_slice_in_dim(out, o_tile.astype(q.dtype), i * block_q, axis=3)
        stats = [lax.dynamic_update_slice_in_dim(x, x_tile.reshape(b, hq, block_q), i * block_q, axis=2)
                 for x, x_tile in zip(stats, stats_tile)]
        return out, stats

    init = vma.like((jnp.zeros(t.q.shape, q.dtype), [jnp.zeros((b, hq, t.lq_pad), jnp.float32)] * 2), axes)
    out, stats = lax.fori_loop(0, t.lq_pad // block_q, query_tile, init)
    return t.from_heads(out)[:, :lq], online_softmax.RowStats(*(x[:, :, :lq] for x in stats))


def backward(cfg: AttentionConfig, q, k, v, bias, masks: masking.MaskInputs, stats, d_out, delta,
             extras=None):
    """-> (dq, dk, dv, dbias ``[B, Hq, Lq, Lk]`` float32 | None, d_mod_aux), one block of
    heads at a time; the blocks' d_mod_aux summed in block order."""
    entries = 0 if extras is None else len(extras.mod_aux)  # the caller's
    cfg, extras = _exact_on_tiles(cfg, q, k, masks, extras)
    masks, classes, heads = _tile_plan(cfg, q, k, masks)
    stacked = _over_head_blocks(
        functools.partial(_backward, cfg), q, k,
        (q, k, v, bias, masks, stats, d_out, delta, extras, classes, heads),
        (2, 2, 2, 1, _MASK_HEAD_AXES, online_softmax.RowStats(1, 1), 2, 1,
         _extras_head_axes(extras), 1, 0))
    if stacked is None:
        dq, dk, dv, dbias, d_mod_aux = _backward(cfg, q, k, v, bias, masks, stats, d_out, delta,
                                                 extras, classes, heads)
        return dq, dk, dv, dbias, d_mod_aux[:entries]
    dq, dk, dv, dbias, d_mod_aux = stacked
    return (*(_merge_heads(x, 2) for x in (dq, dk, dv)),
            None if dbias is None else _merge_heads(dbias, 1),
            tuple(None if x is None else jnp.sum(x, axis=0) for x in d_mod_aux[:entries]))


def _backward(cfg: AttentionConfig, q, k, v, bias, masks: masking.MaskInputs, stats, d_out, delta,
              extras, classes, heads):
    """Algorithm 2 of FlashAttention-2: outer loop over key tiles (dK, dV in registers),
    inner loop over query tiles, dQ accumulated in place. -> (dq, dk, dv, dbias | None,
    d_mod_aux)."""
    b, lq, hq, d = q.shape
    lk = k.shape[1]
    block_q, block_k = chunk_sizes(cfg, lq, lk, masks)
    t = _Tiles(cfg, q, k, v, bias, masks, block_q, block_k, extras, classes, heads)
    grouped = lambda x: _pad_axis(x, -1, t.lq_pad).reshape(b, t.hkv, t.groups, t.lq_pad)
    delta, row_max, log_sum = grouped(delta), grouped(stats.max), grouped(stats.log_sum)
    d_out = t.to_heads(_pad_axis(d_out, 1, t.lq_pad))
    # Q^T and dO^T, the left operands of dK^T = Q^T dS and dV^T = dO^T P: with them every
    # product takes the [bq, bk] tiles as they are (no transposed copy of P or dS per tile).
    q_t, d_out_t = jnp.swapaxes(t.q, 3, 4), jnp.swapaxes(d_out, 3, 4)  # [B, Hkv, G, D, Lq_pad]
    q_tile_t = lambda x, i: lax.dynamic_slice_in_dim(x, i * block_q, block_q, axis=4)
    stats_tile = lambda x, i: lax.dynamic_slice_in_dim(x, i * block_q, block_q, axis=3)
    axes = vma.axes_of(q, k, v, bias, masks, stats, d_out, delta)  # as in forward

    def key_tile(j, grads):
        dq, dk, dv, dbias, d_mod_aux = grads
        k_tile, v_t = t.kv_tile(t.k, j), t.kv_tile_t(t.v_t, j)

        def query_tile(i, carry, masked):
            dq, dk_acc, dv_acc, dbias, d_mod_aux = carry
            do_tile = t.q_tile(d_out, i)
            unmodded, capped, allowed = t.logits(t.q_tile(t.q, i), i, j, masked)
            s = t.scored(unmodded, i, j)
            # A score_mod may give -inf, which excludes its pair as a -inf bias does.
            attended = online_softmax.attended(s, allowed, bias is not None or cfg.score_mod is not None)
            p = online_softmax.recomputed_probs(s, online_softmax.RowStats(
                stats_tile(row_max, i), stats_tile(log_sum, i)), attended)
            dp = jnp.einsum("bhgqd,bhdk->bhgqk", do_tile, v_t, precision=cfg.precision,
                            preferred_element_type=jnp.float32)
            # Dropout: dV = P_drop^T dO, and dP reaches P through the same mask.
            keep = t.keep(i, j)
            drop = lambda x: dropout_sinks.apply_dropout(x, keep, cfg.dropout_rate)
            # Excluded pairs (attended False) reach neither dS nor a mod_aux cotangent.
            score_gradient = lambda ds: mods.score_gradient(cfg, unmodded, *t.mod_indices(i, j),
                                                            t.mod_aux, ds, keep=attended)
            ds, dqk = online_softmax.logits_gradient(
                p, drop(dp), stats_tile(delta, i), capped, cfg, exclusions=attended is not None,
                score_vjp=None if cfg.score_mod is None else lambda ds: score_gradient(ds)[0])
            if any(x is not None for x in d_mod_aux):  # XLA shares the mod's work with dS's
                d_post = online_softmax.softmax_gradient(p, drop(dp), stats_tile(delta, i))
                d_post = d_post if attended is None else jnp.where(p == 0, 0.0, d_post)
                d_mod_aux = mods.add_cotangents(d_mod_aux, score_gradient(d_post)[1])
            dv_acc += jnp.einsum("bhgdq,bhgqk->bhdk", q_tile_t(d_out_t, i), drop(p).astype(v.dtype),
                                 precision=cfg.precision, preferred_element_type=jnp.float32)
            dk_acc += jnp.einsum("bhgdq,bhgqk->bhdk", q_tile_t(q_t, i), dqk.astype(q.dtype),
                                 precision=cfg.precision, preferred_element_type=jnp.float32)
            dq_tile = jnp.einsum("bhgqk,bhkd->bhgqd", dqk.astype(k.dtype), k_tile,
                                 precision=cfg.precision, preferred_element_type=jnp.float32)
            dq = lax.dynamic_update_slice_in_dim(dq, t.q_tile(dq, i) + dq_tile, i * block_q, axis=3)
            if dbias is not None:
                ds = ds.reshape(b, hq, block_q, block_k)
                dbias = lax.dynamic_update_slice(dbias, ds, (0, 0, i * block_q, j * block_k))
            return dq, dk_acc, dv_acc, dbias, d_mod_aux

        zeros = vma.like(jnp.zeros((b, t.hkv, d, block_k), jnp.float32), axes)  # dK^T, dV^T tiles
        dq, dk_tile, dv_tile, dbias, d_mod_aux = t.query_tile_loop(
            j, query_tile, (dq, zeros, zeros, dbias, d_mod_aux))
        dk = lax.dynamic_update_slice_in_dim(dk, dk_tile.astype(k.dtype), j * block_k, axis=3)
        dv = lax.dynamic_update_slice_in_dim(dv, dv_tile.astype(v.dtype), j * block_k, axis=3)
        return dq, dk, dv, dbias, d_mod_aux

    grads = vma.like((jnp.zeros(t.q.shape, jnp.float32), jnp.zeros(t.k_t.shape, k.dtype),
                      jnp.zeros(t.v_t.shape, v.dtype),
                      None if bias is None or not cfg.bias_gradient
                      else jnp.zeros((b, hq, t.lq_pad, t.lk_pad), jnp.float32),
                      mods.zero_cotangents(cfg, extras.mod_aux)),
                     axes)
    dq, dk, dv, dbias, d_mod_aux = lax.fori_loop(0, t.lk_pad // block_k, key_tile, grads)
    dq = t.from_heads(dq)[:, :lq].astype(q.dtype)
    if dbias is not None:
        dbias = dbias[:, :, :lq, :lk]
    dk, dv = (jnp.moveaxis(x, 3, 1)[:, :lk] for x in (dk, dv))  # [B, Hkv, D, Lk_pad] -> [B, Lk, Hkv, D]
    return dq, dk, dv, dbias, d_mod_aux


# --- Decode: a few query rows against a long, possibly paged, KV cache ----------------------
# Split-K (flash-decoding): the key range is cut into `splits` contiguous runs of whole tiles,
# all advanced together one tile per loop step, each keeping its own (acc, max, sum); the runs'
# partial results are merged exactly at the end (online_softmax.merge). Query-group packing:
# the G = Hq / Hkv query heads sharing a kv head, times the Lq rows, are the rows of one tile,
# so each K/V tile is read once per kv head. A dense cache is read as pages of a divisor of Lk
# (a free reshape), so one code path serves both.

DECODE_TILE_KEYS = 256        # keys per run and step (rounded to whole pages)
DECODE_STEP_PAIRS = 1 << 16   # (packed row, key) pairs per (batch row, kv head) and step (GPU)
DECODE_MAX_SPLITS = 32


def _dense_page_size(lk: int) -> int:
    """The largest divisor of lk up to DECODE_TILE_KEYS: k [B, Lk] read as whole pages."""
    return max(p for p in range(1, min(lk, DECODE_TILE_KEYS) + 1) if lk % p == 0)


def decode_plan(rows: int, page_size: int, pages_per_sequence: int, *, cpu: bool) -> tuple[int, int, int]:
    """(pages per tile, chains, splits per chain) for ``rows`` packed query rows (G * Lq).

    The key range is cut into chains * splits runs. A chain is one loop; the splits of a chain
    advance together inside its steps (wide steps: what a GPU fills its cores with). On a CPU
    each chain is one loop of single tiles, one chain per host thread: XLA:CPU runs independent
    loops concurrently, and a 256-key tile stays in the caches (B=2, 16,384 keys, Hq/Hkv=32/8,
    D=128: one split per step ran in 91 ms, 2 in 119 ms, 4 in 416 ms on the 2-core host)."""
    pages_per_tile = max(1, DECODE_TILE_KEYS // page_size)
    tile_keys = pages_per_tile * page_size
    num_tiles = -(-pages_per_sequence // pages_per_tile)
    if cpu:
        return pages_per_tile, max(1, min(platform.host_threads(), num_tiles)), 1
    splits = DECODE_STEP_PAIRS // (rows * tile_keys)
    return pages_per_tile, 1, max(1, min(splits, num_tiles, DECODE_MAX_SPLITS))


def decode(cfg: AttentionConfig, q, k, v, masks: masking.MaskInputs, extras=None, page_table=None):
    """Few query rows against a long cache; see ``_decode``. The plan (``decode_plan``) is the
    platform's, chosen where the call is lowered."""
    run = lambda cpu: lambda *args: _decode(cfg, *args, cpu=cpu)
    return lax.platform_dependent(q, k, v, masks, extras, page_table, cpu=run(True), default=run(False))


def _decode(cfg: AttentionConfig, q, k, v, masks: masking.MaskInputs, extras=None, page_table=None, *,
            cpu: bool):
    """-> (out ``[B, Lq, Hq, D]`` in q's dtype, RowStats ``[B, Hq, Lq]``), as ``forward``.

    ``page_table`` None: k, v ``[B, Lk, Hkv, D]``; else int32 ``[B, P]`` (ids in range) with
    k, v pages ``[num_pages, page_size, Hkv, D]`` read in place: each step gathers one tile of
    whole pages per split, never a ``[B, Lk, Hkv, D]`` copy. No bias, dense mask, segment ids,
    block_mask or dropout on this path (the dispatcher sends those calls to ``forward``);
    score_mod and mask_mod see query r's index in q and the logical key position.
    """
    extras = extras or dropout_sinks.SinksAndDropout()
    b, lq, hq, d = q.shape
    hkv = k.shape[-2]
    groups = hq // hkv
    if page_table is None:
        lk = k.shape[1]
        page_size = _dense_page_size(lk)
        per_row = lk // page_size
        k, v = (x.reshape(b * per_row, page_size, hkv, d) for x in (k, v))  # no copy
        page_table = (jnp.arange(b, dtype=jnp.int32)[:, None] * per_row
                      + jnp.arange(per_row, dtype=jnp.int32)[None, :])
    page_size, pages = k.shape[1], page_table.shape[1]
    logical_len = pages * page_size
    rows = lq * groups
    pages_per_tile, chains, splits = decode_plan(rows, page_size, pages, cpu=cpu)
    tile_keys = pages_per_tile * page_size
    spec = masking.with_padding(cfg.mask, queries_padded=False, keys_padded=True)

    # Packed rows: r = i * G + g (query i, head g of the group) -> [B, Hkv, R, D].
    q_poison = online_softmax.row_poison(q).reshape(b, lq, hkv, groups)
    q_poison = jnp.moveaxis(q_poison, 1, 2).reshape(b, hkv, 1, rows, 1)
    q_rows = jnp.moveaxis(online_softmax.finite_or_zero(q).reshape(b, lq, hkv, groups, d), 1, 2)
    q_rows = q_rows.reshape(b, hkv, rows, d)
    query_index = (jnp.arange(rows, dtype=jnp.int32) // groups)[:, None]   # [R, 1]
    expand = lambda x: None if x is None else x[:, None, None, None, None]  # [B] -> [B,1,1,1,1]
    q_len, kv_len, offset = expand(masks.q_len), expand(masks.kv_len), expand(masks.position_offset)

    # Tiles any batch row can need (the band and lengths), split among the runs.
    lo, hi = masking.kv_block_range(spec, 0, lq, tile_keys, masks.q_len, masks.kv_len,
                                    masks.position_offset)
    lo, hi = jnp.min(lo), jnp.max(hi)
    runs = chains * splits
    steps = (jnp.maximum(hi - lo, 0) + runs - 1) // runs
    run_start = lo + jnp.arange(runs, dtype=jnp.int32) * steps  # [runs], in tiles

    def step(t, carry, split_start):
        acc, row_max, row_sum = carry
        tile = split_start + t                                                   # [S]
        logical_page = tile[:, None] * pages_per_tile + jnp.arange(pages_per_tile, dtype=jnp.int32)
        cols = (logical_page[:, :, None] * page_size
                + jnp.arange(page_size, dtype=jnp.int32)).reshape(splits, 1, tile_keys)
        page_ids = jnp.take(page_table, jnp.clip(logical_page, 0, pages - 1), axis=1)  # [B, S, ppt]
        k_tile, v_tile = (x[page_ids].reshape(b, splits, tile_keys, hkv, d) for x in (k, v))
        kv_poison = online_softmax.key_poison(k_tile, v_tile)                    # [B, S, T, Hkv]
        kv_poison = jnp.moveaxis(kv_poison, 3, 1)[:, :, :, None, :]              # [B, Hkv, S, 1, T]
        k_tile, v_tile = online_softmax.finite_or_zero(k_tile), online_softmax.finite_or_zero(v_tile)
        qk = jnp.einsum("bhrd,bsthd->bhsrt", q_rows, k_tile, precision=cfg.precision,
                        preferred_element_type=jnp.float32)
        s, _ = online_softmax.logits(qk, cfg, poison=q_poison + kv_poison)
        allowed = masking.structural_allowed(spec, query_index, cols, q_len, kv_len, offset)
        if cfg.has_mods:  # [B, Hkv, S, R, T]: row r is query r // G of head kv_head * G + r % G
            indices = (jnp.arange(b, dtype=jnp.int32).reshape(-1, 1, 1, 1, 1),
                       (jnp.arange(hkv, dtype=jnp.int32)[:, None] * groups
                        + jnp.arange(rows, dtype=jnp.int32) % groups).reshape(1, hkv, 1, rows, 1),
                       query_index.reshape(1, 1, 1, rows, 1),
                       jnp.minimum(cols, logical_len - 1).reshape(1, 1, splits, 1, tile_keys))
            s = mods.score(cfg, s, *indices, extras.mod_aux)
            allowed = masking.all_of([allowed, mods.allowed(cfg, *indices, extras.mod_aux)])
        rescale, p, row_max, row_sum = online_softmax.online_step(row_max, row_sum, s, allowed)
        pv = jnp.einsum("bhsrt,bsthd->bhsrd", p.astype(v.dtype), v_tile, precision=cfg.precision,
                        preferred_element_type=jnp.float32)
        return rescale[..., None] * acc + pv, row_max, row_sum

    stats_shape = (b, hkv, splits, rows)
    axes = vma.axes_of(q, k, v, masks)
    init = vma.like((jnp.zeros(stats_shape + (d,), jnp.float32),
                     *dropout_sinks.initial_stats(None, stats_shape)), axes)
    # One loop per chain (independent: XLA:CPU runs them on its threads), its splits side by side.
    loops = [lax.fori_loop(0, steps, functools.partial(step, split_start=run_start[c * splits:(c + 1) * splits]), init)
             for c in range(chains)]
    acc, row_max, row_sum = (jnp.concatenate(parts, axis=2) for parts in zip(*loops))
    splits = runs
    out, stats = online_softmax.finalize(acc, row_max, row_sum)

    # The runs merged pairwise, as [X, L, H, D] / [X, H, L] with X = (batch, kv head).
    out, stats = online_softmax.merge_runs(
        jnp.moveaxis(out, 2, 0).reshape(splits, b * hkv, rows, 1, d),
        online_softmax.RowStats(*(jnp.moveaxis(x, 2, 0).reshape(splits, b * hkv, 1, rows) for x in stats)))
    if extras.sinks is not None:  # a sink is one more run: no value, logit = the sink
        sink = jnp.broadcast_to(extras.sinks.astype(jnp.float32).reshape(
            extras.sinks.shape[0], -1, 1), (b, hq, lq))
        sink = jnp.moveaxis(sink.reshape(b, hkv, groups, lq), 3, 2).reshape(b * hkv, 1, rows)
        sink_stats = online_softmax.RowStats(jnp.where(sink > -jnp.inf, sink, jnp.inf),
                                             jnp.zeros_like(sink))
        out, stats = online_softmax.merge(out, stats, jnp.zeros_like(out), sink_stats)

    # [B * Hkv, R = (Lq, G), 1, D] -> [B, Lq, Hq, D]; stats [B * Hkv, 1, R] -> [B, Hq, Lq].
    out = jnp.moveaxis(out.reshape(b, hkv, lq, groups, d), 2, 1).reshape(b, lq, hq, d)
    stats = online_softmax.RowStats(*(jnp.moveaxis(x.reshape(b, hkv, lq, groups), 3, 2).reshape(b, hq, lq)
                                      for x in stats))
    return out.astype(q.dtype), stats
