"""Split-K decode kernel (flash-decoding) for a dense or paged KV cache: one program per (key
run, batch row, kv head).

The rows of a program's tile are the packed queries of one kv head: the Hq / Hkv query heads
of its group times the Lq query rows (row r is query r // G of group head r % G), padded to a
power of two of at least 16 (Triton's dot). Each program walks its run of the key tiles any
query can need (masking.kv_block_range, cut into ``runs`` equal shares) with the forward's
online softmax (base 2, common.key_tile_logits: the mask and the non-finite rule) and writes a
normalised partial output with its RowStats; XLA merges the runs exactly
(online_softmax.merge_runs), a sink joining as one more run. Runs are chosen so that the grid
has at least ``DECODE_TARGET_PROGRAMS`` programs where the cache is long enough: a decode step
with B=1 and Hkv=8 then fills an H100's 132 SMs instead of launching 8 programs.
A paged cache is read in place: the program sees every page of its kv head and loads each key
tile's page id from the row's page table; a tile lies within one page (``block_k`` divides the
page size, which must be a multiple of 16: ``pages_unsupported``).
Tested in the Pallas interpreter, and compiled for sm_90a without a GPU (B=1, Hkv=8, Hq=32,
1 query row, 65,536 bf16 keys: 264 programs, 0 spills; 75 registers dense, 64 and 77 with
pages of 16 and 64); never run on a GPU yet (docs/limitations.md).
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_impl import masking, online_softmax, platform, vma
from jax_impl.config import AttentionConfig
from jax_impl.dropout_sinks import SinksAndDropout
from jax_impl.pallas_triton import common
from jax_impl.pallas_triton.layout import Layout, load, store, tiles, within

DECODE_TARGET_PROGRAMS = 264  # two waves of an H100's 132 SMs
DECODE_MAX_QUERY_ROWS = 16      # packed with the query group into one tile's rows
MIN_PAGE_SIZE = 16              # Triton's dot: key tiles of at least 16


def decode_runs(batch: int, kv_heads: int, key_tiles: int) -> int:
    """Key runs per (batch row, kv head): enough programs to fill the GPU, at least one tile each."""
    return max(1, min(key_tiles, -(-DECODE_TARGET_PROGRAMS // (batch * kv_heads))))


def pages_unsupported(*, page_size: int | None = None, head_dim: int | None = None) -> str | None:
    """Why the kernel cannot read pages of ``page_size`` slots in place, or None."""
    del head_dim  # any the dense kernel takes
    if page_size is not None and page_size % MIN_PAGE_SIZE:
        return (f"page_size={page_size} is not a multiple of {MIN_PAGE_SIZE}: a key tile must lie "
                f"within one page (its rows are one strided load) and Triton's dot takes tiles "
                f"of at least {MIN_PAGE_SIZE} keys")
    return None


def decode_unsupported(*, q_len: int | None = None, **_) -> str | None:
    """Why the kernel does not take such a call, or None (dense calls: decode_path says more)."""
    if q_len is not None and q_len > DECODE_MAX_QUERY_ROWS:
        return f"{q_len} query rows: the decode kernel packs at most {DECODE_MAX_QUERY_ROWS}"
    return None


def _paged_block_k(page_size: int, block_k: int) -> int:
    """The largest power of two <= block_k that divides page_size (>= MIN_PAGE_SIZE)."""
    while page_size % block_k:
        block_k //= 2
    return block_k


def _decode_kernel(q_ref, k_ref, v_ref, q_len_ref, kv_len_ref, offset_ref, key_poison_ref,
                   table_ref, aux_refs, o_ref, max_ref, log_sum_ref, *, cfg: AttentionConfig,
                   layout: Layout, lq: int, groups: int, runs: int, block_r: int,
                   page_size: int | None, aux_types: tuple):
    run, b, kv_head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_k = layout.blocks.block_k
    q_len, kv_len = q_len_ref[b], kv_len_ref[b]
    offset = common.position_offset(offset_ref, b)
    packed = jnp.arange(block_r, dtype=jnp.int32)
    row_ok, feature_ok = within(packed, lq * groups), layout.features_within()
    q = load(q_ref, row_ok, feature_ok)                                   # [R, Dp]
    query = common.QueryTile.create(q, (packed // groups)[:, None], row_ok, None, q_len, kv_len, offset)
    refs = (k_ref, v_ref, None, None, None, key_poison_ref)
    # Each packed row is its own query head: the mods see h per row.
    mods = common.TileMods.create(cfg, b, (kv_head * groups + packed % groups)[:, None],
                                  aux_refs, aux_types)

    def key_tile(j, carry):
        acc, row_max, row_sum = carry
        page_slot = None
        if table_ref is not None:  # the tile lies within one page (block_k divides page_size)
            first = j * block_k
            page = jnp.clip(table_ref[first // page_size], 0, k_ref.shape[0] - 1)  # never out of bounds
            page_slot = (page, first % page_size)
        tile = common.key_tile_logits(cfg, layout, query, refs, j, block_k, True,
                                      finite_kv=False, page_slot=page_slot, mods=mods)
        rescale, p, row_max, row_sum = online_softmax.online_step(row_max, row_sum, tile.s, tile.allowed,
                                                                   base2=True)
        acc = rescale[:, None] * acc + common.dot(p.astype(tile.v.dtype), tile.v, cfg.precision)
        return acc, row_max, row_sum

    lo, hi = masking.kv_block_range(cfg.mask, 0, lq, block_k, q_len, kv_len, offset)
    share = lax.div(jnp.maximum(hi - lo, 0) + (runs - 1), runs)
    start = lo + run * share
    end = jnp.minimum(start + share, hi)
    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((block_r,), -jnp.inf, jnp.float32),
            jnp.zeros((block_r,), jnp.float32))
    acc, row_max, row_sum = lax.fori_loop(start, jnp.maximum(end, start), key_tile, init)
    out, stats = online_softmax.finalize(acc, row_max, row_sum)
    store(o_ref, out, None, None)
    store(max_ref, stats.max, None)
    store(log_sum_ref, stats.log_sum, None)


def decode(cfg: AttentionConfig, q, k, v, masks: masking.MaskInputs, extras=None, page_table=None):
    """``Implementation.decode``: q [B, Lq, Hq, D] against a dense cache k/v [B, Lk, Hkv, D]
    (page_table None) or pages k/v [num_pages, page_size, Hkv, D] read in place through
    page_table [B, pages_per_sequence] int32 (page_size a multiple of 16: pages_unsupported)
    -> (out [B, Lq, Hq, D], RowStats [B, Hq, Lq]). score_mod and mask_mod are traced in, on
    each packed row's query head and row index."""
    _check_call(cfg, q, k, masks, page_table)
    extras = extras or SinksAndDropout()
    b, lq, hq, d = q.shape
    hkv = k.shape[2]
    page_size = None if page_table is None else k.shape[1]
    lk = k.shape[1] if page_table is None else page_table.shape[1] * page_size
    groups = hq // hkv
    rows = lq * groups
    block_r = max(16, 1 << (rows - 1).bit_length())
    layout = Layout.create(rows, lk, d, q.dtype, cfg.block_sizes, cfg.mask.is_causal)
    if page_table is not None:  # key tiles within pages: then lk (whole pages) is whole tiles
        block_k = _paged_block_k(page_size, layout.blocks.block_k)
        layout = dataclasses.replace(layout, blocks=dataclasses.replace(
            layout.blocks, block_k=block_k, block_k_dkv=block_k, block_k_dq=block_k))
    block_k = layout.blocks.block_k
    runs = decode_runs(b, hkv, tiles(lk, block_k))
    cfg = dataclasses.replace(cfg, mask=masking.with_padding(
        cfg.mask, queries_padded=False, keys_padded=layout.lk_tiled != lk))
    aux = tuple(map(common.mod_aux_operand, extras.mod_aux))
    q, k, v, masks, aux = vma.like((q, k, v, masks, aux), vma.axes_of(q, k, v, masks, aux))
    if not cfg.interpret:
        q = platform.requires_cuda(q, common.PLATFORM_ERROR)
    # Packed rows, the query side of the non-finite rule applied (as the forward's q).
    q_rows = jnp.swapaxes(online_softmax.pack_query_groups(online_softmax.poisoned_rows(q),
                                                             groups), 1, 2)  # [B, Hkv, rows, D]
    d_tile, lk_tiled = layout.d_tile, layout.lk_tiled
    if page_table is None:
        cache_spec = pl.BlockSpec((None, lk_tiled, None, d_tile), lambda r, i, h: (i, 0, h, 0))
        poison_spec = pl.BlockSpec((None, None, lk_tiled), lambda r, i, h: (i, h, 0))
        table_spec = None
        key_poison = online_softmax.key_poison(k, v).transpose(0, 2, 1)          # [B, Hkv, Lk]
    else:  # every page of kv head h; the kernel picks a tile's page through the table
        num_pages = k.shape[0]
        cache_spec = pl.BlockSpec((num_pages, page_size, None, d_tile), lambda r, i, h: (0, 0, h, 0))
        poison_spec = pl.BlockSpec((None, num_pages, page_size), lambda r, i, h: (h, 0, 0))
        table_spec = pl.BlockSpec((None, page_table.shape[1]), lambda r, i, h: (i, 0))
        key_poison = online_softmax.key_poison(k, v).transpose(2, 0, 1)          # [Hkv, pages, slots]
        page_table = page_table.astype(jnp.int32)
    in_specs = [
        pl.BlockSpec((None, None, block_r, d_tile), lambda r, i, h: (i, h, 0, 0)),
        cache_spec,
        cache_spec,
        pl.BlockSpec((b,), lambda r, i, h: (0,)),
        pl.BlockSpec((b,), lambda r, i, h: (0,)),
        common.per_row_spec(masks.position_offset, b),
        poison_spec,
        table_spec,
        common.mod_aux_specs(aux),
    ]
    stats_spec = pl.BlockSpec((None, None, None, block_r), lambda r, i, h: (r, i, h, 0))
    out_specs = [pl.BlockSpec((None, None, None, block_r, d_tile), lambda r, i, h: (r, i, h, 0, 0)),
                 stats_spec, stats_spec]
    out_shape = [vma.out_struct((runs, b, hkv, block_r, d_tile), jnp.float32, q),
                 vma.out_struct((runs, b, hkv, block_r), jnp.float32, q),
                 vma.out_struct((runs, b, hkv, block_r), jnp.float32, q)]
    kernel = functools.partial(_decode_kernel, cfg=cfg, layout=layout, lq=lq, groups=groups,
                               runs=runs, block_r=block_r, page_size=page_size,
                               aux_types=common.mod_aux_types(extras.mod_aux))
    out, row_max, log_sum = pl.pallas_call(
        kernel, grid=(runs, b, hkv), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=cfg.interpret, debug=cfg.debug, name="flash_attention_decode",
        compiler_params=common.compiler_params(layout.blocks.num_warps, layout.blocks.num_stages),
    )(q_rows, k, v, masks.q_len, masks.kv_len, masks.position_offset, key_poison, page_table, aux)
    return _merged_runs(out, row_max, log_sum, extras.sinks, q.shape, q.dtype, hkv)


