"""Backward kernels for TPU (Pallas Mosaic): FlashAttention-2 Algorithm 2 as two pallas_calls,
deterministic, no atomics.

* dK/dV: grid (B, Hkv, key tiles, G x query steps). The innermost axis ("arbitrary") walks, for
  each of the G query heads of the kv head, the query tiles that can see key tile j; dK and dV
  accumulate in VMEM f32 scratch across the group and the tiles (GQA summed in VMEM, K/V never
  repeated: their index_map is the kv head).
* dQ: grid (B, Hq, query tiles, key steps); dQ accumulates in VMEM scratch. With a bias and
  ``cfg.bias_gradient`` it also writes dS, the gradient of the bias, tile by tile into a
  zeroed buffer (input_output_aliases): the tiles it skips stay 0.

Tiles: ``block_mask.tile_classes`` on each kernel's own grid (the band, lengths, segment ids and
block_mask) -> per row of tiles the non-empty ones ascending and whether each is full, passed as
scalar prefetch. Step t of a row reads entry t of its list; the steps past the row's count
repeat the last tile (no new copy) and compute nothing. Partial tiles evaluate every mask
rule; full ones only the dense mask. Sequences are padded to whole tiles (the padded positions
fail the length rule; their rows get max = +inf); head_dim is taken whole.

P = exp(S - max - log_sum) is recomputed from the forward's natural-log RowStats (an empty row
has max = +inf, log_sum = 0, so P = 0); delta = rowsum(O dO) comes from the custom VJP. Q, K
and V are read with their non-finite entries as 0, and each tile adds the NaN-or-0 poison of
its query rows and keys (online_softmax's non-finite rule), as pallas_triton does. The kernels
read no mod_aux (the implementation table runs such calls on xla). Sinks need nothing here: they are in the RowStats, and
their gradient comes from the statistics (recompute_vjp).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jax_impl import dropout_sinks, masking, online_softmax, vma
from jax_impl.config import AttentionConfig, BlockSizes
from jax_impl.mosaic_tpu import common
from jax_impl.kernel_tiles import kernel_mod_aux, mod_aux_operand, mod_aux_types

# Tile edge of both backward kernels when cfg.block_sizes is not a BlockSizes: TPU grid steps
# cost ~1k cycles each (libtpu's static estimate of JAX's kernel), so tiles are large; a multiple of 128.
DEFAULT_BLOCK = 512


@dataclasses.dataclass(frozen=True)
class Blocks:
    """(block_q, block_k) of the dK/dV kernel and of the dQ kernel."""
    q_dkv: int
    k_dkv: int
    q_dq: int
    k_dq: int


_BLOCK_FIELDS = ("block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq")


def blocks_unsupported(cfg: AttentionConfig) -> str | None:
    """Why cfg.block_sizes cannot tile the backward kernels, or None: their tiles must be
    multiples of 128 (a tile's key axis is the lanes of S, its query axis the sublanes of an
    int8 mask tile)."""
    sizes = cfg.block_sizes if isinstance(cfg.block_sizes, BlockSizes) else None
    for name in _BLOCK_FIELDS if sizes is not None else ():
        if getattr(sizes, name) % common.NUM_LANES:
            return (f"BlockSizes.{name}={getattr(sizes, name)} is not a multiple of "
                    f"{common.NUM_LANES} (the TPU's lanes; the backward kernels' tiles)")
    return None


def blocks(cfg: AttentionConfig, lq: int, lk: int, mask_tiles=None) -> Blocks | None:
    """The backward tiles: cfg.block_sizes' dkv/dq fields, else DEFAULT_BLOCK, at most the
    sequence rounded up to 128 (``blocks_unsupported`` refuses the rest), and with a block_mask
    of ``mask_tiles`` inside its tiles (``common.tile_inside``); None where no such tiles exist
    (given sizes that do not nest are not changed: None too)."""
    reason = blocks_unsupported(cfg)
    if reason:
        raise ValueError(f"implementation='mosaic_tpu' backward: {reason}")
    sizes = cfg.block_sizes if isinstance(cfg.block_sizes, BlockSizes) else None
    wanted = [DEFAULT_BLOCK if sizes is None else getattr(sizes, name) for name in _BLOCK_FIELDS]
    lengths, tiles = (lq, lk, lq, lk), (mask_tiles or (None, None)) * 2
    found = [common.tile_inside(b, n, t) for b, n, t in zip(wanted, lengths, tiles)]
    plain = [common.tile_inside(b, n, None) for b, n in zip(wanted, lengths)]
    if None in found or (sizes is not None and found != plain):
        return None
    return Blocks(*found)


def _pad(x, axis: int, size: int, value=0):
    """x padded along ``axis`` to ``size`` with ``value`` (None stays None)."""
    if x is None or x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


# --- One tile ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Static:
    """What a kernel knows at trace time."""
    cfg: AttentionConfig
    mask_cfg: AttentionConfig  # cfg with the length rules on (the kernels read q_len, kv_len)
    block_q: int
    block_k: int
    precision: object
    has_offset: bool
    has_segments: bool
    has_mask: bool
    has_bias: bool
    has_dropout: bool
    has_dropout_offset: bool
    aux_types: tuple
    seeds_shape: tuple | None


def _tile_gradients(st: _Static, refs: dict, b, h, i, j, q, k, v, do, row_max, log_sum, delta,
                    masked: bool):
    """(P after dropout, d(q.k) unscaled, dS) of tile (query tile i, key tile j) ``[bq, bk]``.

    ``masked``: a partial tile, where the band, lengths, segment ids and mask_mod are evaluated;
    a full tile evaluates only the dense mask. The bias, poison, soft cap, score_mod and dropout
    apply to every tile."""
    cfg = st.cfg
    pos = common.TilePositions.create(i, j, st.block_q, st.block_k)
    aux = kernel_mod_aux(refs["aux"], st.aux_types) if cfg.has_mods else ()
    allowed = common.tile_allowed(
        st.mask_cfg, pos, common.PARTIAL_TILE if masked else common.FULL_TILE, b=b, h=h,
        q_len=refs["q_len"][b], kv_len=refs["kv_len"][b],
        position_offset=refs["offset"][b] if st.has_offset else None,
        q_segment_ids=refs["q_seg"][...] if st.has_segments else None,
        kv_segment_ids=refs["kv_seg"][...] if st.has_segments else None,
        mask_tile=refs["mask"][...] if st.has_mask else None, mod_aux=aux)
    # The poison ([bq, 1] + [1, bk], NaN or 0) added to the raw product: S is then NaN at a
    # poisoned pair and bit for bit the forward's elsewhere (x + 0 == x).
    qk = common.dot_nt(q, k, st.precision) + (refs["q_poison"][...] + refs["k_poison"][...])
    s, capped, slope = common.tile_logits(cfg, qk, pos, b=b, h=h,
                                          bias_tile=refs["bias"][...] if st.has_bias else None,
                                          mod_aux=aux, score_gradient=True)
    attended = online_softmax.attended(s, allowed, st.has_bias or slope is not None)
    # The stats arrive as [bq, 1] columns: already shaped against the tile.
    p = online_softmax.recomputed_probs(s, online_softmax.RowStats(row_max, log_sum), attended,
                                        to_tile=lambda x: x)
    dp = common.dot_nt(do, v, st.precision)                            # dP = dO V^T
    keep = None
    if st.has_dropout:
        seed = refs["seeds"][_seed_index(st.seeds_shape, b, h)]
        seed = lax.bitcast_convert_type(jnp.full((1, 1), seed, jnp.int32), jnp.uint32)
        rows, cols = pos
        if st.has_dropout_offset:
            rows, cols = rows + refs["dropout_offset"][0], cols + refs["dropout_offset"][1]
        keep = dropout_sinks.keep(seed, rows, cols, cfg.dropout_rate)
    drop = lambda x: dropout_sinks.apply_dropout(x, keep, cfg.dropout_rate)
    ds, dqk = online_softmax.logits_gradient(
        p, drop(dp), delta[:, 0], capped, cfg, scaled=False,
        exclusions=attended is not None or slope is not None,
        score_vjp=None if slope is None else (lambda ds: ds * slope))
    return drop(p), dqk, ds


# --- Kernels -----------------------------------------------------------------------------------
# Operands are passed by name: ``names`` lists the scalar-prefetch refs, then the VMEM inputs,
# then outputs and scratch; the kernel rebuilds the dict.

def _refs(names, refs):
    named = dict(zip(names, refs))
    named["aux"] = tuple(named[n] for n in names if n.startswith("aux"))
    return named


def _list_refs(r: dict) -> tuple:
    """The tile lists' scalar-prefetch refs, in ``common.TileLists.operands``' order."""
    return r["counts"], r["tiles"], r["full"]


def _dkdv_kernel(*refs, names, st: _Static, groups: int, lists: common.TileLists):
    """Grid step (b, kv head, key tile j, t): query tile ``step`` of head ``t // steps`` of the
    group in key tile j's list (``lists``: the walk its index maps read too), if visited."""
    r = _refs(names, refs)
    b, kv_head, j, t = (pl.program_id(n) for n in range(4))
    g, step = lax.div(t, lists.steps), lax.rem(t, lists.steps)  # lax: no sign op (no Mosaic rule)
    h = kv_head * groups + g
    last = groups * lists.steps - 1

    @pl.when(t == 0)
    def _():
        r["dk_acc"][...] = jnp.zeros_like(r["dk_acc"])
        r["dv_acc"][...] = jnp.zeros_like(r["dv_acc"])

    def tile(masked):
        i = lists.kv_tile(_list_refs(r), b, h, j, step)
        q, do = r["q"][...], r["do"][...]
        p, dqk, _ = _tile_gradients(st, r, b, h, i, j, q, r["k"][...], r["v"][...], do,
                                    r["max"][...], r["log_sum"][...], r["delta"][...], masked)
        # dV += P^T dO, dK += d(q.k)^T Q: contracted over the query axis, no transposed copy.
        r["dv_acc"][...] += common.dot_tn(p.astype(do.dtype), do, st.precision)
        r["dk_acc"][...] += common.dot_tn(dqk.astype(q.dtype), q, st.precision)

    visited = lists.visited(_list_refs(r), b, h, j, step)
    full = lists.is_full(_list_refs(r), b, h, j, step)
    pl.when(visited & ~full)(lambda: tile(True))
    pl.when(visited & full)(lambda: tile(False))

    @pl.when(t == last)
    def _():
        r["dk"][...] = (r["dk_acc"][...] * st.cfg.scale).astype(r["dk"].dtype)  # the scale once
        r["dv"][...] = r["dv_acc"][...].astype(r["dv"].dtype)


