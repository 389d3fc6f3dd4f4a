"""Backward kernels: FlashAttention-2 Algorithm 2, split in two so that no atomics are needed.

* dK/dV: one program per (key tile, batch, kv head). It keeps K_j, V_j and the dK_j, dV_j
  accumulators in registers and walks every query tile that can see key tile j
  (masking.q_block_range, or the tile lists: common.visit_tiles), for each of the G query
  heads that share this kv head (GQA: the group's contributions are summed here, K/V are
  never repeated). Where the two
  accumulators would not fit the registers it is two kernels, dV then dK (split_dkdv).
* dQ: one program per (query tile, batch, q head); walks the key tiles like the forward.
  Both read Q, K and V with their non-finite entries as 0 and the NaN poison of each query
  row and each key, all made by one XLA pass (online_softmax's non-finite rule), so no tile
  makes a pass over its operands for the rule (such passes kept the causal D=256 kernels
  spilling); dK/dV folds the keys' poison into its K tile once per program, dQ the queries'
  into its Q tile, and each adds the other side's poison to every tile's logits.
  It also writes dS, the gradient of the bias, when there is a bias and cfg.bias_gradient,
  into a zeroed buffer that it updates in place (input_output_aliases): the tiles the band
  excludes stay 0, so it still skips them, like the xla path.

Both recompute P = exp(S - m - log l) from q, k and the saved row statistics, in base 2
(online_softmax.recomputed_probs: the forward's S, whose row max cancels exactly), and apply the
scale of dq and dk once to the accumulator rather than to every d(q.k); delta =
rowsum(dO * O) (minus the cotangent of the logsumexp, if any) comes from the custom VJP.
As in the forward, loads and stores past Lq, Lk and D are masked (layout.py).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_impl import dropout_sinks, masking, online_softmax, vma
from jax_impl.config import AttentionConfig
from jax_impl.pallas_triton import common, heuristics
from jax_impl.pallas_triton.layout import Layout, load, store, tiles, within


class _KeyTile(NamedTuple):
    """What a dK/dV program holds of its key tile across the query tiles it walks."""

    k: jax.Array                # [bk, Dp] with the keys' poison (NaN rows), else finite
    v: jax.Array                # [bk, Dp] finite
    cols: jax.Array             # [bk, 1] key positions
    ok: jax.Array | None        # [bk] inside Lk (layout.within)
    feature_ok: jax.Array | None   # [Dp] inside D (layout.features_within)
    segment_ids: jax.Array | None  # [bk]
    q_len: jax.Array
    kv_len: jax.Array
    offset: jax.Array | None    # position offset (ring), or None


class _QueryRefs(NamedTuple):
    """The dK/dV kernel's refs of the query side, [.., Lq_tiled, G, ..] for the kv head's
    group (None where not given)."""

    q: object
    do: object
    row_max: object
    log_sum: object
    delta: object
    segment_ids: object
    mask: object
    bias: object
    dropout_offset: object
    poison: object


def _transposed_pair_tile(ref, g, queries, query_ok, key_ok):
    """A [bq, bk] tile of the mask or bias of the group's head ``g``, loaded transposed to
    [bk, bq] (its head axis may be broadcast: an array index, not a Python int, which the
    interpreter's masked load cannot take); None without one."""
    if ref is None:
        return None
    head = jnp.int32(0) if ref.shape[0] == 1 else g
    return load(ref.at[head, queries, :], query_ok, key_ok).T


def _dkdv_query_tile(cfg: AttentionConfig, layout: Layout, refs: _QueryRefs, key: _KeyTile, g,
                     seed, mods, i, acc, rules: common.TileRules):
    """Query tile ``i`` of the group's head ``g`` against the program's key tile, on the
    transposed tiles: the mask (``rules``), S^T, P^T recomputed from the RowStats, dP^T, then
    dV += P^T dO and dK += dS^T Q into ``acc`` ({"dk", "dv"} or one of them)."""
    block_q = layout.blocks.block_q_dkv
    queries = pl.ds(i * block_q, block_q)
    query_positions = i * block_q + jnp.arange(block_q, dtype=jnp.int32)  # [bq]
    # An interior tile (not structural) lies below q_len <= Lq: no load of it needs a mask.
    query_ok = within(query_positions, layout.lq) if rules.structural else None
    q, do = (load(ref.at[queries, g, :], query_ok, key.feature_ok) for ref in (refs.q, refs.do))
    rows = query_positions[None, :]                                   # queries: [1, bq]
    per_query = lambda ref: load(ref.at[g, queries], query_ok)        # [bq]
    # Segment equality is symmetric: (kv ids, q ids) gives the [bk, bq] orientation.
    segments = rules.segments and refs.segment_ids is not None
    allowed = masking.allowed(
        cfg.mask, rows, key.cols, key.q_len, key.kv_len, key.segment_ids if segments else None,
        load(refs.segment_ids.at[queries], query_ok) if segments else None,
        _transposed_pair_tile(refs.mask, g, queries, query_ok, key.ok),
        structural=rules.structural, position_offset=key.offset)
    if mods is not None and rules.mask_mod:
        allowed = masking.all_of([allowed, mods.allowed(rows, key.cols)])
    qk = common.dot(key.k, q, cfg.precision, trans_b=True)           # S^T: [bk, bq]
    # The query rows' poison on every tile: q must stay finite for dK += dS^T Q.
    s, capped = online_softmax.logits(
        qk, cfg, _transposed_pair_tile(refs.bias, g, queries, query_ok, key.ok),
        online_softmax.per_row(per_query(refs.poison), transposed=True))
    slope = None
    if mods is not None:
        s, slope = mods.score(s, rows, key.cols)
    attended = online_softmax.attended(s, allowed, refs.bias is not None or slope is not None)
    stats = online_softmax.RowStats(per_query(refs.row_max), per_query(refs.log_sum))
    p = online_softmax.recomputed_probs(s, stats, attended, base2=True, transposed=True)  # P^T
    # Dropout: dV = P_drop^T dO, and dP reaches P through the same mask (the same (query, key)
    # hash, evaluated transposed).
    keep = common.dropout_keep(cfg, seed, rows, key.cols, refs.dropout_offset)
    drop = lambda x: dropout_sinks.apply_dropout(x, keep, cfg.dropout_rate)
    acc = dict(acc)
    if "dk" in acc:  # dP before the dV dot: the order that compiles without spills (fp32)
        dp = common.dot(key.v, do, cfg.precision, trans_b=True)      # dP^T = V dO^T
        _, dqk = common.logits_gradient(p, drop(dp), per_query(refs.delta), capped, cfg, slope,
                                        transposed=True, exclusions=attended is not None)
    if "dv" in acc:
        acc["dv"] += common.dot(drop(p).astype(do.dtype), do, cfg.precision)
    if "dk" in acc:
        acc["dk"] += common.dot(dqk.astype(q.dtype), q, cfg.precision)
    return acc


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, max_ref, log_sum_ref, delta_ref, q_len_ref, kv_len_ref,
                 offset_ref, q_seg_ref, kv_seg_ref, mask_ref, bias_ref, seeds_ref, dropout_offset_ref,
                 query_poison_ref, key_poison_ref, lists_refs, aux_refs, *out_refs,
                 cfg: AttentionConfig, layout: Layout, groups: int, order: common.TileOrder,
                 outputs: tuple[str, ...], aux_types: tuple):
    """Works on the transposed tiles S^T = K Q^T ``[bk, bq]``, so that dV += P^T dO and
    dK += dS^T Q are plain dots: no transpose of the computed P or dS.

    ``outputs``: ("dk", "dv") accumulates both; ("dv",) or ("dk",) one of them, when two
    [bk, Dp] fp32 accumulators would not fit in registers (heuristics.split_dkdv): the dV
    program then needs neither V nor dP."""
    block_q, block_k = layout.blocks.block_q_dkv, layout.blocks.block_k_dkv
    j, b, kv_head = order.tile(pl.program_id(0)), pl.program_id(1), pl.program_id(2)
    q_len, kv_len = q_len_ref[b], kv_len_ref[b]
    offset = common.position_offset(offset_ref, b)
    key_positions = j * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [bk]
    key_ok, feature_ok = within(key_positions, layout.lk), layout.features_within()
    k, v = load(k_ref, key_ok, feature_ok), load(v_ref, key_ok, feature_ok)  # [bk, Dp], finite
    # The keys' share of the non-finite rule, once per program: k enters only S^T = K Q^T here,
    # so a key row made all NaN poisons every logit of the key, and the mask keeps it only at
    # the allowed pairs (dS and P are exactly 0 at the others).
    k = k + online_softmax.per_row(load(key_poison_ref, key_ok)).astype(k.dtype)
    key = _KeyTile(k, v, key_positions[:, None], key_ok, feature_ok,
                   None if kv_seg_ref is None else load(kv_seg_ref, key_ok), q_len, kv_len, offset)
    band = None if lists_refs is not None else masking.q_block_split(
        cfg.mask, j * block_k, block_k, block_q, q_len, kv_len, offset)
    mods = common.TileMods.create(cfg, b, kv_head * groups, aux_refs, aux_types, gradient=True)
    refs = _QueryRefs(q_ref, do_ref, max_ref, log_sum_ref, delta_ref, q_seg_ref, mask_ref,
                      bias_ref, dropout_offset_ref, query_poison_ref)

    def query_head(g, carry):  # the group's heads in order: one walk of the tiles each
        head = kv_head * groups + g
        tile = functools.partial(_dkdv_query_tile, cfg, layout, refs, key, g,
                                 common.per_head(seeds_ref, b, head),
                                 None if mods is None else mods.at_head(head))
        return common.visit_tiles(lists_refs, band, b, head, j, tile, carry)

    acc = lax.fori_loop(0, groups, query_head, {name: jnp.zeros(k.shape, jnp.float32) for name in outputs})
    scale = {"dk": cfg.scale, "dv": 1.0}  # dk's scale once, here
    for name, ref in zip(outputs, out_refs):
        store(ref, (acc[name] * scale[name]).astype(ref.dtype), key_ok, feature_ok)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, max_ref, log_sum_ref, delta_ref, q_len_ref, kv_len_ref,
               offset_ref, q_seg_ref, kv_seg_ref, mask_ref, bias_ref, seeds_ref, dropout_offset_ref,
               query_poison_ref, key_poison_ref, lists_refs, aux_refs, dq_ref, dbias_ref, *,
               cfg: AttentionConfig, layout: Layout, order: common.TileOrder,
               aux_types: tuple):
    block_q, block_k = layout.blocks.block_q_dq, layout.blocks.block_k_dq
    i, b, h = order.tile(pl.program_id(0)), pl.program_id(1), pl.program_id(2)
    seed = common.per_head(seeds_ref, b, h)
    q_len, kv_len = q_len_ref[b], kv_len_ref[b]
    offset = common.position_offset(offset_ref, b)
    queries = i * block_q + jnp.arange(block_q, dtype=jnp.int32)     # [bq]
    query_ok, feature_ok = within(queries, layout.lq), layout.features_within()
    q, do = load(q_ref, query_ok, feature_ok), load(do_ref, query_ok, feature_ok)  # [bq, Dp]
    per_query = lambda ref: load(ref, query_ok)                       # [bq]
    stats, delta = online_softmax.RowStats(per_query(max_ref), per_query(log_sum_ref)), per_query(delta_ref)
    query = common.QueryTile.create(q, queries[:, None], query_ok,
                                    None if q_seg_ref is None else per_query(q_seg_ref), q_len,
                                    kv_len, offset, per_query(query_poison_ref))
    refs = (k_ref, v_ref, kv_seg_ref, mask_ref, bias_ref, key_poison_ref)
    mods = common.TileMods.create(cfg, b, h, aux_refs, aux_types, gradient=True)

    def key_tile(j, dq, rules):
        tile = common.key_tile_logits(cfg, layout, query, refs, j, block_k, rules, finite_kv=True,
                                      mods=mods)
        attended = online_softmax.attended(tile.s, tile.allowed,
                                           bias_ref is not None or tile.slope is not None)
        p = online_softmax.recomputed_probs(tile.s, stats, attended, base2=True)
        dp = common.dot(do, tile.v, cfg.precision, trans_b=True)
        # dP reaches P through the same keep mask.
        keep = common.dropout_keep(cfg, seed, query.rows, tile.cols, dropout_offset_ref)
        ds, dqk = common.logits_gradient(p, dropout_sinks.apply_dropout(dp, keep, cfg.dropout_rate),
                                         delta, tile.capped, cfg, tile.slope,
                                         exclusions=attended is not None)
        if dbias_ref is not None:
            store(dbias_ref.at[:, pl.ds(j * block_k, block_k)], ds, query_ok, tile.ok)
        return dq + common.dot(dqk.astype(tile.k.dtype), tile.k, cfg.precision)

    band = None if lists_refs is not None else masking.kv_block_split(
        cfg.mask, i * block_q, block_q, block_k, q_len, kv_len, offset)
    dq = common.visit_tiles(lists_refs, band, b, h, i, key_tile, jnp.zeros(q.shape, jnp.float32))
    store(dq_ref, (dq * cfg.scale).astype(dq_ref.dtype), query_ok, feature_ok)  # the scale once


