"""Forward kernel: FlashAttention-2's Algorithm 1 in Pallas Mosaic TPU.

Grid ``(B, Hq, query tiles, steps)``: the key axis is innermost and "arbitrary" (the running
m, l and the fp32 output accumulator live in VMEM scratch across it), the others "parallel".
The key axis walks the query tile's non-empty key tiles only (``common.tile_lists``, read
through scalar prefetch): its extent is a static bound on their count, the K/V index maps read
the list (entries past the count repeat the last tile: no new DMA) and the compute of those
steps is skipped. Where the tiles follow from static values alone (full rows or a plain causal
band: ``common.index_schedule_unsupported``) the kernel finds them by index arithmetic instead
(``common.IndexSchedule``: the same tiles in the same order, the same grid and copies, and no
list built or prefetched). Either schedule is the one walk that the K/V index maps and the
kernel body both read. FULL tiles evaluate no mask rule. GQA/MQA: the K/V index maps take the
kv head ``h // group``, nothing is repeated in memory. O is divided by l once, at the last
step, where the natural-log RowStats are written too. The kernel's state is explicit
(``_Kernel``: what it knows at trace time, ``_Refs``: its refs by role) and each step a
function of it (``_init``, ``_visit``, ``_write``).

Precision: bf16 operands multiply natively on the MXU with float32 accumulation (P is rounded
to bf16 for P V, as JAX's TPU flash attention does). float32 operands: at precision DEFAULT
the MXU rounds them to bf16 (one pass); at HIGHEST (the project's default) Mosaic emulates
fp32 in several passes (~5x the MXU time, measured in the static LLO estimate).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

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


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """What the forward kernel knows at trace time: the call (its mask with the padding rule),
    the key axis's schedule (its static part: the walk both the index maps and the body read),
    the tiles, and which optional operands are given."""

    cfg: AttentionConfig
    schedule: object        # common.TileLists (arrays dropped) or common.IndexSchedule
    block_q: int
    block_k: int
    has_offset: bool
    has_finite_flag: bool   # the non-finite rule: K and V's flag, and q's rows in VMEM
    has_segments: bool
    has_mask: bool
    has_bias: bool
    has_sinks: bool
    has_seeds: bool
    precision: object

    @property
    def unit(self) -> float:
        """The logits are held as S / unit (one multiply fewer per plain logit)."""
        return online_softmax.logits_unit(self.cfg, self.has_bias)


class _Refs(NamedTuple):
    """The kernel's refs by role; None where an operand is not given."""

    q_len: object      # SMEM [B] int32
    kv_len: object     # SMEM [B] int32
    offset: object     # SMEM [B] int32 position offsets
    finite: object     # SMEM [1] int32: 1 when K and V are finite
    lists: list        # the schedule's scalar-prefetch refs (none: the index schedule)
    q: object          # [bq, D]
    k: object          # [bk, D]
    v: object          # [bk, D]
    q_seg: object      # [bq, 1] int32
    kv_seg: object     # [1, bk] int32
    mask: object       # [bq, bk] int8
    bias: object       # [bq, bk] float
    sinks: object      # SMEM [Bs, Hs] float32
    seeds: object      # SMEM [Bs, Hs] uint32
    out: object        # [bq, D]
    row_max: object    # [1, bq] float32
    log_sum: object    # [1, bq] float32
    m: object          # VMEM [bq, lanes] float32: the running max
    l: object          # VMEM [bq, lanes] float32: the running sum  # noqa: E741
    acc: object        # VMEM [bq, D] float32: O times l
    q_rule: object     # VMEM [bq, D]: q's rows under the non-finite rule

    @classmethod
    def split(cls, refs, kernel: _Kernel) -> "_Refs":
        refs = list(refs)
        take = lambda present=True: refs.pop(0) if present else None
        scalars = (take(), take(), take(kernel.has_offset), take(kernel.has_finite_flag))
        lists = [take() for _ in range(kernel.schedule.num_operands)]
        return cls(*scalars, lists, take(), take(), take(), take(kernel.has_segments),
                   take(kernel.has_segments), take(kernel.has_mask), take(kernel.has_bias), take(kernel.has_sinks),
                   take(kernel.has_seeds), take(), take(), take(), take(), take(), take(),
                   take(kernel.has_finite_flag))