def _dq_kernel(*refs, names, st: _Static, lists: common.TileLists):
    """Grid step (b, h, query tile i, t): key tile ``t`` of query tile i's list (``lists``: the
    walk its index maps read too), if visited."""
    r = _refs(names, refs)
    b, h, i, t = (pl.program_id(n) for n in range(4))
    count = lists.count(_list_refs(r), b, h, i)

    @pl.when(t == 0)
    def _():
        r["dq_acc"][...] = jnp.zeros_like(r["dq_acc"])
        if "dbias" in r:  # a row with no tile: its (padding) tile 0 is written as zeros
            @pl.when(count == 0)
            def _():
                r["dbias"][...] = jnp.zeros_like(r["dbias"])

    def tile(masked):
        j = lists.kv_tile(_list_refs(r), b, h, i, t)
        k = r["k"][...]
        _, dqk, ds = _tile_gradients(st, r, b, h, i, j, r["q"][...], k, r["v"][...], r["do"][...],
                                     r["max"][...], r["log_sum"][...], r["delta"][...], masked)
        r["dq_acc"][...] += common.dot_nn(dqk.astype(k.dtype), k, st.precision)
        if "dbias" in r:
            r["dbias"][...] = ds

    visited = t < count
    full = lists.is_full(_list_refs(r), b, h, i, t)
    pl.when(visited & ~full)(lambda: tile(True))
    pl.when(visited & full)(lambda: tile(False))

    @pl.when(t == lists.steps - 1)
    def _():
        r["dq"][...] = (r["dq_acc"][...] * st.cfg.scale).astype(r["dq"].dtype)