class _Inputs(NamedTuple):
    """Both backward kernels' operands, in the order of their refs (None: not given, no ref)."""

    q: jax.Array                # [B, Lq, Hq, D], non-finite entries as 0
    k: jax.Array                # [B, Lk, Hkv, D], non-finite entries as 0
    v: jax.Array                # [B, Lk, Hkv, D], non-finite entries as 0
    d_out: jax.Array            # [B, Lq, Hq, D]
    row_max: jax.Array          # [B, Hq, Lq] the forward's RowStats
    log_sum: jax.Array          # [B, Hq, Lq]
    delta: jax.Array            # [B, Hq, Lq] rowsum(dO * O)
    q_len: jax.Array            # [B] int32
    kv_len: jax.Array           # [B] int32
    offset: object              # [B] int32 position offsets, or None
    q_segment_ids: object       # [B, Lq] int32, or None
    kv_segment_ids: object      # [B, Lk] int32, or None
    mask: object                # [Bm, Hm, Lq, Lk] bool, or None
    bias: object                # [Bb, Hb, Lq, Lk] float, or None
    seeds: object               # dropout's [Bs, Hs] head seeds, or None
    dropout_offset: object      # [2] int32, or None
    query_poison: jax.Array     # [B, Hq, Lq] NaN or 0 per query row
    key_poison: jax.Array       # [B, Hkv, Lk] NaN or 0 per key (its row of K or of V)