def _init(kernel: _Kernel, r: _Refs, b, h):
    """A query tile's first step: m and l before any key (a sink's), O = 0, q's rows under the
    non-finite rule once (read by every step)."""
    sink = common.per_head(r.sinks, b, h)
    m, l = common.initial_stats(kernel.block_q, None if sink is None else sink / kernel.unit)
    r.m[...], r.l[...] = m, l
    r.acc[...] = jnp.zeros_like(r.acc)
    if r.q_rule is not None:
        r.q_rule[...] = online_softmax.poisoned_rows(r.q[...])


def _visit(kernel: _Kernel, r: _Refs, b, h, i, step, rules: common.TileRules,
           poisoned: bool = False):
    """One visited key tile: its mask (``rules``), logits, online softmax step, dropout and
    P V, folded into the VMEM state. ``poisoned``: K's and V's tiles take the non-finite rule
    (q's rows again: the rule is idempotent)."""
    cfg = kernel.cfg
    kv_tile = kernel.schedule.visited_tile(r.lists, b, h, i, step)
    pos = common.TilePositions.create(i, kv_tile, kernel.block_q, kernel.block_k)
    allowed = common.tile_allowed(
        cfg, pos, rules, b=b, h=h, q_len=r.q_len[b], kv_len=r.kv_len[b],
        position_offset=None if r.offset is None else r.offset[b],
        q_segment_ids=None if r.q_seg is None else r.q_seg[...],
        kv_segment_ids=None if r.kv_seg is None else r.kv_seg[...],
        mask_tile=None if r.mask is None else r.mask[...])
    q, k, v = (r.q if r.q_rule is None else r.q_rule)[...], r.k[...], r.v[...]
    if poisoned:
        q, k, v = online_softmax.operands_poisoned(q, k, v)
    qk = common.dot_nt(q, k, kernel.precision)
    s = qk if kernel.unit != 1.0 else common.tile_logits(
        cfg, qk, pos, b=b, h=h, bias_tile=None if r.bias is None else r.bias[...])[0]
    if kernel.has_bias:  # an additive -inf bias excludes its pair (online_softmax.attended)
        allowed = masking.all_of([allowed, s != -jnp.inf])
    rescale, p, m, l = common.online_step(r.m[...], r.l[...], s, allowed, kernel.unit)
    if r.seeds is not None:  # on P where it meets V; m and l stay the undropped ones
        keep = dropout_sinks.keep(common.per_head(r.seeds, b, h), pos.rows, pos.cols,
                                  cfg.dropout_rate)
        p = dropout_sinks.apply_dropout(p, keep, cfg.dropout_rate)
    pv = common.dot_nn(p.astype(v.dtype), v, kernel.precision)
    r.acc[...] = r.acc[...] * common.lanes(rescale, pv.shape[-1]) + pv
    r.m[...], r.l[...] = m, l


def _write(kernel: _Kernel, r: _Refs):
    """A query tile's last step: O = acc / l and the natural-log RowStats."""
    out, row_max, log_sum = common.finalize(r.acc[...], r.m[...] * kernel.unit, r.l[...])
    r.out[...] = out.astype(r.out.dtype)
    # [bq, lanes] -> [1, bq]: the row statistics as a lane-dense row.
    r.row_max[...] = row_max.T[:1, :]
    r.log_sum[...] = log_sum.T[:1, :]


def _forward_kernel(*refs, kernel: _Kernel):
    """Grid step (b, h, query tile i, step): the schedule's tile of the step, if visited."""
    r = _Refs.split(refs, kernel)
    b, h, i, step = (pl.program_id(axis) for axis in range(4))
    pl.when(step == 0)(lambda: _init(kernel, r, b, h))
    visited = kernel.schedule.visited(r.lists, b, h, i, step)
    is_full = kernel.schedule.is_full(r.lists, b, h, i, step)
    visit = functools.partial(_visit, kernel, r, b, h, i, step)

    def visit_finite():
        if visited is True and is_full is True:
            visit(common.FULL_TILE)  # known at trace time (the index schedule's whole rows)
        else:
            pl.when(visited & is_full)(lambda: visit(common.FULL_TILE))
            pl.when(visited & jnp.logical_not(is_full))(lambda: visit(common.PARTIAL_TILE))

    if r.finite is None:
        visit_finite()
    else:
        # K or V holds a non-finite value: every visited tile takes the rule on its values in
        # VMEM (and evaluates its mask rule). Finite K and V, the common case, skip it.
        finite = r.finite[0] != 0  # 1 = finite
        pl.when(finite)(visit_finite)
        pl.when(jnp.logical_and(jnp.logical_not(finite), visited))(
            lambda: visit(common.PARTIAL_TILE, poisoned=True))
    pl.when(step == kernel.schedule.steps - 1)(lambda: _write(kernel, r))


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


