"""The blocked forward and backward as ops that partition themselves under ``jax.jit``.

Without a rule, XLA's partitioner sees the Pallas kernel as an opaque custom call and can only
replicate it: every device gathers all of q, k, v. ``jax.experimental.custom_partitioning``
gives both the forward and the backward (so the whole custom VJP) a rule, valid under GSPMD
(``partition``/``infer_sharding_from_operands``) and Shardy (``sharding_rule``):

* batch and head axes are computed locally, no collective; a head split keeps each kv head
  with its group of query heads (kv heads split the same way, or replicated for MQA);
* mask, bias, lengths and segment ids follow their broadcast axes; outputs keep q's sharding;
* what cannot be honoured is resharded explicitly and said so (``sharding_plan().notes``,
  a ``ShardingWarning`` when the program is partitioned): head_dim, a head split that would
  separate a kv head from its group, a sequence axis the ring cannot take;
* a sequence axis (one mesh axis) runs as a ring (``ring.py``) or an all-to-all
  (``ulysses.py``), two axes as the hybrid, as ``cp_cost`` chooses: q, k, v and segment ids
  sharded along it, bias/mask and dbias along their query rows with every key column (the
  all-to-all reshards a per-head one by head);
* a paged KV cache call (``paged_forward``, the decode path) keeps q's batch and heads, with
  the page table, lengths and sinks; the page pool, shared by the batch, is whole on every
  device but its kv heads (a pool split along its pages is gathered, and said so).

Where XLA cannot call the partitioner back (libtpu) or q's sharding is known while tracing (a
mesh with explicit axes, where custom_partitioning cannot trace the op), the same plan and
per-device functions run through ``jax.shard_map`` (``_call``).

Under ``vmap`` (which custom_partitioning does not support) the mapped axis is folded into
the batch axis (``custom_vmap``).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jax_impl import cp_cost, dropout_sinks, masking, online_softmax, ring, ulysses


class ShardingWarning(UserWarning):
    """An input sharding flash_attention cannot honour: the operand is resharded."""


# --- Operands by name ------------------------------------------------------------------------

_MASK_FIELDS = (("q_len", "q_len"), ("kv_len", "kv_len"), ("q_segment_ids", "q_seg"),
                ("kv_segment_ids", "kv_seg"), ("mask", "mask"), ("position_offset", "offset"))


# dropout_sinks.SinksAndDropout: [Bs, Hs] per-(batch, head) arrays; they follow the batch and head axes.
_EXTRA_FIELDS = (("sinks", "sinks"), ("dropout_seeds", "seeds"))
_PER_HEAD = ("sinks", "seeds")


def _named(q, k, v, bias, masks, extras=None, **more):
    extras = extras or dropout_sinks.SinksAndDropout()
    named = dict(q=q, k=k, v=v, bias=bias, **{short: getattr(masks, field)
                                              for field, short in _MASK_FIELDS},
                 **{short: getattr(extras, field) for field, short in _EXTRA_FIELDS}, **more)
    return {name: x for name, x in named.items() if x is not None}


def _unpack(named):
    masks = masking.MaskInputs(**{field: named.get(short) for field, short in _MASK_FIELDS})
    extras = dropout_sinks.SinksAndDropout(**{field: named.get(short) for field, short in _EXTRA_FIELDS})
    return named["q"], named["k"], named["v"], named.get("bias"), masks, extras


# --- The plan: which mesh axes each operand keeps ---------------------------------------------

@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    batch: tuple      # mesh axes of the batch dim
    heads: tuple      # mesh axes of the query-head dim
    kv_heads: tuple   # mesh axes of the kv-head dim (heads, or () for MQA)
    sequence: tuple   # mesh axes of the sequence dim honoured (ring/all-to-all); () otherwise
    notes: tuple      # what was not honoured, and why
    strategy: str = "ring"  # with ``sequence``: cp_cost's choice, "ring" or "all_to_all"
    choice: cp_cost.Choice | None = None  # the cost model's numbers, when sequence sharded

    def describe(self) -> str:
        if self.sequence:
            how = f"{self.strategy} over {self.sequence} (context parallelism)"
        elif self.batch or self.heads:
            how = f"local: batch over {self.batch or 'none'}, heads over {self.heads or 'none'}, no collective"
        else:
            how = "replicated: every device computes the whole attention"
        return how + "".join(f"; {note}" for note in self.notes)


def _axes(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


@dataclasses.dataclass(frozen=True)
class SequenceCall:
    """What the choice of a context-parallel strategy needs beyond the shapes."""

    has_bias_or_mask: bool = False
    itemsize: int = 4
    requested: str | None = None  # context_parallel_strategy
    shared_pairwise: bool = False  # a bias or dense mask shared by every head (head axis 1)
    pairwise_bytes: int = 0  # the bias and mask bytes an all-to-all moves (cp_cost.estimates)


def sharding_plan(mesh, q_spec, q_shape, k_shape, *,
                  ring_unavailable: str | None = "not offered for this call",
                  call: SequenceCall | None = None) -> ShardingPlan:
    """The plan for q sharded as ``q_spec`` (a PartitionSpec over ``mesh``).
    ``ring_unavailable``: why the call's kernel cannot run a ring (``ring_unavailable``), or
    None. ``call`` None: no all-to-all (the ring or a gather)."""
    spec = tuple(q_spec) + (None,) * (4 - len(tuple(q_spec)))
    batch, seq, heads, dim = (_axes(s) for s in spec[:4])
    b, lq, hq, _ = q_shape
    lk, hkv = k_shape[1], k_shape[2]
    notes = []
    if batch and b % _size(mesh, batch):
        notes.append(f"batch {b} does not divide over {batch}: replicated")
        batch = ()
    kv_heads = heads
    if heads:
        size = _size(mesh, heads)
        if hq % size:
            notes.append(f"{hq} query heads do not divide over {heads}: replicated")
            heads = kv_heads = ()
        elif hkv == 1:
            kv_heads = ()  # MQA: the one kv head goes with every query group
        elif hkv % size:
            notes.append(f"splitting {hq} query heads over {heads} would separate kv heads "
                         f"({hkv}) from their query groups: heads replicated")
            heads = kv_heads = ()
    sequence, strategy, choice = (), "ring", None
    if seq:
        n = _size(mesh, seq)
        # Per device after the batch and head splits (a kv head goes with its query group).
        b_loc, hq_loc = b // _size(mesh, batch), hq // _size(mesh, heads)
        hkv_loc = hkv // _size(mesh, kv_heads)
        shape = (b_loc, lq, lk, hq_loc, hkv_loc, q_shape[3], call.itemsize if call else 4)
        requested = call.requested if call else None
        if set(seq) & set(batch + heads):
            why = f"mesh axis {seq} also shards batch or heads"
            choice = cp_cost.choose(n, shape, ring_unavailable=why, all_to_all_unavailable=why,
                                    requested=requested)
        elif len(seq) == 2:  # the hybrid: all-to-all over the inner axis, ring over the outer
            outer, inner = (mesh.shape[a] for a in seq)
            why = (None if call is not None else "not offered for this call") or (
                f"its ring: {ring_unavailable}" if ring_unavailable else None) or (
                _zigzag_chunks_unavailable(lq, lk, n)) or (
                "a bias or dense mask is not taken by the hybrid (the ring over one axis takes "
                "it)" if call.has_bias_or_mask else ulysses.unavailable(inner, hq_loc, hkv_loc))
            choice = cp_cost.choose(n, shape, hybrid_inner=inner, hybrid_unavailable=why,
                                    requested=requested)
        elif len(seq) > 2:
            raise_reason = f"the sequence is sharded over {len(seq)} mesh axes {seq} (at most two)"
            choice = cp_cost.choose(n, shape, ring_unavailable=raise_reason,
                                    all_to_all_unavailable=raise_reason, requested=requested)
        else:
            ring_reason = ring_unavailable or _zigzag_chunks_unavailable(lq, lk, n)
            a2a_reason = (
                "not offered for this call" if call is None else
                f"sequences {lq}, {lk} do not divide over {n} devices" if lq % n or lk % n else
                ulysses.unavailable(n, hq_loc, hkv_loc, call.shared_pairwise))
            pairwise = (call.pairwise_bytes if call else 0) / (_size(mesh, batch) * _size(mesh, heads))
            choice = cp_cost.choose(n, shape, ring_unavailable=ring_reason,
                                    all_to_all_unavailable=a2a_reason, requested=requested,
                                    pairwise=pairwise)
        if choice.strategy != "all_gather":
            sequence, strategy = seq, choice.strategy
        else:
            reasons = "; ".join(f"{s}: {r}" for s, r in choice.unavailable.items())
            notes.append(f"sequence sharding over {seq} not supported for this call ({reasons}): "
                         "all-gathered" if not choice.requested else
                         f"sequence sharding over {seq}: all-gathered (requested)")
    if dim:
        notes.append(f"head_dim sharding over {dim} cannot be honoured (every dot product "
                     "needs the whole head): all-gathered")
    return ShardingPlan(batch, heads, kv_heads, sequence, tuple(notes), strategy, choice)


def _zigzag_chunks_unavailable(lq: int, lk: int, n: int) -> str | None:
    """Why the zigzag ring over ``n`` devices (2 chunks on each) cannot cut these sequences."""
    uneven = [f"{length} {what}" for length, what in ((lq, "queries"), (lk, "keys")) if length % (2 * n)]
    if uneven:
        return (f"{' and '.join(uneven)} do not divide into {2 * n} chunks (the zigzag ring: "
                f"2 on each of {n} devices)")
    return None


def _specs(plan: ShardingPlan, named_shapes: dict, hq: int, b: int) -> dict:
    """PartitionSpec of every operand and result by name."""
    bt = plan.batch or None
    hd = plan.heads or None
    kv = plan.kv_heads or None
    sq = plan.sequence or None
    specs = dict(q=P(bt, sq, hd, None), k=P(bt, sq, kv, None), v=P(bt, sq, kv, None),
                 q_len=P(bt), kv_len=P(bt), offset=P(bt), q_seg=P(bt, sq), kv_seg=P(bt, sq),
                 d_out=P(bt, sq, hd, None), max=P(bt, hd, sq), log_sum=P(bt, hd, sq),
                 delta=P(bt, hd, sq), out=P(bt, sq, hd, None), dq=P(bt, sq, hd, None),
                 dk=P(bt, sq, kv, None), dv=P(bt, sq, kv, None), dbias=P(bt, hd, sq, None))
    for name in ("bias", "mask") + _PER_HEAD:  # bias/mask: query rows follow the sequence
        if name in named_shapes:                 # (ring), key columns whole
            shape = named_shapes[name]
            pair_axes = (sq, None) if name in ("bias", "mask") else ()
            specs[name] = P(bt if shape[0] == b else None, hd if shape[1] == hq else None, *pair_axes)
    return specs


# --- The two ops -------------------------------------------------------------------------------

FORWARD_RESULTS = ("out", "max", "log_sum")


def _backward_results(cfg, names):
    return ("dq", "dk", "dv") + (("dbias",) if "bias" in names and cfg.bias_gradient else ())


def _forward_body(implementation, cfg, names, *arrays):
    q, k, v, bias, masks, extras = _unpack(dict(zip(names, arrays)))
    if cfg.decode:  # implementations.decode_path chose it: no bias on this path
        out, stats = implementation.decode(cfg, q, k, v, masks, extras, None)
    else:
        out, stats = implementation.forward(cfg, q, k, v, bias, masks, extras)
    return out, stats.max, stats.log_sum


def _backward_body(implementation, cfg, names, *arrays):
    named = dict(zip(names, arrays))
    stats = online_softmax.RowStats(named["max"], named["log_sum"])
    *inputs, extras = _unpack(named)
    dq, dk, dv, dbias, _ = implementation.backward(
        cfg, *inputs, stats, named["d_out"], named["delta"], extras)
    return (dq, dk, dv) + ((dbias,) if dbias is not None else ())


def ring_unavailable(implementation, names) -> str | None:
    """Why a call cannot run as a ring, or None: it needs a local implementation that takes
    MaskInputs.position_offset, and no offset of its own already; with dropout, one that hashes
    at the ring's global positions (``takes_dropout_offset``). Sinks join after the merge."""
    if not implementation.takes_position_offset:
        return f"the local kernel {implementation.name} takes no position offset"
    if "seeds" in names and not implementation.takes_dropout_offset:
        return (f"the local kernel {implementation.name} hashes dropout at local positions "
                "(dropout in a ring needs one that hashes its global positions)")
    if "offset" in names:
        return "the call already carries a position offset"
    return None