# --- Wrapper -----------------------------------------------------------------------------------

def _broadcast(x, axis: int, index):
    """Block index of ``index`` along an axis that may be broadcast (size 1)."""
    return index if x.shape[axis] > 1 else 0


def _interpret(cfg: AttentionConfig):
    if not cfg.interpret:
        return False
    return cfg.interpret if isinstance(cfg.interpret, pltpu.InterpretParams) else pltpu.InterpretParams()


def backward(cfg: AttentionConfig, q, k, v, bias, masks: masking.MaskInputs, stats, d_out, delta,
             extras=None):
    """-> (dq, dk, dv, dbias ``[B, Hq, Lq, Lk]`` float32 | None, d_mod_aux), as xla.backward."""
    extras = extras or dropout_sinks.SinksAndDropout()
    dq, dk, dv, dbias = _backward_kernels(cfg, q, k, v, bias, masks, stats, d_out, delta, extras)
    return dq, dk, dv, dbias, tuple(None for _ in extras.mod_aux)  # no mod_aux is read here


class _Operands(NamedTuple):
    """The backward's operands as both kernels read them: heads first, padded to whole tiles
    of both kernels, q, k and v with their non-finite entries as 0."""

    q: object          # [B, Hq, Lq_pad, D]
    k: object          # [B, Hkv, Lk_pad, D]
    v: object          # [B, Hkv, Lk_pad, D]
    do: object         # [B, Hq, Lq_pad, D]
    row_max: object    # [B, Hq, Lq_pad, 1] float32 (padded rows: +inf, so P = 0)
    log_sum: object    # [B, Hq, Lq_pad, 1] float32
    delta: object      # [B, Hq, Lq_pad, 1] float32
    q_poison: object   # [B, Hq, Lq_pad, 1] float32, NaN or 0
    k_poison: object   # [B, Hkv, 1, Lk_pad] float32, NaN or 0
    bias: object       # [Bb, Hb, Lq_pad, Lk_pad] or None
    masks: masking.MaskInputs  # segment ids and the dense mask padded alike
    aux: tuple         # the mod_aux operands


