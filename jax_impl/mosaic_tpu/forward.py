"""Forward kernel: FlashAttention-2's Algorithm 1 in Pallas Mosaic TPU.

Grid ``(B, Hq, query tiles, steps)``: the key axis is innermost and "arbitrary" (the running
m, l and the fp32 output accumulator live in VMEM scratch across it), the others "parallel".
The key axis walks the query tile's non-empty key tiles only (``common.tile_lists``, read
through scalar prefetch): its extent is a static bound on their count, the K/V index maps read
the list (entries past the count repeat the last tile: no new DMA) and the compute of those
steps is skipped; ``schedule="index"`` finds the same tiles by index arithmetic instead (full
rows or a plain causal band: what libtpu's static estimate can follow). FULL tiles evaluate no
mask rule. GQA/MQA: the K/V index maps take the kv head ``h // group``, nothing is repeated in
memory. O is divided by l once, at the last step,
where the natural-log RowStats are written too.

Precision: bf16 operands multiply natively on the MXU with float32 accumulation (P is rounded
to bf16 for P V, as JAX's TPU flash attention does). float32 operands: at precision DEFAULT
the MXU rounds them to bf16 (one pass); at HIGHEST (the project's default) Mosaic emulates
fp32 in several passes (~5x the MXU time, measured in the static LLO estimate).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jax_impl import dropout_sinks, masking, online_softmax, vma
from jax_impl.config import AttentionConfig
from jax_impl.mosaic_tpu import common

# libtpu's static estimate (benchmarks/results/tpu/estimate.md): 1024-tiles take 0.70x (v6e)
# and 0.90x (v5e) the cycles of 512, and every configuration of the compile report fits VMEM.
DEFAULT_BLOCK = 1024
_SCHEDULE = contextvars.ContextVar("mosaic_tpu_forward_schedule", default="lists")


@contextlib.contextmanager
def index_schedule():
    """Forwards traced inside take ``schedule="index"`` (``forward_call``): for libtpu's static
    LLO estimate of a whole ``flash_attention`` program (benchmarks/tpu_estimate.py)."""
    token = _SCHEDULE.set("index")
    try:
        yield
    finally:
        _SCHEDULE.reset(token)


def _forward_kernel(*refs, cfg: AttentionConfig, schedule, block_q: int,
                    block_k: int, has_offset: bool, has_finite_flag: bool, has_segments: bool,
                    has_mask: bool, has_bias: bool, has_sinks: bool, has_seeds: bool, precision):
    refs = list(refs)
    take = lambda present: refs.pop(0) if present else None
    q_len_ref, kv_len_ref = refs.pop(0), refs.pop(0)
    offset_ref, finite_ref = take(has_offset), take(has_finite_flag)
    lists = [refs.pop(0) for _ in range(schedule.num_operands)]
    q_ref, k_ref, v_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    q_seg_ref, kv_seg_ref = take(has_segments), take(has_segments)
    mask_ref, bias_ref, sinks_ref = take(has_mask), take(has_bias), take(has_sinks)
    seeds_ref = take(has_seeds)
    o_ref, max_ref, log_sum_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    m_scratch, l_scratch, acc_scratch = refs.pop(0), refs.pop(0), refs.pop(0)
    q_scratch = take(has_finite_flag)  # q under the non-finite rule

    b, h, i, step = (pl.program_id(axis) for axis in range(4))
    unit = online_softmax.logits_unit(cfg, has_bias)  # one multiply fewer per plain logit

    @pl.when(step == 0)
    def _init():
        sink = common.per_head(sinks_ref, b, h)
        m, l = common.initial_stats(block_q, None if sink is None else sink / unit)
        m_scratch[...], l_scratch[...] = m, l
        acc_scratch[...] = jnp.zeros_like(acc_scratch)
        if q_scratch is not None:  # q's rows under the rule once, read by every step
            q_scratch[...] = online_softmax.poisoned_rows(q_ref[...])

    def visit(rules: common.TileRules, poisoned: bool = False):
        kv_tile = schedule.visited_tile(lists, b, h, i, step)
        pos = common.TilePositions.create(i, kv_tile, block_q, block_k)
        allowed = common.tile_allowed(
            cfg, pos, rules, b=b, h=h, q_len=q_len_ref[b], kv_len=kv_len_ref[b],
            position_offset=None if offset_ref is None else offset_ref[b],
            q_segment_ids=None if q_seg_ref is None else q_seg_ref[...],
            kv_segment_ids=None if kv_seg_ref is None else kv_seg_ref[...],
            mask_tile=None if mask_ref is None else mask_ref[...])
        q, k, v = (q_ref if q_scratch is None else q_scratch)[...], k_ref[...], v_ref[...]
        if poisoned:  # (q's rows again: the rule is idempotent)
            q, k, v = online_softmax.operands_poisoned(q, k, v)
        qk = common.dot_nt(q, k, precision)
        s = qk if unit != 1.0 else common.tile_logits(
            cfg, qk, pos, b=b, h=h, bias_tile=None if bias_ref is None else bias_ref[...])[0]
        if has_bias:  # an additive -inf bias excludes its pair (online_softmax.attended)
            allowed = masking.all_of([allowed, s != -jnp.inf])
        rescale, p, m, l = common.online_step(m_scratch[...], l_scratch[...], s, allowed, unit)
        if seeds_ref is not None:  # on P where it meets V; m and l stay the undropped ones
            keep = dropout_sinks.keep(common.per_head(seeds_ref, b, h), pos.rows, pos.cols,
                                      cfg.dropout_rate)
            p = dropout_sinks.apply_dropout(p, keep, cfg.dropout_rate)
        pv = common.dot_nn(p.astype(v.dtype), v, precision)
        acc_scratch[...] = acc_scratch[...] * common.lanes(rescale, pv.shape[-1]) + pv
        m_scratch[...], l_scratch[...] = m, l

    visited, is_full = schedule.visited(lists, b, h, i, step), schedule.is_full(lists, b, h, i, step)

    def visit_finite():
        if visited is True and is_full is True:
            visit(common.FULL_TILE)  # known at trace time (the index schedule's whole rows)
        else:
            pl.when(visited & is_full)(lambda: visit(common.FULL_TILE))
            pl.when(visited & jnp.logical_not(is_full))(lambda: visit(common.PARTIAL_TILE))

    if finite_ref is None:
        visit_finite()
    else:
        # K or V holds a non-finite value: every visited tile takes the rule on its values in
        # VMEM (and evaluates its mask rule). Finite K and V, the common case, skip it.
        # 1 = finite: libtpu's static estimate, which does not read the flag, then follows the
        # finite path (benchmarks/tpu_estimate.py).
        finite = finite_ref[0] != 0
        pl.when(finite)(visit_finite)
        pl.when(jnp.logical_and(jnp.logical_not(finite), visited))(
            lambda: visit(common.PARTIAL_TILE, poisoned=True))

    @pl.when(step == schedule.steps - 1)
    def _write():
        out, row_max, log_sum = common.finalize(acc_scratch[...], m_scratch[...] * unit,
                                                l_scratch[...])
        o_ref[...] = out.astype(o_ref.dtype)
        # [bq, lanes] -> [1, bq]: the row statistics as a lane-dense row.
        max_ref[...] = row_max.T[:1, :]
        log_sum_ref[...] = log_sum.T[:1, :]


def block_shape(cfg: AttentionConfig, lq: int, lk: int, mask_tiles=None) -> tuple[int, int] | None:
    """(block_q, block_k): ``cfg.block_sizes``' where given, else DEFAULT_BLOCK; clipped to
    the sequences rounded up to the lanes (multiples of 128 both), and with a block_mask of
    ``mask_tiles`` (block_q, block_kv) inside its tiles (``common.tile_inside``); None where no
    such tiles exist."""
    given = cfg.block_sizes
    wanted = ((given.block_q, given.block_k) if given is not None
              else (DEFAULT_BLOCK, DEFAULT_BLOCK))
    mask_tiles = mask_tiles or (None, None)
    shape = tuple(common.tile_inside(block, length, tile)
                  for block, length, tile in zip(wanted, (lq, lk), mask_tiles))
    if None in shape or (given is not None and shape != tuple(
            min(b, common.round_up(n, common.NUM_LANES)) for b, n in zip(wanted, (lq, lk)))):
        return None
    return shape


SCHEDULES = ("lists", "index")


def forward_call(cfg: AttentionConfig, q, k, v, masks: masking.MaskInputs, bias=None,
                 sinks=None, seeds=None, *, finite=None, interpret=None,
                 schedule: str | None = None):
    """q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D] -> (out [B, Lq, Hq, D], row max and log-sum
    [B, Hq, Lq] float32). ``bias`` [Bb, Hb, Lq, Lk] or None; ``masks.mask`` the dense mask or
    None; ``sinks`` [Bs, Hs] float32 or None; ``seeds`` the dropout's [Bs, Hs] uint32 head
    seeds (dropout_sinks.head_seeds) or None. ``finite``: int32 [1], 0 when k or v holds a
    non-finite value (``all_finite``); given, the kernel takes online_softmax's non-finite
    rule: on q's rows once per query tile, on K and V tile by tile when the flag is 0. None:
    the operands are known to be finite (no rule).

    ``schedule``: how the key axis finds its tiles, "lists" (``common.tile_lists``, scalar
    prefetch: every call) or "index" (``common.IndexSchedule``: full rows or a plain causal
    band only, the same tiles in the same order); None: ``index_schedule``'s choice, "lists"
    unless inside ``with index_schedule():``."""
    schedule = _SCHEDULE.get() if schedule is None else schedule
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")
    batch, lq, hq, head_dim = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    groups = hq // hkv
    block_q, block_k = block_shape(cfg, lq, lk, common.mask_tiles(masks))
    lq_pad, lk_pad = common.round_up(lq, block_q), common.round_up(lk, block_k)
    if schedule == "index":
        lists = common.index_schedule(cfg, masks, lq, lk, block_q, block_k)
        list_operands = []
    else:
        lists = common.tile_lists(cfg, masks, lq, lk, block_q, block_k)
        list_operands = list(lists.operands())
    kernel_cfg = dataclasses.replace(cfg, mask=masking.with_padding(
        cfg.mask, queries_padded=lq_pad != lq, keys_padded=lk_pad != lk))
    pad_to = lambda x, axis, n: x if x.shape[axis] == n else jnp.pad(
        x, [(0, n - x.shape[axis]) if a == axis else (0, 0) for a in range(x.ndim)])
    # [B, H, L_pad, D]: an XLA transpose, which cancels under jit with a caller's transpose of
    # [B, H, L, D] data. A view of [B, L, H, D] as [B, L, H * D] read in place costs a relayout
    # copy of its own on TPU (the (8, 128) tiles of [B, L, H, D] hold the heads): 1.15x the
    # cycles in the static estimate.
    q = pad_to(q.transpose(0, 2, 1, 3), 2, lq_pad)       # [B, Hq, Lq_pad, D]
    k = pad_to(k.transpose(0, 2, 1, 3), 2, lk_pad)       # [B, Hkv, Lk_pad, D]
    v = pad_to(v.transpose(0, 2, 1, 3), 2, lk_pad)
    tile_spec = lambda block, index: pl.BlockSpec(
        (None, None, block, head_dim), lambda b, h, i, s, *p: (b, h, index(b, h, i, s, *p), 0))
    kv_spec = lambda block, index: pl.BlockSpec(
        (None, None, block, head_dim),
        lambda b, h, i, s, *p: (b, lax.div(h, groups), index(b, h, i, s, *p), 0))

    def kv_tile(b, h, i, step, *prefetch):
        return lists.kv_tile(prefetch[len(prefetch) - lists.num_operands:], b, h, i, step)

    q_tile = lambda b, h, i, s, *_: i
    bcast = lambda x, axis, index: index if x.shape[axis] > 1 else 0
    in_specs = [tile_spec(block_q, q_tile), kv_spec(block_k, kv_tile), kv_spec(block_k, kv_tile)]
    operands = [q, k, v]
    has_segments = masks.q_segment_ids is not None
    if has_segments:
        operands += [pad_to(masks.q_segment_ids, 1, lq_pad)[:, :, None],   # [B, Lq_pad, 1]
                     pad_to(masks.kv_segment_ids, 1, lk_pad)[:, None, :]]  # [B, 1, Lk_pad]
        in_specs += [pl.BlockSpec((None, block_q, 1), lambda b, h, i, s, *_: (b, i, 0)),
                     pl.BlockSpec((None, 1, block_k),
                                  lambda b, h, i, s, *p: (b, 0, kv_tile(b, h, i, s, *p)))]
    for pairs in (masks.mask, bias):
        if pairs is None:
            continue
        if pairs.dtype == jnp.bool_:
            pairs = pairs.astype(jnp.int8)
        operands.append(pad_to(pad_to(pairs, 2, lq_pad), 3, lk_pad))
        in_specs.append(pl.BlockSpec(
            (None, None, block_q, block_k),
            lambda b, h, i, s, *p, x=pairs: (bcast(x, 0, b), bcast(x, 1, h), i,
                                             kv_tile(b, h, i, s, *p))))
    for per_head in (None if sinks is None else sinks.astype(jnp.float32), seeds):
        if per_head is not None:  # [Bs, Hs] scalars
            operands.append(per_head)
            in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))

    prefetch = [masks.q_len, masks.kv_len]
    if masks.position_offset is not None:
        prefetch.append(masks.position_offset.astype(jnp.int32))
    if finite is not None:
        prefetch.append(finite)
    prefetch += list_operands

    stats_spec = pl.BlockSpec((None, None, 1, block_q), lambda b, h, i, s, *_: (b, h, 0, i))
    out_specs = [tile_spec(block_q, q_tile), stats_spec, stats_spec]
    # Inside shard_map (check_vma) every operand varies like the others, and so do the outputs.
    prefetch, operands = vma.like((prefetch, operands), vma.axes_of(prefetch, operands))
    stats_shape = vma.out_struct((batch, hq, 1, lq_pad), jnp.float32, operands[0])
    out_shape = [vma.out_struct((batch, hq, lq_pad, head_dim), q.dtype, operands[0]), stats_shape,
                 stats_shape]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch), grid=(batch, hq, lq_pad // block_q, lists.steps),
        in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((block_q, common.NUM_LANES), jnp.float32),
                        pltpu.VMEM((block_q, common.NUM_LANES), jnp.float32),
                        pltpu.VMEM((block_q, head_dim), jnp.float32)]
        + ([] if finite is None else [pltpu.VMEM((block_q, head_dim), q.dtype)]))
    kernel = functools.partial(
        _forward_kernel, cfg=kernel_cfg, schedule=lists if schedule == "index" else lists._replace(
            counts=None, indices=None, full=None), block_q=block_q, block_k=block_k,
        has_offset=masks.position_offset is not None, has_finite_flag=finite is not None,
        has_segments=has_segments,
        has_mask=masks.mask is not None, has_bias=bias is not None, has_sinks=sinks is not None,
        has_seeds=seeds is not None, precision=common.mxu_precision(cfg, q.dtype))
    nbytes = lambda x: x.size * x.dtype.itemsize
    cost = common.cost_estimate(
        batch, hq, lq, lk, head_dim, matmuls=2, exps=1, causal=cfg.mask.is_causal,
        bytes_accessed=sum(nbytes(x) for x in operands) + nbytes(q))
    out, row_max, log_sum = pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=cost, interpret=interpret or False, name="flash_attention_forward_tpu",
    )(*prefetch, *operands)
    out = out[:, :, :lq].transpose(0, 2, 1, 3)
    return out, row_max[:, :, 0, :lq], log_sum[:, :, 0, :lq]


def all_finite(*operands):
    """int32 [1]: 1 when every operand is finite, else 0 (``forward_call``'s ``finite`` of k
    and v). One read of each and no write: finite operands, the common case, reach the kernel
    as they are (a copy under the rule would cost a write of each)."""
    # "Not any non-finite" rather than an and of alls: libtpu fuses it into fewer reductions
    # (15,257 cycles against 23,817 for q, k and v on v6e in the static estimate).
    bad = functools.reduce(jnp.logical_or, [
        jnp.logical_not(jnp.all(online_softmax.is_finite(x))) for x in operands])
    return jnp.logical_not(bad).astype(jnp.int32)[None]