def sequence_call(cfg, names, dtype, pairwise=None, hq: int = 1) -> SequenceCall:
    """``pairwise``: {"bias"|"mask": an array or ShapeDtypeStruct ``[Bx, Hx, Lq, Lk]``}."""
    pairwise = pairwise or {}
    # The all-to-all moves the bias forward, backward and dbias back; the mask twice.
    moved = sum((3 if name == "bias" else 2) * math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                for name, x in pairwise.items())
    return SequenceCall(has_bias_or_mask="bias" in names or "mask" in names,
                        itemsize=jnp.dtype(dtype).itemsize,
                        requested=getattr(cfg, "context_parallel_strategy", None),
                        shared_pairwise=any(x.shape[1] != hq for x in pairwise.values()),
                        pairwise_bytes=moved)


def _local_plan(implementation, cfg, mesh, arg_shapes, names):
    named = dict(zip(names, arg_shapes))
    q = named["q"]
    spec = q.sharding.spec if isinstance(q.sharding, NamedSharding) else P()
    pairwise = {n: named[n] for n in ("bias", "mask") if n in named}
    plan = sharding_plan(mesh, spec, q.shape, named["k"].shape,
                         ring_unavailable=ring_unavailable(implementation, names),
                         call=sequence_call(cfg, names, q.dtype, pairwise, q.shape[2]))
    return plan, named