def _operands(cfg: AttentionConfig, q, k, v, bias, masks: masking.MaskInputs, stats, d_out,
              delta, extras, lq_pad: int, lk_pad: int) -> _Operands:
    """Sequences padded to whole tiles of both kernels: the padded positions lie at or past the
    lengths (the length rules are on: ``_Static.mask_cfg``), their rows have max = +inf (P = 0),
    and the tile lists (built for Lq, Lk) never call their tiles full. The non-finite rule once
    per call: finite operands, and each query row's and key's poison."""
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)                       # [B, L, H, D] -> [B, H, L, D]
    q_poison = _pad(online_softmax.row_poison(q).transpose(0, 2, 1), 2, lq_pad)[..., None]
    k_poison = _pad(online_softmax.key_poison(k, v).transpose(0, 2, 1), 2, lk_pad)[:, :, None]
    qh, kh, vh = (_pad(heads_first(online_softmax.finite_or_zero(x)), 2, length)
                  for x, length in ((q, lq_pad), (k, lk_pad), (v, lk_pad)))
    doh = _pad(heads_first(d_out), 2, lq_pad)
    per_row = lambda x, value=0: _pad(x.astype(jnp.float32), 2, lq_pad, value)[..., None]
    row_max, log_sum, delta = per_row(stats.max, jnp.inf), per_row(stats.log_sum), per_row(delta)
    bias = None if bias is None else _pad(_pad(bias, 2, lq_pad), 3, lk_pad)
    padded_masks = masks._replace(
        q_segment_ids=_pad(masks.q_segment_ids, 1, lq_pad),
        kv_segment_ids=_pad(masks.kv_segment_ids, 1, lk_pad),
        mask=None if masks.mask is None else _pad(_pad(masks.mask, 2, lq_pad, False), 3, lk_pad, False))
    aux = tuple(map(mod_aux_operand, extras.mod_aux)) if cfg.has_mods else ()
    return _Operands(qh, kh, vh, doh, row_max, log_sum, delta, q_poison, k_poison, bias,
                     padded_masks, aux)


