"""Forward kernel: FlashAttention-2 Algorithm 1, one program per (query tile, batch, head).

Each program keeps its query tile in registers and walks the key tiles that the mask
structure allows (masking.kv_block_range), or with segment ids or a block_mask those its tile
lists name (common.visit_tiles: the partial ones masked, the full ones not), with a running
row max m, a running sum l in m's scale and an fp32 output accumulator, rescaled whenever m
grows; O and the row statistics (m and log l) are written once at the end. P is computed in
base 2, the row max subtracted first (online_softmax.online_step); the statistics written
are the natural-log RowStats.
The last tiles may reach past Lq, Lk and D: their loads and stores are masked (layout.py).
The non-finite rule (online_softmax), with no reduction in the kernel: XLA makes every query row
that holds a non-finite value all NaN (q enters only S, whose select keeps the NaN at the
allowed pairs) and takes each key's poison (a pass over k and v) for every tile to add to its
logits; masked tiles read v with its non-finite entries as 0 (P V reads it where P = 0).
Folding the query side into the kernel instead (a [bq] add once per program) cost the fp16 D=64
causal forward 62 registers (193 -> 255), adding it per tile spilled the bf16 one.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax_impl import dropout_sinks, masking, online_softmax, vma
from jax_impl.config import AttentionConfig
from jax_impl.pallas_triton import common
from jax_impl.pallas_triton.layout import Layout, load, store, tiles, within


def _forward_kernel(q_ref, k_ref, v_ref, q_len_ref, kv_len_ref, offset_ref, q_seg_ref, kv_seg_ref,
                    mask_ref, bias_ref, sinks_ref, seeds_ref, dropout_offset_ref, key_poison_ref,
                    lists_refs, aux_refs, o_ref, max_ref, log_sum_ref, *,
                    cfg: AttentionConfig, layout: Layout, order: common.TileOrder, aux_types: tuple):
    block_q, block_k = layout.blocks.block_q, layout.blocks.block_k
    i, b, h = order.tile(pl.program_id(0)), pl.program_id(1), pl.program_id(2)
    sink, seed = common.per_head(sinks_ref, b, h), common.per_head(seeds_ref, b, h)
    q_len, kv_len = q_len_ref[b], kv_len_ref[b]
    offset = common.position_offset(offset_ref, b)
    queries = i * block_q + jnp.arange(block_q, dtype=jnp.int32)     # [bq]
    query_ok, feature_ok = within(queries, layout.lq), layout.features_within()
    q = load(q_ref, query_ok, feature_ok)                             # [bq, Dp]
    rows = queries[:, None]
    q_seg = None if q_seg_ref is None else load(q_seg_ref, query_ok)
    query = common.QueryTile.create(q, rows, query_ok, q_seg, q_len, kv_len, offset)
    refs = (k_ref, v_ref, kv_seg_ref, mask_ref, bias_ref, key_poison_ref)
    mods = common.TileMods.create(cfg, b, h, aux_refs, aux_types)

    def key_tile(j, carry, rules):
        acc, row_max, row_sum = carry
        tile = common.key_tile_logits(cfg, layout, query, refs, j, block_k, rules, finite_kv=False,
                                      mods=mods)
        rescale, p, row_max, row_sum = online_softmax.online_step(row_max, row_sum, tile.s, tile.allowed,
                                                                   base2=True)
        keep = common.dropout_keep(cfg, seed, rows, tile.cols, dropout_offset_ref)
        p_drop = dropout_sinks.apply_dropout(p, keep, cfg.dropout_rate)
        acc = rescale[:, None] * acc + common.dot(p_drop.astype(tile.v.dtype), tile.v, cfg.precision)
        return acc, row_max, row_sum

    init = (jnp.zeros(q.shape, jnp.float32), *dropout_sinks.initial_stats(sink, (block_q,)))
    band = None if lists_refs is not None else masking.kv_block_split(
        cfg.mask, i * block_q, block_q, block_k, q_len, kv_len, offset)
    acc, row_max, row_sum = common.visit_tiles(lists_refs, band, b, h, i, key_tile, init)
    out, stats = online_softmax.finalize(acc, row_max, row_sum)
    store(o_ref, out.astype(o_ref.dtype), query_ok, feature_ok)
    store(max_ref, stats.max, query_ok)
    store(log_sum_ref, stats.log_sum, query_ok)


def forward_call(cfg: AttentionConfig, layout: Layout, q, k, v, masks: masking.MaskInputs,
                 mask, bias, sinks=None, seeds=None, dropout_offset=None, mod_aux=()):
    """q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D] -> (out [B, Lq, Hq, D], row max and log-sum
    [B, Hq, Lq]); tiles may reach past Lq, Lk and D (layout.py). ``mod_aux``: the mods'
    arrays."""
    batch, hq, hkv = q.shape[0], q.shape[2], k.shape[2]
    lk_tiled, d_tile, groups = layout.lk_tiled, layout.d_tile, hq // hkv
    block_q = layout.blocks.block_q
    lists = common.tile_lists(cfg, masks, layout.lq, layout.lk, block_q, layout.blocks.block_k)
    aux = tuple(map(common.mod_aux_operand, mod_aux))
    pair = lambda x: None if x is None else pl.BlockSpec(  # a [X, H, Lq, Lk] mask or bias
        (None, None, block_q, lk_tiled), lambda i, b, h: (
            common.broadcast_index(x, 0, b), common.broadcast_index(x, 1, h), i, 0))
    in_specs = [
        pl.BlockSpec((None, block_q, None, d_tile), lambda i, b, h: (b, i, h, 0)),
        pl.BlockSpec((None, lk_tiled, None, d_tile), lambda i, b, h: (b, 0, h // groups, 0)),
        pl.BlockSpec((None, lk_tiled, None, d_tile), lambda i, b, h: (b, 0, h // groups, 0)),
        pl.BlockSpec((batch,), lambda i, b, h: (0,)),
        pl.BlockSpec((batch,), lambda i, b, h: (0,)),
        common.per_row_spec(masks.position_offset, batch),
        None if masks.q_segment_ids is None else pl.BlockSpec((None, block_q), lambda i, b, h: (b, i)),
        None if masks.kv_segment_ids is None else pl.BlockSpec((None, lk_tiled), lambda i, b, h: (b, 0)),
        pair(mask),
        pair(bias),
        common.per_head_spec(sinks),
        common.per_head_spec(seeds),
        common.dropout_offset_spec(dropout_offset),
        pl.BlockSpec((None, None, lk_tiled), lambda i, b, h: (b, h // groups, 0)),  # key poison
        common.tile_lists_spec(lists),
        common.mod_aux_specs(aux),
    ]
    stats_spec = pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))
    stats_shape = vma.out_struct((batch, hq, layout.lq), jnp.float32, q)
    out_specs = [pl.BlockSpec((None, block_q, None, d_tile), lambda i, b, h: (b, i, h, 0)),
                 stats_spec, stats_spec]
    out_shape = [vma.out_struct(q.shape, q.dtype, q), stats_shape, stats_shape]
    order = common.TileOrder(tiles(layout.lq, block_q), masking.later_query_tiles_heavier(cfg.mask))
    kernel = functools.partial(_forward_kernel, cfg=cfg, layout=layout, order=order,
                               aux_types=common.mod_aux_types(mod_aux))
    return pl.pallas_call(
        kernel, grid=(order.num_tiles, batch, hq), in_specs=list(map(order.spec, in_specs)),
        out_specs=list(map(order.spec, out_specs)),
        out_shape=out_shape, interpret=cfg.interpret, debug=cfg.debug, name="flash_attention_forward",
        compiler_params=common.compiler_params(layout.blocks.num_warps, layout.blocks.num_stages),
    )(online_softmax.poisoned_rows(q), k, v, masks.q_len, masks.kv_len, masks.position_offset,
      masks.q_segment_ids, masks.kv_segment_ids, mask, bias, sinks, seeds, dropout_offset,
      online_softmax.key_poison(k, v).transpose(0, 2, 1),  # [B, Hkv, Lk]
      lists, aux)