def _a2a_forward_body(axis, n, implementation, cfg, names, *arrays):
    q, k, v, bias, masks, extras = _unpack(dict(zip(names, arrays)))
    out, stats = ulysses.forward(ulysses.Ulysses(axis, n, implementation, cfg), q, k, v, masks,
                                 extras, bias)
    return out, stats.max, stats.log_sum


def _a2a_backward_body(axis, n, implementation, cfg, names, *arrays):
    named = dict(zip(names, arrays))
    q, k, v, bias, masks, extras = _unpack(named)
    stats = online_softmax.RowStats(named["max"], named["log_sum"])
    if bias is not None:  # the op's dbias is [B, Hq, Lq, Lk], as the ring's
        bias = jnp.broadcast_to(bias, q.shape[:1] + bias.shape[1:])
    dq, dk, dv, dbias, _ = ulysses.backward(ulysses.Ulysses(axis, n, implementation, cfg), q, k,
                                            v, masks, stats, named["d_out"], named["delta"],
                                            extras, bias)
    return (dq, dk, dv) + (() if dbias is None else (dbias,))


def _ring_forward_body(axis, n, implementation, cfg, names, *arrays):
    q, k, v, bias, masks, extras = _unpack(dict(zip(names, arrays)))
    out, stats = ring.contiguous_forward(ring.zigzag_ring(cfg, axis, n, implementation),
                                         q, k, v, masks, bias, extras)
    return out, stats.max, stats.log_sum


def _ring_backward_body(axis, n, implementation, cfg, names, *arrays):
    named = dict(zip(names, arrays))
    q, k, v, bias, masks, extras = _unpack(named)
    stats = online_softmax.RowStats(named["max"], named["log_sum"])
    if bias is not None:  # the op's dbias is [B, Hq, Lq, Lk] (recompute_vjp reduces it, across
        bias = jnp.broadcast_to(bias, q.shape[:1] + q.shape[2:3] + bias.shape[2:])  # devices too)
    *grads, dbias, _ = ring.contiguous_backward(
        ring.zigzag_ring(cfg, axis, n, implementation), q, k, v, masks, stats,
        named["d_out"], named["delta"], bias, extras)
    return tuple(grads) + (() if dbias is None else (dbias,))