def schedule_of(cfg: AttentionConfig, masks: masking.MaskInputs, lq: int, lk: int,
                block_q: int, block_k: int, schedule: str | None = None):
    """The key axis's walk: ``common.IndexSchedule`` where the call's tiles follow from static
    values (full rows or a plain causal band), else ``common.tile_lists``; ``schedule`` ("lists"
    or "index") forces one (the tests compare them)."""
    if schedule is None:
        schedule = "lists" if common.index_schedule_unsupported(cfg, masks) else "index"
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")
    if schedule == "index":
        return common.index_schedule(cfg, masks, lq, lk, block_q, block_k)
    return common.tile_lists(cfg, masks, lq, lk, block_q, block_k)


def _pad_to(x, axis: int, n: int):
    """``x`` padded with zeros along ``axis`` to ``n``."""
    return x if x.shape[axis] == n else jnp.pad(
        x, [(0, n - x.shape[axis]) if a == axis else (0, 0) for a in range(x.ndim)])


def _inputs(q, k, v, masks: masking.MaskInputs, bias, sinks, seeds, walk, block_q: int,
            block_k: int, groups: int):
    """The kernel's inputs, padded to whole tiles, and their BlockSpecs: (q, k, v tiles (K's
    and V's the walk's key tile), the segment ids, the dense mask and the bias, the sinks and
    seeds in SMEM). q, k, v on [B, H, L_pad, D]."""
    lq_pad, lk_pad, head_dim = q.shape[2], k.shape[2], q.shape[3]

    def kv_tile(b, h, i, step, *prefetch):  # the walk's tile of the step
        return walk.kv_tile(prefetch[len(prefetch) - walk.num_operands:], b, h, i, step)

    q_spec = pl.BlockSpec((None, None, block_q, head_dim), lambda b, h, i, s, *_: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, block_k, head_dim), lambda b, h, i, s, *p: (
        b, lax.div(h, groups), kv_tile(b, h, i, s, *p), 0))
    bcast = lambda x, axis, index: index if x.shape[axis] > 1 else 0
    in_specs, operands = [q_spec, kv_spec, kv_spec], [q, k, v]
    if masks.q_segment_ids is not None:
        operands += [_pad_to(masks.q_segment_ids, 1, lq_pad)[:, :, None],   # [B, Lq_pad, 1]
                     _pad_to(masks.kv_segment_ids, 1, lk_pad)[:, None, :]]  # [B, 1, Lk_pad]
        in_specs += [pl.BlockSpec((None, block_q, 1), lambda b, h, i, s, *_: (b, i, 0)),
                     pl.BlockSpec((None, 1, block_k),
                                  lambda b, h, i, s, *p: (b, 0, kv_tile(b, h, i, s, *p)))]
    for pairs in (masks.mask, bias):
        if pairs is None:
            continue
        if pairs.dtype == jnp.bool_:
            pairs = pairs.astype(jnp.int8)
        operands.append(_pad_to(_pad_to(pairs, 2, lq_pad), 3, lk_pad))
        in_specs.append(pl.BlockSpec(
            (None, None, block_q, block_k),
            lambda b, h, i, s, *p, x=pairs: (bcast(x, 0, b), bcast(x, 1, h), i,
                                             kv_tile(b, h, i, s, *p))))
    for per_head in (None if sinks is None else sinks.astype(jnp.float32), seeds):
        if per_head is not None:  # [Bs, Hs] scalars
            operands.append(per_head)
            in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
    return in_specs, operands, q_spec