def backward_call(cfg: AttentionConfig, layout: Layout, q, k, v, d_out, stats, delta,
                  masks: masking.MaskInputs, mask, bias, seeds=None, dropout_offset=None, mod_aux=()):
    """Operands as the forward's -> (dq, dk, dv, dbias [B, Hq, Lq, Lk], or None without a bias or
    with ``cfg.bias_gradient`` False); tiles may reach past Lq, Lk and D (layout.py)."""
    # The non-finite rule, once per call (one XLA pass over q, k, v): both kernels read q, k and
    # v with their non-finite entries as 0, and the NaN-or-0 poison of each query row
    # [B, Hq, Lq] and each key [B, Hkv, Lk] (its row of K or of V), which every tile adds.
    query_poison = online_softmax.row_poison(q).transpose(0, 2, 1)
    key_poison = online_softmax.key_poison(k, v).transpose(0, 2, 1)
    finite = tuple(map(online_softmax.finite_or_zero, (q, k, v)))
    inputs = _Inputs(*finite, d_out, stats.max, stats.log_sum, delta, masks.q_len, masks.kv_len,
                     masks.position_offset, masks.q_segment_ids, masks.kv_segment_ids, mask,
                     bias, seeds, dropout_offset, query_poison, key_poison)
    aux = tuple(map(common.mod_aux_operand, mod_aux))
    dk, dv = _dkdv_call(cfg, layout, inputs, masks, aux, common.mod_aux_types(mod_aux), q, k, v)
    dq, dbias = _dq_call(cfg, layout, inputs, masks, aux, common.mod_aux_types(mod_aux), q)
    # The kernels differentiated the finite copies: the gradient of finite_or_zero is 0 at the
    # non-finite entries themselves, which no product read.
    return dq, dk, dv, dbias