def _check_call(cfg: AttentionConfig, q, k, masks: masking.MaskInputs, page_table):
    """Refuses, by name, what the decode kernel does not take."""
    if masks.mask is not None or masks.q_segment_ids is not None or cfg.dropout_rate:
        raise ValueError("pallas_triton.decode takes no dense mask, segment ids or dropout")
    if page_table is not None:
        reason = pages_unsupported(page_size=k.shape[1]) or decode_unsupported(q_len=q.shape[1])
        if reason:
            raise ValueError(f"pallas_triton.decode cannot read these pages: {reason}")
        if page_table.ndim != 2 or page_table.shape[0] != q.shape[0]:
            raise ValueError(f"page_table must be int32 [B={q.shape[0]}, pages_per_sequence]; "
                             f"got {page_table.shape}")


def _merged_runs(out, row_max, log_sum, sinks, q_shape, dtype, hkv: int):
    """The runs' partial results (out [runs, B, Hkv, block_r, Dp], statistics [runs, B, Hkv,
    block_r] of the packed rows) merged exactly (online_softmax.merge_runs), the sinks as one
    more run with no value, and unpacked: (out [B, Lq, Hq, D] in ``dtype``, RowStats
    [B, Hq, Lq])."""
    b, lq, hq, d = q_shape
    runs, groups = out.shape[0], hq // hkv
    rows = lq * groups
    out = out[..., :rows, :d].reshape(runs, b * hkv, rows, 1, d)
    stats = online_softmax.RowStats(*(x[..., :rows].reshape(runs, b * hkv, 1, rows) for x in (row_max, log_sum)))
    out, stats = online_softmax.merge_runs(out, stats)
    if sinks is not None:  # one more run: no value, logit = the sink
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(sinks.shape[0], -1, 1),
                                (b, hq, lq))
        sink = jnp.swapaxes(online_softmax.pack_query_groups(jnp.swapaxes(sink, 1, 2), groups),
                            1, 2).reshape(b * hkv, 1, rows)
        out, stats = online_softmax.merge(out, stats, jnp.zeros_like(out), online_softmax.RowStats(
            jnp.where(sink > -jnp.inf, sink, jnp.inf), jnp.zeros_like(sink)))
    # [B, Hkv, rows, ...] -> [B, Lq, Hq, ...]
    unpack = lambda x: online_softmax.unpack_query_groups(jnp.swapaxes(x, 1, 2), groups)
    out = unpack(out.reshape(b, hkv, rows, d))
    stats = online_softmax.RowStats(*(jnp.swapaxes(unpack(x.reshape(b, hkv, rows)), 1, 2)
                                      for x in stats))
    return out.astype(dtype), stats