def forward_call(cfg: AttentionConfig, q, k, v, masks: masking.MaskInputs, bias=None,
                 sinks=None, seeds=None, *, finite=None, interpret=None,
                 schedule: str | None = None):
    """q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D] -> (out [B, Lq, Hq, D], row max and log-sum
    [B, Hq, Lq] float32). ``bias`` [Bb, Hb, Lq, Lk] or None; ``masks.mask`` the dense mask or
    None; ``sinks`` [Bs, Hs] float32 or None; ``seeds`` the dropout's [Bs, Hs] uint32 head
    seeds (dropout_sinks.head_seeds) or None. ``finite``: int32 [1], 0 when k or v holds a
    non-finite value (``all_finite``); given, the kernel takes online_softmax's non-finite
    rule: on q's rows once per query tile, on K and V tile by tile when the flag is 0. None:
    the operands are known to be finite (no rule). ``schedule``: the key axis's walk
    (``schedule_of``): None, the kernel's choice."""
    batch, lq, hq, head_dim = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    block_q, block_k = block_shape(cfg, lq, lk, common.mask_tiles(masks))
    lq_pad, lk_pad = common.round_up(lq, block_q), common.round_up(lk, block_k)
    walk = schedule_of(cfg, masks, lq, lk, block_q, block_k, schedule)
    list_operands = list(walk.operands()) if walk.num_operands else []
    kernel_cfg = dataclasses.replace(cfg, mask=masking.with_padding(
        cfg.mask, queries_padded=lq_pad != lq, keys_padded=lk_pad != lk))
    # [B, H, L_pad, D]: an XLA transpose, which cancels under jit with a caller's transpose of
    # [B, H, L, D] data. A view of [B, L, H, D] as [B, L, H * D] read in place costs a relayout
    # copy of its own on TPU (the (8, 128) tiles of [B, L, H, D] hold the heads): 1.15x the
    # cycles in the static estimate.
    q = _pad_to(q.transpose(0, 2, 1, 3), 2, lq_pad)       # [B, Hq, Lq_pad, D]
    k = _pad_to(k.transpose(0, 2, 1, 3), 2, lk_pad)       # [B, Hkv, Lk_pad, D]
    v = _pad_to(v.transpose(0, 2, 1, 3), 2, lk_pad)
    in_specs, operands, q_spec = _inputs(q, k, v, masks, bias, sinks, seeds, walk, block_q,
                                         block_k, hq // hkv)
    prefetch = [masks.q_len, masks.kv_len]
    if masks.position_offset is not None:
        prefetch.append(masks.position_offset.astype(jnp.int32))
    if finite is not None:
        prefetch.append(finite)
    prefetch += list_operands
    stats_spec = pl.BlockSpec((None, None, 1, block_q), lambda b, h, i, s, *_: (b, h, 0, i))
    # Inside shard_map (check_vma) every operand varies like the others, and so do the outputs.
    prefetch, operands = vma.like((prefetch, operands), vma.axes_of(prefetch, operands))
    stats_shape = vma.out_struct((batch, hq, 1, lq_pad), jnp.float32, operands[0])
    out_shape = [vma.out_struct((batch, hq, lq_pad, head_dim), q.dtype, operands[0]), stats_shape,
                 stats_shape]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch), grid=(batch, hq, lq_pad // block_q, walk.steps),
        in_specs=in_specs, out_specs=[q_spec, stats_spec, stats_spec],
        scratch_shapes=[pltpu.VMEM((block_q, common.NUM_LANES), jnp.float32),
                        pltpu.VMEM((block_q, common.NUM_LANES), jnp.float32),
                        pltpu.VMEM((block_q, head_dim), jnp.float32)]
        + ([] if finite is None else [pltpu.VMEM((block_q, head_dim), q.dtype)]))
    kernel = _Kernel(
        kernel_cfg, walk if not walk.num_operands else walk._replace(
            counts=None, indices=None, full=None), block_q, block_k,
        has_offset=masks.position_offset is not None, has_finite_flag=finite is not None,
        has_segments=masks.q_segment_ids is not None, has_mask=masks.mask is not None,
        has_bias=bias is not None, has_sinks=sinks is not None, has_seeds=seeds is not None,
        precision=common.mxu_precision(cfg, q.dtype))
    nbytes = lambda x: x.size * x.dtype.itemsize
    cost = common.cost_estimate(
        batch, hq, lq, lk, head_dim, matmuls=2, exps=1, causal=cfg.mask.is_causal,
        bytes_accessed=sum(nbytes(x) for x in operands) + nbytes(q))
    out, row_max, log_sum = pl.pallas_call(
        functools.partial(_forward_kernel, kernel=kernel), grid_spec=grid_spec, out_shape=out_shape,
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