def _shardings(mesh, plan, named, results):
    hq, b = named["q"].shape[2], named["q"].shape[0]
    specs = _specs(plan, {n: s.shape for n, s in named.items()}, hq, b)
    if "table" in named:  # a paged call (_paged_plan)
        specs.update(k=_pool_spec(plan), v=_pool_spec(plan), table=P(plan.batch or None, None))
    to = lambda n: NamedSharding(mesh, specs[n])
    return tuple(to(n) for n in named), tuple(to(n) for n in results)


def _hybrid(axes, sizes, implementation, cfg):
    """(all-to-all over the inner axis, ring over the outer) of a two-axis sequence."""
    return (ulysses.Ulysses(axes[1], sizes[1], implementation, cfg),
            ring.zigzag_ring(cfg, axes[0], sizes[0], implementation))


def _hybrid_forward_body(axes, sizes, implementation, cfg, names, *arrays):
    q, k, v, _, masks, extras = _unpack(dict(zip(names, arrays)))
    out, stats = ulysses.hybrid_forward(*_hybrid(axes, sizes, implementation, cfg), q, k, v, masks, extras)
    return out, stats.max, stats.log_sum


def _hybrid_backward_body(axes, sizes, implementation, cfg, names, *arrays):
    named = dict(zip(names, arrays))
    q, k, v, _, masks, extras = _unpack(named)
    stats = online_softmax.RowStats(named["max"], named["log_sum"])
    return ulysses.hybrid_backward(*_hybrid(axes, sizes, implementation, cfg), q, k, v, masks,
                                   stats, named["d_out"], named["delta"], extras)[:3]


def _warn(plan: ShardingPlan):
    for note in plan.notes:
        warnings.warn(f"flash_attention: {note}", ShardingWarning, stacklevel=3)


@dataclasses.dataclass(frozen=True)
class _Op:
    """One op two ways: ``partitioned`` (custom_partitioning: XLA's partitioner calls back into
    Python for the plan) and ``shard_mapped`` (the same plan and per-device function through
    ``jax.shard_map``, where libtpu or explicit axes need it: ``_call``)."""

    partitioned: custom_partitioning
    shard_mapped: object  # (implementation, cfg, names, mesh, avals, *arrays) -> results


def _make_op(body, local_of, plan_of, results_of):
    """``local_of(plan, mesh, implementation, cfg, names)``: the per-device function of a plan;
    ``plan_of(implementation, cfg, mesh, arg_shapes, names)``: (plan, operand shapes by name)."""
    def planned(implementation, cfg, names, mesh, arg_shapes):
        plan, named = plan_of(implementation, cfg, mesh, arg_shapes, names)
        args, results = _shardings(mesh, plan, named, results_of(cfg, names))
        return plan, args, results

    def infer(implementation, cfg, names, mesh, arg_shapes, result_shape):
        return planned(implementation, cfg, names, mesh, arg_shapes)[2]

    def partition(implementation, cfg, names, mesh, arg_shapes, result_shape):
        plan, args, results = planned(implementation, cfg, names, mesh, arg_shapes)
        _warn(plan)
        return mesh, local_of(plan, mesh, implementation, cfg, names), results, args

    def rule(implementation, cfg, names, mesh, operand_types, result_types):
        return sharding_rule(names, results_of(cfg, names), operand_types)

    def shard_mapped(implementation, cfg, names, mesh, avals, *arrays):
        plan, args, results = planned(implementation, cfg, names, mesh, avals)
        _warn(plan)
        if AxisType.Explicit in mesh.axis_types:  # typed operands must match in_specs
            arrays = [jax.sharding.reshard(x, s) for x, s in zip(arrays, args)]
        # check_vma=False: the per-device functions are custom_partitioning's, which run
        # untyped (a kernel's outputs need not declare how they vary); the plan fixes the specs.
        return jax.shard_map(local_of(plan, mesh, implementation, cfg, names), mesh=mesh,
                             in_specs=tuple(s.spec for s in args),
                             out_specs=tuple(s.spec for s in results), check_vma=False)(*arrays)

    op = custom_partitioning(body, static_argnums=(0, 1, 2))
    op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                     sharding_rule=rule)
    return _Op(op, shard_mapped)


def _sequence_local_of(body, ring_body, a2a_body, hybrid_body):
    """local_of for the forward and backward ops: local, ring, all-to-all or hybrid by the plan."""
    def local_of(plan, mesh, implementation, cfg, names):
        if plan.strategy == "hybrid" and plan.sequence:
            return functools.partial(hybrid_body, plan.sequence,
                                     tuple(mesh.shape[a] for a in plan.sequence), implementation,
                                     cfg, names)
        if plan.sequence:
            (axis,) = plan.sequence
            sequence_body = ring_body if plan.strategy == "ring" else a2a_body
            return functools.partial(sequence_body, axis, mesh.shape[axis], implementation, cfg,
                                     names)
        return functools.partial(body, implementation, cfg, names)
    return local_of