class _Call(NamedTuple):
    """One backward call as the wrappers of both kernels see it."""

    st: _Static
    ops: _Operands
    masks: masking.MaskInputs  # the call's own (the tile lists are built for Lq and Lk)
    seeds: object              # [Bs * Hs] int32 dropout seeds, or None
    extras: object             # dropout_sinks.SinksAndDropout
    tiles: Blocks
    lq: int
    lk: int
    groups: int                # query heads per kv head
    like: object               # q as given: the outputs vary (inside shard_map) as it does
    operand_bytes: int         # q, k, v, dO and the three row vectors
    pairs: int                 # B * Hq * Lq * Lk

    def scalars(self, lists: common.TileLists) -> dict:
        """Scalar-prefetch operands by name (SMEM): the tile lists, lengths, offsets, seeds."""
        masks, extras = self.masks, self.extras
        named = {"counts": lists.counts, "tiles": lists.indices, "full": lists.full,
                 "q_len": masks.q_len.astype(jnp.int32), "kv_len": masks.kv_len.astype(jnp.int32)}
        if masks.position_offset is not None:
            named["offset"] = masks.position_offset.astype(jnp.int32)
        if self.seeds is not None:
            named["seeds"] = self.seeds
        if extras.dropout_offset is not None:
            named["dropout_offset"] = extras.dropout_offset.astype(jnp.int32)
        return named


def _dkdv_call(call: _Call, k, v):
    """dK/dV: grid (B, Hkv, key tiles, G x query steps), each key tile's list of query tiles
    (transposed ``common.tile_lists``: the walk its index maps and its kernel read)."""
    st, ops, groups = call.st, call.ops, call.groups
    batch, hkv, _, d = ops.k.shape
    bq, bk = call.tiles.q_dkv, call.tiles.k_dkv
    lists = common.tile_lists(st.cfg, call.masks, call.lq, call.lk, bq, bk, transposed=True)
    named_scalars = call.scalars(lists)
    scalar_names = list(named_scalars)
    walk = _static(lists)
    head = lambda kvh, t: kvh * groups + lax.div(t, lists.steps)
    # The query tile of step t: entry t mod steps of (b, head, key tile j)'s list.
    query_tile = lambda b, kvh, j, t, *s: walk.kv_tile(s, b, head(kvh, t), j,
                                                       lax.rem(t, lists.steps))
    q_spec = pl.BlockSpec((None, None, bq, d), lambda b, kvh, j, t, *s: (
        b, head(kvh, t), query_tile(b, kvh, j, t, *s), 0))
    row_spec = pl.BlockSpec((None, None, bq, 1), lambda b, kvh, j, t, *s: (
        b, head(kvh, t), query_tile(b, kvh, j, t, *s), 0))
    kv_spec = pl.BlockSpec((None, None, bk, d), lambda b, kvh, j, t, *s: (b, kvh, j, 0))
    pair_spec = lambda x: pl.BlockSpec((None, None, bq, bk), lambda b, kvh, j, t, *s: (
        _broadcast(x, 0, b), _broadcast(x, 1, head(kvh, t)), query_tile(b, kvh, j, t, *s), j))
    inputs = {"q": (ops.q, q_spec), "k": (ops.k, kv_spec), "v": (ops.v, kv_spec),
              "do": (ops.do, q_spec), "max": (ops.row_max, row_spec),
              "log_sum": (ops.log_sum, row_spec), "delta": (ops.delta, row_spec),
              "q_poison": (ops.q_poison, row_spec),
              "k_poison": (ops.k_poison, pl.BlockSpec((None, None, 1, bk), lambda b, kvh, j, t, *s: (
                  b, kvh, 0, j)))}
    _add_mask_inputs(inputs, ops.masks, ops.bias, ops.aux, pair_spec,
                     q_seg=lambda b, kvh, j, t, *s: (b, query_tile(b, kvh, j, t, *s), 0),
                     kv_seg=lambda b, kvh, j, t, *s: (b, 0, j), bq=bq, bk=bk)
    names = scalar_names + list(inputs) + ["dk", "dv", "dk_acc", "dv_acc"]
    itemsize = lambda x: x.size * x.dtype.itemsize
    return pl.pallas_call(
        functools.partial(_dkdv_kernel, names=names,
                          st=dataclasses.replace(st, block_q=bq, block_k=bk), groups=groups,
                          lists=walk),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalar_names),
            grid=(batch, hkv, lists.rows, groups * lists.steps),
            in_specs=[spec for _, spec in inputs.values()], out_specs=[kv_spec, kv_spec],
            scratch_shapes=[pltpu.VMEM((bk, d), jnp.float32)] * 2),
        out_shape=[vma.out_struct(ops.k.shape, k.dtype, call.like),
                   vma.out_struct(ops.v.shape, v.dtype, call.like)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(
            flops=8 * call.pairs * d, transcendentals=call.pairs,
            bytes_accessed=call.operand_bytes + itemsize(k) + itemsize(v)),
        interpret=_interpret(st.cfg), name="flash_attention_tpu_dkdv",
    )(*named_scalars.values(), *(x for x, _ in inputs.values()))