def _lengths_specs(inputs: _Inputs):
    """q_len, kv_len and the position offset: whole, in every program."""
    batch = inputs.q_len.shape[0]
    return [pl.BlockSpec((batch,), lambda *_: (0,))] * 2 + [
        common.per_row_spec(inputs.offset, batch)]


def _dkdv_call(cfg: AttentionConfig, layout: Layout, inputs: _Inputs, masks, aux, aux_types,
               q, k, v):
    """dK/dV: grid (key tile, batch, kv head); query-side operands hold the whole group. Two
    calls, dV then dK, where heuristics.split_dkdv says both accumulators would not fit."""
    batch, hq, hkv = q.shape[0], q.shape[2], k.shape[2]
    lq_tiled, d_tile, groups = layout.lq_tiled, layout.d_tile, hq // hkv
    blocks = layout.blocks
    bq, bk = blocks.block_q_dkv, blocks.block_k_dkv
    pair = lambda x: None if x is None else pl.BlockSpec(
        (None, groups if x.shape[1] > 1 else 1, lq_tiled, bk),
        lambda j, b, h: (common.broadcast_index(x, 0, b), common.broadcast_index(x, 1, h), 0, j))
    kv_tile = pl.BlockSpec((None, bk, None, d_tile), lambda j, b, h: (b, j, h, 0))
    q_group = pl.BlockSpec((None, lq_tiled, groups, d_tile), lambda j, b, h: (b, 0, h, 0))
    stats_group = pl.BlockSpec((None, groups, lq_tiled), lambda j, b, h: (b, h, 0))
    order = common.TileOrder(tiles(layout.lk, bk), masking.later_key_tiles_heavier(cfg.mask))
    lists = common.tile_lists(cfg, masks, layout.lq, layout.lk, bq, bk, transposed=True)
    in_specs = [
        q_group, kv_tile, kv_tile, q_group, *[stats_group] * 3, *_lengths_specs(inputs),
        None if inputs.q_segment_ids is None else pl.BlockSpec((None, lq_tiled), lambda j, b, h: (b, 0)),
        None if inputs.kv_segment_ids is None else pl.BlockSpec((None, bk), lambda j, b, h: (b, j)),
        pair(inputs.mask), pair(inputs.bias), common.per_head_spec(inputs.seeds),
        common.dropout_offset_spec(inputs.dropout_offset), stats_group,
        pl.BlockSpec((None, None, bk), lambda j, b, h: (b, h, j)),  # key poison
        common.tile_lists_spec(lists), common.mod_aux_specs(aux)]
    grads = {}
    split = heuristics.split_dkdv(layout.d_tile, blocks)
    for outputs in (("dv",), ("dk",)) if split else (("dk", "dv"),):
        grads.update(zip(outputs, pl.pallas_call(
            functools.partial(_dkdv_kernel, cfg=cfg, layout=layout, groups=groups, order=order,
                              outputs=outputs, aux_types=aux_types),
            grid=(order.num_tiles, batch, hkv), in_specs=list(map(order.spec, in_specs)),
            out_specs=[order.spec(kv_tile)] * len(outputs),
            out_shape=[vma.out_struct(k.shape, {"dk": k, "dv": v}[name].dtype, q) for name in outputs],
            interpret=cfg.interpret, debug=cfg.debug,
            name="flash_attention_backward_" + "".join(outputs),
            compiler_params=common.compiler_params(blocks.num_warps_bwd, blocks.num_stages),
        )(*inputs, lists, aux)))
    return grads["dk"], grads["dv"]