def sharding_rule(names, results, operand_types):
    """Einsum-like Shardy rule: b batch, q/k sequences, n kv heads, g group, d head dim."""
    shapes = dict(zip(names, (tuple(t.shape) for t in operand_types)))
    b, hq, hkv = shapes["q"][0], shapes["q"][2], shapes["k"][2]
    groups = hq // hkv
    # Shardy refuses a size-1 factor inside a compound dim: MQA's query heads are all "g".
    h = "n" if groups == 1 else "g" if hkv == 1 else "(n g)"
    pool = "table" in shapes  # a paged call: k and v are the page pool, shared by the batch
    factors = dict(q=f"b q {h} d", k="p s n d" if pool else "b k n d",
                   v="p s n d" if pool else "b k n d", table="b t", q_len="b", kv_len="b", offset="b",
                   q_seg="b q", kv_seg="b k", d_out=f"b q {h} d", max=f"b {h} q",
                   log_sum=f"b {h} q", delta=f"b {h} q", out=f"b q {h} d", dq=f"b q {h} d",
                   dk="b k n d", dv="b k n d", dbias=f"b {h} q k")
    for name in ("bias", "mask") + _PER_HEAD:
        if name in shapes:
            bb, hb = shapes[name][:2]
            factors[name] = (f"{'b' if bb == b else name + '_b1'} "
                             f"{h if hb == hq else name + '_h1'}" + (" q k" if name in ("bias", "mask") else ""))
    rule = ", ".join(factors[n] for n in names) + " -> " + ", ".join(factors[n] for n in results)
    return (rule, {"g": groups}) if h == "(n g)" else rule


# --- The paged-cache forward: the decode path on a page pool shared by the batch --------------

def _pool_spec(plan: ShardingPlan):
    """The page pool on every device, split only along kv heads with their query groups: any
    row's page ids may point anywhere in the pool, so no page can be left off a device."""
    return P(None, None, plan.kv_heads or None, None)


def _paged_plan(mesh, named) -> ShardingPlan:
    """q's batch and heads as ``sharding_plan`` keeps them (a sequence split is not honoured:
    the decode path reads the whole cache); a pool sharded other than ``_pool_spec`` is
    gathered, and said so."""
    q, pages, table = named["q"], named["k"], named["table"]
    spec_of = lambda x: tuple(x.sharding.spec) if isinstance(x.sharding, NamedSharding) else ()
    plan = sharding_plan(mesh, spec_of(q), q.shape,
                         (q.shape[0], table.shape[1] * pages.shape[1], *pages.shape[2:]),
                         ring_unavailable="a paged KV cache runs on the decode path")
    want = tuple(_pool_spec(plan))
    notes = tuple(
        f"{name}_pages sharded as {spec_of(named[name])}: the page pool is shared by the whole "
        "batch (page ids index all of it), so every device holds all of it, split at most along "
        f"its kv heads like the query heads: all-gathered to {_pool_spec(plan)}; keep it "
        "replicated, or split only its kv heads" for name in ("k", "v")
        if any(set(_axes(got)) - set(_axes(w)) for got, w in zip(spec_of(named[name]), want)))
    return dataclasses.replace(plan, notes=plan.notes + notes)


def _paged_body(implementation, cfg, names, *arrays):
    named = dict(zip(names, arrays))
    q, k, v, _, masks, extras = _unpack(named)
    out, stats = implementation.decode(cfg, q, k, v, masks, extras, named["table"])
    return out, stats.max, stats.log_sum


def _paged_plan_of(implementation, cfg, mesh, arg_shapes, names):
    named = dict(zip(names, arg_shapes))
    return _paged_plan(mesh, named), named


_paged_op = _make_op(_paged_body,
                     lambda plan, mesh, implementation, cfg, names:
                     functools.partial(_paged_body, implementation, cfg, names),
                     _paged_plan_of, lambda cfg, names: FORWARD_RESULTS)
_forward_op = _make_op(_forward_body, _sequence_local_of(
    _forward_body, _ring_forward_body, _a2a_forward_body, _hybrid_forward_body), _local_plan,
    lambda cfg, names: FORWARD_RESULTS)
_backward_op = _make_op(_backward_body, _sequence_local_of(
    _backward_body, _ring_backward_body, _a2a_backward_body, _hybrid_backward_body), _local_plan,
    _backward_results)


# --- Without custom_partitioning: shard_map ------------------------------------------------------

# Platforms whose XLA never calls the Python partitioner back: libtpu ("Custom emitter for
# CustomSPMDPartitioning not found", jax-ml/jax#38196). Tests add "cpu" to check that route.
NO_CUSTOM_PARTITIONING = ("tpu",)


def _call(op: _Op, implementation, cfg, names, *arrays):
    """``op`` on ``arrays`` over the devices of q's mesh. q's sharding known while tracing (a
    mesh with explicit axes): the plan through shard_map, on every platform (custom_partitioning
    cannot even trace the op with such operands, and libtpu cannot partition it). Else
    custom_partitioning, and, lowered for a platform of NO_CUSTOM_PARTITIONING, shard_map with
    the operands replicated (every device computes the whole call) and a warning."""
    q = arrays[names.index("q")]
    mesh = jax.typeof(q).sharding.mesh
    if mesh.size <= 1 or AxisType.Manual in mesh.axis_types:  # one device or inside shard_map:
        return op.partitioned(implementation, cfg, names, *arrays)  # custom_partitioning inlines
    shard_mapped = functools.partial(op.shard_mapped, implementation, cfg, names, mesh,
                                     tuple(jax.typeof(x) for x in arrays))
    if _known_sharding(q) is not None:
        return shard_mapped(*arrays)
    platform = getattr(mesh.abstract_device, "platform", None)
    if platform is not None and platform not in NO_CUSTOM_PARTITIONING:
        return op.partitioned(implementation, cfg, names, *arrays)
    if platform is not None:
        warnings.warn(
            f"flash_attention on {platform}: its XLA cannot call back into custom partitioning "
            "and q's sharding is not known while tracing (a mesh with automatic axes), so every "
            "device computes the whole call (its operands are gathered). For the local "
            "batch/head split and the ring or all-to-all over the sequence, use a mesh with "
            "explicit axes (jax.make_mesh(..., axis_types=(AxisType.Explicit, ...))) or call "
            "flash_attention inside jax.shard_map", ShardingWarning, stacklevel=2)
    return jax.lax.platform_dependent(
        *arrays, **{p: shard_mapped for p in NO_CUSTOM_PARTITIONING},
        default=functools.partial(op.partitioned, implementation, cfg, names))