def _dq_call(call: _Call, q):
    """dQ (and dbias): grid (B, Hq, query tiles, key steps), each query tile's list of key
    tiles (``common.tile_lists``: the walk its index maps and its kernel read). -> (dq, dS
    [B, Hq, Lq_pad, Lk_pad] float32 with ``cfg.bias_gradient`` and a bias, else None)."""
    st, ops, groups = call.st, call.ops, call.groups
    batch, hq, lq_pad, d = ops.q.shape
    lk_pad = ops.k.shape[2]
    bq, bk = call.tiles.q_dq, call.tiles.k_dq
    lists = common.tile_lists(st.cfg, call.masks, call.lq, call.lk, bq, bk)
    named_scalars = call.scalars(lists)
    scalar_names = list(named_scalars)
    walk = _static(lists)
    key_tile = lambda b, h, i, t, *s: walk.kv_tile(s, b, h, i, t)
    q_spec = pl.BlockSpec((None, None, bq, d), lambda b, h, i, t, *s: (b, h, i, 0))
    row_spec = pl.BlockSpec((None, None, bq, 1), lambda b, h, i, t, *s: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, bk, d), lambda b, h, i, t, *s: (
        b, lax.div(h, groups), key_tile(b, h, i, t, *s), 0))
    pair_spec = lambda x: pl.BlockSpec((None, None, bq, bk), lambda b, h, i, t, *s: (
        _broadcast(x, 0, b), _broadcast(x, 1, h), i, key_tile(b, h, i, t, *s)))
    inputs = {"q": (ops.q, q_spec), "k": (ops.k, kv_spec), "v": (ops.v, kv_spec),
              "do": (ops.do, q_spec), "max": (ops.row_max, row_spec),
              "log_sum": (ops.log_sum, row_spec), "delta": (ops.delta, row_spec),
              "q_poison": (ops.q_poison, row_spec),
              "k_poison": (ops.k_poison, pl.BlockSpec((None, None, 1, bk), lambda b, h, i, t, *s: (
                  b, lax.div(h, groups), 0, key_tile(b, h, i, t, *s))))}
    _add_mask_inputs(inputs, ops.masks, ops.bias, ops.aux, pair_spec,
                     q_seg=lambda b, h, i, t, *s: (b, i, 0),
                     kv_seg=lambda b, h, i, t, *s: (b, 0, key_tile(b, h, i, t, *s)), bq=bq, bk=bk)
    out_specs, out_shape, outputs = [q_spec], [vma.out_struct(ops.q.shape, q.dtype, call.like)], ["dq"]
    aliases = {}
    write_dbias = ops.bias is not None and st.cfg.bias_gradient
    if write_dbias:  # zeros in, updated in place: the skipped tiles stay 0
        aliases = {len(named_scalars) + len(inputs): 1}
        inputs["dbias_zeros"] = (vma.like(jnp.zeros((batch, hq, lq_pad, lk_pad), jnp.float32),
                                          vma.axes_of(call.like)), pl.BlockSpec(memory_space=pl.ANY))
        out_specs.append(pl.BlockSpec((None, None, bq, bk), lambda b, h, i, t, *s: (
            b, h, i, key_tile(b, h, i, t, *s))))
        out_shape.append(vma.out_struct((batch, hq, lq_pad, lk_pad), jnp.float32, call.like))
        outputs.append("dbias")
    names = scalar_names + list(inputs) + outputs + ["dq_acc"]
    results = pl.pallas_call(
        functools.partial(_dq_kernel, names=names,
                          st=dataclasses.replace(st, block_q=bq, block_k=bk), lists=walk),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalar_names), grid=(batch, hq, lists.rows, lists.steps),
            in_specs=[spec for _, spec in inputs.values()], out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)]),
        out_shape=out_shape, input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(
            flops=6 * call.pairs * d, transcendentals=call.pairs,
            bytes_accessed=call.operand_bytes + q.size * q.dtype.itemsize
            + (4 * call.pairs if write_dbias else 0)),
        interpret=_interpret(st.cfg), name="flash_attention_tpu_dq",
    )(*named_scalars.values(), *(x for x, _ in inputs.values()))
    return results[0], results[1] if write_dbias else None