def _dq_call(cfg: AttentionConfig, layout: Layout, inputs: _Inputs, masks, aux, aux_types, q):
    """dQ (and dbias): grid (query tile, batch, q head). -> (dq, dbias or None). dbias: zeros
    in, updated in place (input_output_aliases): the kernel writes only the band's tiles."""
    batch, hq, hkv = q.shape[0], q.shape[2], inputs.k.shape[2]
    lk_tiled, d_tile, groups = layout.lk_tiled, layout.d_tile, hq // hkv
    blocks = layout.blocks
    bq, bk = blocks.block_q_dq, blocks.block_k_dq
    pair = lambda x: None if x is None else pl.BlockSpec(
        (None, None, bq, lk_tiled),
        lambda i, b, h: (common.broadcast_index(x, 0, b), common.broadcast_index(x, 1, h), i, 0))
    lists = common.tile_lists(cfg, masks, layout.lq, layout.lk, bq, bk)
    operands = (*inputs, lists, aux)
    q_tile = pl.BlockSpec((None, bq, None, d_tile), lambda i, b, h: (b, i, h, 0))
    kv_all = pl.BlockSpec((None, lk_tiled, None, d_tile), lambda i, b, h: (b, 0, h // groups, 0))
    stats_tile = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    in_specs = [
        q_tile, kv_all, kv_all, q_tile, *[stats_tile] * 3, *_lengths_specs(inputs),
        None if inputs.q_segment_ids is None else pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
        None if inputs.kv_segment_ids is None else pl.BlockSpec((None, lk_tiled), lambda i, b, h: (b, 0)),
        pair(inputs.mask), pair(inputs.bias), common.per_head_spec(inputs.seeds),
        common.dropout_offset_spec(inputs.dropout_offset), stats_tile,
        pl.BlockSpec((None, None, lk_tiled), lambda i, b, h: (b, h // groups, 0)),  # key poison
        common.tile_lists_spec(lists), common.mod_aux_specs(aux)]
    out_specs = [q_tile]
    out_shape = [vma.out_struct(q.shape, q.dtype, q)]
    write_dbias = inputs.bias is not None and cfg.bias_gradient
    aliases = {}
    if write_dbias:
        dbias_tile = pl.BlockSpec((None, None, bq, lk_tiled), lambda i, b, h: (b, h, i, 0))
        aliases = {len(jax.tree.leaves(operands)): 1}  # operands that are None are not passed
        dbias_zeros = jnp.zeros((batch, hq, layout.lq, layout.lk), jnp.float32)
        operands = (*operands, vma.like(dbias_zeros, vma.axes_of(q)))
        in_specs.append(dbias_tile)
        out_specs.append(dbias_tile)
        out_shape.append(vma.out_struct(dbias_zeros.shape, jnp.float32, q))
    order = common.TileOrder(tiles(layout.lq, bq), masking.later_query_tiles_heavier(cfg.mask))
    results = pl.pallas_call(
        functools.partial(_dq_kernel_with_dbias if write_dbias else _dq_kernel_no_dbias, cfg=cfg,
                          layout=layout, order=order, aux_types=aux_types),
        grid=(order.num_tiles, batch, hq), in_specs=list(map(order.spec, in_specs)),
        out_specs=list(map(order.spec, out_specs)), out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=cfg.interpret, debug=cfg.debug, name="flash_attention_backward_dq",
        compiler_params=common.compiler_params(blocks.num_warps_bwd, blocks.num_stages),
    )(*operands)
    return results[0], results[1] if write_dbias else None


def _dq_kernel_no_dbias(*refs, **kwargs):
    *inputs, dq_ref = refs
    return _dq_kernel(*inputs, dq_ref, None, **kwargs)


def _dq_kernel_with_dbias(*refs, **kwargs):
    *inputs, _dbias_zeros_ref, dq_ref, dbias_ref = refs  # the zeros are dbias_ref's own memory
    return _dq_kernel(*inputs, dq_ref, dbias_ref, **kwargs)