def _known_sharding(x) -> NamedSharding | None:
    """x's NamedSharding over more than one device where it is known while tracing: an
    array's own; a tracer's on a mesh with explicit axes (on an automatic one only the mesh is,
    the partitioner decides later)."""
    if isinstance(x, jax.core.Tracer):
        sharding = jax.typeof(x).sharding
        if AxisType.Explicit not in getattr(sharding.mesh, "axis_types", ()):
            return None
    else:
        sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh.size <= 1:
        return None
    return sharding


# --- vmap: fold the mapped axis into the batch axis ------------------------------------------

def _folded(op, implementation, cfg, names):
    @jax.custom_batching.custom_vmap
    def call(*arrays):
        return _call(op, implementation, cfg, names, *arrays)

    @call.def_vmap
    def rule(axis_size, in_batched, *arrays):
        b = dict(zip(names, arrays))["q"].shape[0 + in_batched[names.index("q")]]
        pool = {"k", "v"} if "table" in names else set()  # a paged call's pages: no batch axis
        batched_pool = any(batched for name, batched in zip(names, in_batched) if name in pool)
        folded = []
        for name, x, batched in zip(names, arrays, in_batched):
            if name in pool and not batched_pool:
                folded.append(x)  # one pool for every mapped call
                continue
            if not batched:
                x = jnp.broadcast_to(x, (axis_size,) + x.shape)
            if name in ("bias", "mask") + _PER_HEAD and x.shape[1] != b:  # broadcast batch: materialise it
                x = jnp.broadcast_to(x, (axis_size, b) + x.shape[2:])
            if name == "table" and batched_pool:  # the pools are stacked: call i's ids move up
                num_pages = dict(zip(names, arrays))["k"].shape[int(in_batched[names.index("k")])]
                x = x + (jnp.arange(axis_size, dtype=x.dtype) * num_pages)[:, None, None]
            folded.append(x.reshape((axis_size * x.shape[1],) + x.shape[2:]))
        outs = _folded(op, implementation, cfg, names)(*folded)
        outs = tuple(o.reshape((axis_size, b) + o.shape[1:]) for o in outs)
        return outs, tuple(True for _ in outs)

    return call


def paged_forward(implementation, cfg, q, k_pages, v_pages, masks, extras, page_table):
    """``implementation.decode`` on a paged cache, partitioned under jit: batch and heads local
    (the page table, lengths and sinks follow q's batch), the page pool whole on every device
    but its kv heads (``_pool_spec``)."""
    if _unpartitioned(implementation, cfg, masks, extras):
        return _one_program(implementation, implementation.decode,
                            (cfg, q, k_pages, v_pages, masks, extras, page_table), _forward_like(q))
    named = _named(q, k_pages, v_pages, None, masks, extras, table=page_table)
    names = tuple(named)
    out, row_max, log_sum = _folded(_paged_op, implementation, cfg, names)(*named.values())
    return out, online_softmax.RowStats(row_max, log_sum)


def forward(implementation, cfg, q, k, v, bias, masks, extras=None):
    """Like ``Implementation.forward``, partitioned under jit."""
    if cfg.decode and not implementation.decode:
        raise ValueError(f"cfg.decode=True but {implementation.name} has no decode path")
    if _unpartitioned(implementation, cfg, masks, extras):
        if cfg.decode:  # its decode path, interpreted, runs unpartitioned too
            return _one_program(implementation, implementation.decode,
                                (cfg, q, k, v, masks, extras, None), _forward_like(q))
        return _one_program(implementation, implementation.forward,
                            (cfg, q, k, v, bias, masks, extras), _forward_like(q))
    named = _named(q, k, v, bias, masks, extras)
    names = tuple(named)
    out, row_max, log_sum = _folded(_forward_op, implementation, cfg, names)(*named.values())
    return out, online_softmax.RowStats(row_max, log_sum)


def backward(implementation, cfg, q, k, v, bias, masks, stats, d_out, delta, extras=None):
    """Like ``Implementation.backward``, partitioned under jit (the sinks are not needed: P
    comes from the row statistics, which include them)."""
    extras = None if extras is None else extras._replace(sinks=None)
    if _unpartitioned(implementation, cfg, masks, extras):
        like = tuple(_type_sharding(x) for x in (q, k, v))
        mod_aux = () if extras is None else extras.mod_aux
        return _one_program(implementation, implementation.backward,
                            (cfg, q, k, v, bias, masks, stats, d_out, delta, extras),
                            (*like, None if bias is None else _type_sharding(bias),
                             tuple(_type_sharding(a) for a in mod_aux)))
    named = _named(q, k, v, bias, masks, extras, max=stats.max, log_sum=stats.log_sum, d_out=d_out,
                   delta=delta)
    names = tuple(named)
    grads = _folded(_backward_op, implementation, cfg, names)(*named.values())
    return tuple(grads) + ((None,) if bias is None or not cfg.bias_gradient else ()) + ((),)