def _backward_kernels(cfg: AttentionConfig, q, k, v, bias, masks: masking.MaskInputs, stats,
                      d_out, delta, extras):
    batch, lq, hq, _ = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    tiles = blocks(cfg, lq, lk, common.mask_tiles(masks))
    lq_pad = common.round_up(lq, max(tiles.q_dkv, tiles.q_dq))
    lk_pad = common.round_up(lk, max(tiles.k_dkv, tiles.k_dq))
    ops = _operands(cfg, q, k, v, bias, masks, stats, d_out, delta, extras, lq_pad, lk_pad)
    spec = dataclasses.replace(cfg.mask, has_q_lengths=True, has_kv_lengths=True)
    st = _Static(cfg, dataclasses.replace(cfg, mask=spec), 0, 0, common.mxu_precision(cfg, q.dtype),
                 has_offset=masks.position_offset is not None,
                 has_segments=masks.q_segment_ids is not None, has_mask=masks.mask is not None,
                 has_bias=ops.bias is not None, has_dropout=bool(cfg.dropout_rate),
                 has_dropout_offset=extras.dropout_offset is not None,
                 aux_types=mod_aux_types(ops.aux),
                 seeds_shape=None if not cfg.dropout_rate else tuple(extras.dropout_seeds.shape))
    seeds = None
    if cfg.dropout_rate:  # [Bs, Hs] uint32 -> flat int32 (SMEM holds 32-bit words)
        seeds = lax.bitcast_convert_type(extras.dropout_seeds.astype(jnp.uint32), jnp.int32).reshape(-1)
    itemsize = lambda x: x.size * x.dtype.itemsize
    call = _Call(st, ops, masks, seeds, extras, tiles, lq, lk, hq // hkv, q,
                 operand_bytes=sum(itemsize(x) for x in (q, k, v, d_out)) + 3 * 4 * batch * hq * lq,
                 pairs=batch * hq * lq * lk)
    dk, dv = _dkdv_call(call, k, v)
    dq, dbias = _dq_call(call, q)
    dbias = None if dbias is None else dbias[:, :, :lq, :lk]
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)
    return heads_first(dq[:, :, :lq]), heads_first(dk[:, :, :lk]), heads_first(dv[:, :, :lk]), dbias


def _static(lists: common.TileLists) -> common.TileLists:
    """The lists' static part (their row arithmetic), for the kernels and index maps."""
    return lists._replace(counts=None, indices=None, full=None)


def _seed_index(shape, b, h):
    """Flat index of (b, h) in seeds ``[Bs, Hs]`` (either axis may be broadcast)."""
    bs, hs = shape
    return (b if bs > 1 else 0) * hs + (h if hs > 1 else 0)


def _add_mask_inputs(inputs, masks, bias, aux, pair_spec, *, q_seg, kv_seg, bq, bk):
    """The optional per-tile operands: segment ids ([B, Lq, 1] and [B, 1, Lk] tiles), the dense
    mask (int8) and bias ([bq, bk] tiles, broadcast axes kept), the mod_aux (whole arrays)."""
    if masks.q_segment_ids is not None:
        inputs["q_seg"] = (masks.q_segment_ids.astype(jnp.int32)[:, :, None],
                           pl.BlockSpec((None, bq, 1), q_seg))
        inputs["kv_seg"] = (masks.kv_segment_ids.astype(jnp.int32)[:, None, :],
                            pl.BlockSpec((None, 1, bk), kv_seg))
    if masks.mask is not None:
        inputs["mask"] = (masks.mask.astype(jnp.int8), pair_spec(masks.mask))
    if bias is not None:
        inputs["bias"] = (bias, pair_spec(bias))
    for n, x in enumerate(aux):
        inputs[f"aux{n}"] = (x, pl.BlockSpec(x.shape, lambda *_, nd=x.ndim: (0,) * nd))