def _type_sharding(x) -> NamedSharding | None:
    """x's sharding where it is part of x's type (a mesh with explicit axes) and splits x."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if (not isinstance(sharding, NamedSharding) or AxisType.Explicit not in mesh.axis_types
            or all(axes is None for axes in sharding.spec)):
        return None
    return sharding


def _forward_like(q):
    """The shardings of a forward's (out, RowStats) given back where q's is in its type."""
    sharding = _type_sharding(q)
    if sharding is None:
        return None, online_softmax.RowStats(None, None)
    b, l, h = (tuple(sharding.spec) + (None,) * 3)[:3]
    stats = NamedSharding(sharding.mesh, P(b, h, l))  # [B, Hq, Lq]
    return sharding, online_softmax.RowStats(stats, stats)


def _one_program(implementation, call, operands: tuple, results_like):
    """``call(*operands)`` as one program over the global arrays. Where an operand's sharding
    is part of its type (a mesh with explicit axes), the implementation's ops would mix
    operands of different shardings and fail to trace (a ShardingTypeError): the call runs
    inside ``jax.shard_map`` on replicated operands instead, every device computing the whole
    call (as XLA does with an opaque kernel under automatic axes), and each result is given
    the sharding ``results_like`` holds for it (None: replicated). ``operands[0]`` is the
    call's AttentionConfig."""
    leaves, tree = jax.tree.flatten(operands)
    is_array = [isinstance(x, (jax.Array, jax.core.Tracer)) for x in leaves]
    arrays = [x for x, array in zip(leaves, is_array) if array]
    shardings = [_type_sharding(x) for x in arrays]
    mesh = next((sharding.mesh for sharding in shardings if sharding is not None), None)
    if mesh is None:
        if implementation.needs_tpu:
            return _one_call_per_example(call, leaves, tree, is_array)(*arrays)
        return call(*operands)
    if operands[0].interpret and implementation.interpreter_has_effects:
        raise ValueError(
            f"interpret=True: {implementation.name}'s interpreter cannot run on operands sharded "
            f"over the {mesh.size} devices of a mesh with explicit axes (replicated on every device, "
            "its callbacks deadlock); interpret a call on one device, or use "
            "implementation='xla' on the mesh")

    def whole(*arrays):
        arrays = iter(arrays)
        return call(*tree.unflatten([next(arrays) if array else x
                                     for x, array in zip(leaves, is_array)]))

    replicated = NamedSharding(mesh, P())
    arrays = [x if sharding is None else jax.sharding.reshard(x, replicated)
              for x, sharding in zip(arrays, shardings)]
    results = jax.shard_map(whole, mesh=mesh, in_specs=tuple(P() for _ in arrays),
                            out_specs=P(), check_vma=False)(*arrays)
    return _given_back(results, results_like)


def _one_call_per_example(call, leaves, tree, is_array):
    """``call`` on ``tree``'s leaves (the arrays, where ``is_array``, as arguments) that a
    ``jax.vmap`` runs once per example (``lax.map``): JAX's batching of a Mosaic TPU pallas_call
    adds a grid axis without its dimension semantics, which Mosaic and the TPU interpreter
    refuse."""
    def on_arrays(*arrays):
        arrays = iter(arrays)
        return call(*tree.unflatten([next(arrays) if array else x
                                     for x, array in zip(leaves, is_array)]))

    per_example = jax.custom_batching.custom_vmap(on_arrays)

    @per_example.def_vmap
    def rule(axis_size, in_batched, *arrays):
        mapped = [x for x, batched in zip(arrays, in_batched) if batched]

        def one(mapped_slices):
            slices = iter(mapped_slices)
            return per_example(*(next(slices) if batched else x
                                 for x, batched in zip(arrays, in_batched)))

        outs = jax.lax.map(one, mapped)
        return outs, jax.tree.map(lambda _: True, outs)

    return per_example


def _given_back(result, like):
    """``result`` with each array resharded as ``like`` holds (a NamedSharding, or a tuple of
    them shaped like the result); where ``like`` is None or shaped otherwise (no dbias, fewer
    mod_aux cotangents) the array stays replicated."""
    if result is None or like is None:
        return result
    if isinstance(like, NamedSharding):
        return jax.sharding.reshard(result, like)
    if isinstance(result, tuple) and isinstance(like, tuple) and len(result) == len(like):
        parts = [_given_back(r, l) for r, l in zip(result, like)]
        return result._make(parts) if hasattr(result, "_make") else tuple(parts)
    return result


UNPARTITIONED_MODS = (
    "calls with score_mod, mask_mod or a block_mask run as one program over the global indices, "
    "which XLA partitions as a whole (xla) or whose operands it gathers (a kernel); under plain "
    "jit no ring or all-to-all takes them (inside jax.shard_map ring_attention, "
    "ulysses_attention and hybrid_attention do)")


def _unpartitioned(implementation, cfg, masks, extras) -> bool:
    """Calls the custom partitioning does not take: an interpreter with effects, and calls
    with score_mod, mask_mod or a block_mask (their indices are global: XLA partitions the
    implementation's program as a whole, or gathers its operands)."""
    return ((cfg.interpret and implementation.interpreter_has_effects) or cfg.has_mods
            or masks.block_mask is not None)


class Strategy(str):
    """How sharded inputs run: the description (this string) and the plan as attributes.

    Attributes:
      kind: "local" (batch and heads split, no collective), "replicated", "ring", "all_to_all",
        "hybrid" (all-to-all over the inner axis, a ring over the outer) or "one_program" (mods).
      batch_axes, head_axes, sequence_axes: the mesh axes each dimension is split over.
      gathered: q's dimensions whose sharding is not honoured ("batch", "sequence", "heads",
        "head_dim"): all-gathered or replicated.
      ring_steps: the ring's steps (the hybrid's outer axis size), 0 without a ring.
      local_kernel: the implementation each device runs in a ring or all-to-all, else None.
      pairwise: how a bias or dense mask travels: "query_rows" (the ring), "by_head" (the
        all-to-all), None.
      requested: the strategy was asked for (context_parallel_strategy), not chosen by cost.
      bytes_per_device: strategy -> the cost model's estimated bytes sent per device.
      unavailable: strategy -> why it cannot run this call.
    """

    def __new__(cls, text: str, kind: str, plan: ShardingPlan | None = None, spec=None, **fields):
        self = super().__new__(cls, text)
        axes = (lambda i: list(_axes(spec[i]))) if spec is not None else (lambda i: [])
        choice = plan.choice if plan is not None else None
        kept = ({"batch": plan.batch, "sequence": plan.sequence, "heads": plan.heads, "head_dim": ()}
                if plan is not None else {})
        self.__dict__.update(
            kind=kind, batch_axes=list(plan.batch) if plan else [], head_axes=list(plan.heads) if plan else [],
            sequence_axes=list(plan.sequence) if plan else [],
            gathered=[dim for i, dim in enumerate(kept) if axes(i) and not kept[dim]],
            ring_steps=0, local_kernel=None, pairwise=None, requested=bool(choice and choice.requested),
            bytes_per_device=dict(choice.bytes_per_device) if choice else {},
            unavailable=dict(choice.unavailable) if choice else {})
        self.__dict__.update(fields)
        return self


def explain(implementation, q, q_shape, k_shape, pairwise: dict, cfg=None,
            extras=None) -> Strategy | None:
    """The strategy for ``q`` (an array or ShapeDtypeStruct with a NamedSharding), or None when
    it carries no multi-device NamedSharding. ``pairwise``: {"bias"|"mask": ``[Bx, Hx, Lq,
    Lk]``} of the call. A sequence-sharded call names cp_cost's choice with its estimated bytes
    per device."""
    if cfg is not None and (cfg.has_mods or cfg.mask.has_block_mask):
        if cfg.context_parallel_strategy not in (None, "all_gather"):
            raise ValueError(
                f"context_parallel_strategy={cfg.context_parallel_strategy!r} cannot run a call "
                f"with score_mod, mask_mod or block_mask: {UNPARTITIONED_MODS}")
        sharding = getattr(q, "sharding", None)
        multi = isinstance(sharding, NamedSharding) and sharding.mesh.size > 1
        return Strategy(f"one program: {UNPARTITIONED_MODS}", "one_program") if multi else None
    has_bias_or_mask = bool(pairwise)
    sharding = _known_sharding(q)
    if sharding is None:
        return None
    names = ("q", "k", "v") + (("bias",) if has_bias_or_mask else ()) + tuple(
        short for field, short in _EXTRA_FIELDS if extras is not None and getattr(extras, field) is not None)
    spec = _canonical_spec(sharding.spec, len(q.shape))
    plan = sharding_plan(sharding.mesh, spec, q_shape, k_shape,
                         ring_unavailable=ring_unavailable(implementation, names),
                         call=sequence_call(cfg, names, q.dtype, pairwise, q_shape[2]))
    strategy = functools.partial(Strategy, plan=plan, spec=spec)
    if plan.sequence and plan.strategy == "hybrid":
        outer, inner = plan.sequence
        steps = sharding.mesh.shape[outer]
        return strategy(f"hybrid over {plan.sequence} (context parallelism: all-to-all over {inner!r}, "
                        f"then a ring over {outer!r} in {steps} steps, local kernel "
                        f"{implementation.name}); cost model: "
                        f"{plan.choice.describe(_size(sharding.mesh, plan.sequence), plan.sequence)}"
                        + "".join(f"; {note}" for note in plan.notes),
                        "hybrid", ring_steps=steps, local_kernel=implementation.name)
    if plan.sequence:
        (axis,) = plan.sequence
        n = sharding.mesh.shape[axis]
        if plan.strategy == "ring":
            travels = ("; bias/mask: query rows sharded over the same axis, every key column, "
                       "sliced per step" if has_bias_or_mask else "")
            how = (f"ring over {axis!r} in {n} steps (context parallelism, zigzag layout, local "
                   f"kernel {implementation.name}){travels}")
        else:
            travels = ("; bias/mask: resharded by head with the operands, dbias back along the "
                       "query rows" if has_bias_or_mask else "")
            how = (f"all_to_all over {axis!r} (context parallelism, Ulysses: whole sequences for "
                   f"1/{n} of the heads per device, local kernel {implementation.name}){travels}")
        return strategy(how + f"; cost model: {plan.choice.describe(n, axis)}"
                        + "".join(f"; {note}" for note in plan.notes),
                        plan.strategy, ring_steps=n if plan.strategy == "ring" else 0,
                        local_kernel=implementation.name, pairwise=None if not has_bias_or_mask else
                        "query_rows" if plan.strategy == "ring" else "by_head")
    return strategy(plan.describe() + ("" if plan.choice is None else
                                       f"; cost model: {plan.choice.describe(_size(sharding.mesh, _axes(spec[1])), 'sequence')}"),
                    "local" if plan.batch or plan.heads else "replicated")


def _canonical_spec(spec, ndim: int):
    """A user spec over ``[batch..., L, H, D]`` -> the spec of the flat ``[B, L, H, D]``."""
    spec = tuple(spec) + (None,) * (ndim - len(spec))
    batch = tuple(a for entry in spec[:-3] for a in _axes(entry))
    return P(batch or None, *spec[-3:])
