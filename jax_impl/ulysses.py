"""Context parallelism by all-to-all (DeepSpeed-Ulysses): trade the sequence split for a head split.

Each device holds a block of the sequence with every head. One ``lax.all_to_all`` per operand
over the sequence axis gives each device the WHOLE sequence for ``1/N`` of the heads; the
chosen implementation then runs locally (any mask rule, dropout, sinks: positions are global
already), and one more all-to-all per result gives the sequence split back. Forward and
backward each move every operand once, ``(N-1)/N`` of its bytes, instead of ring attention's
N-1 sends of K and V.

GQA: device r takes query heads ``[r Hq/N, (r+1) Hq/N)`` and kv heads ``[r Hkv/N, ...)``, which
are exactly those heads' kv groups; so kv heads must divide the axis size (``unavailable``
says why not). Heads enter the dropout hash and the sinks by their GLOBAL index: the
per-head seeds and sinks ``[Bs, Hq]`` are sliced to the device's block. Segment ids (no head
axis) travel by the same all-to-all over a size-N axis of copies, never an all-gather.
A per-head bias or dense mask ``[Bx, Hq, Lq_loc, Lk]`` (this device's query rows, every key
column, as the ring takes it) is resharded the same way, to ``[Bx, Hq/N, Lq, Lk]``, and dbias
back (plain jit and ``ulysses_attention``); one shared by every head is refused (``unavailable``).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jax_impl import dropout_sinks, masking, mods, online_softmax, ring, vma
from jax_impl.config import AttentionConfig
from jax_impl.symbolic_zeros import Residuals, delta_of, from_primals, reduce_to


def unavailable(num_devices: int, hq: int, hkv: int, shared_pairwise: bool = False) -> str | None:
    """Why the all-to-all strategy cannot run over ``num_devices``, or None. ``shared_pairwise``:
    a bias or dense mask shared by every head (head axis 1), which would reach every device whole."""
    if shared_pairwise:
        return ("a bias or dense mask shared by every head is not resharded by head (each device "
                "would hold it whole; the ring slices it)")
    if hq % num_devices or hkv % num_devices:
        return (f"{hq} query / {hkv} kv heads do not divide over {num_devices} devices (each "
                f"device takes whole kv heads with their query groups)")
    return None


@dataclasses.dataclass(frozen=True)
class Ulysses:
    """Static description: hashable, a nondiff argument of the custom VJP."""

    axis_name: str
    num_devices: int
    implementation: object  # implementations.Implementation
    cfg: AttentionConfig


def to_heads(x, axis_name, seq_axis: int = 1, head_axis: int = 2):
    """Sequence block, every head -> whole sequence, this device's block of heads."""
    return lax.all_to_all(x, axis_name, head_axis, seq_axis, tiled=True)


def to_sequence(x, axis_name, seq_axis: int = 1, head_axis: int = 2):
    """Inverse of ``to_heads``."""
    return lax.all_to_all(x, axis_name, seq_axis, head_axis, tiled=True)


def _whole_ids(ids, axis_name, n: int):
    """Segment ids ``[B, L_loc]`` -> ``[B, L]`` by all-to-all over N copies (no all-gather)."""
    if ids is None:
        return None
    copies = jnp.broadcast_to(ids[:, :, None], ids.shape + (n,))
    return lax.all_to_all(copies, axis_name, 2, 1, tiled=True)[:, :, 0]


def _head_block(x, axis_name, blocks: int):
    """This device's block of a per-head ``[Bs, Hs]`` array (Hs = 1: shared by every head)."""
    if x is None or x.shape[1] == 1:
        return x
    size = x.shape[1] // blocks
    return lax.dynamic_slice_in_dim(x, lax.axis_index(axis_name) * size, size, axis=1)


def _pairwise_heads(x, axis_name):
    """A bias/mask ``[Bx, Hq, Lq_loc, Lk]`` -> ``[Bx, Hq/N, Lq, Lk]`` (this device's heads, every row)."""
    return None if x is None else to_heads(x, axis_name, seq_axis=2, head_axis=1)


def _local_inputs(u: Ulysses, masks: masking.MaskInputs, extras, heads: int):
    """This device's mask inputs and extras for its block of ``heads`` query heads: whole
    segment ids, its heads of the per-head arrays, and the mods' mod_aux led by its first
    head (``mods.offset_aux``: they see global head indices)."""
    ids = lambda x: _whole_ids(x, u.axis_name, u.num_devices)
    block = lambda x: _head_block(x, u.axis_name, u.num_devices)
    masks = masks._replace(q_segment_ids=ids(masks.q_segment_ids),
                           kv_segment_ids=ids(masks.kv_segment_ids),
                           mask=_pairwise_heads(masks.mask, u.axis_name),
                           block_mask=None if masks.block_mask is None else
                           jax.tree.map(block, masks.block_mask))
    extras = extras or dropout_sinks.SinksAndDropout()
    extras = extras._replace(sinks=block(extras.sinks), dropout_seeds=block(extras.dropout_seeds))
    if u.cfg.has_mods:  # varying, so the kernels' cotangents stay this device's share (_bwd sums)
        me = lax.axis_index(u.axis_name)
        extras = extras._replace(mod_aux=mods.offset_aux(
            vma.like(extras.mod_aux, vma.axes_of(me)), h=me * heads))
    return masks, extras


def forward(u: Ulysses, q, k, v, masks, extras=None, bias=None):
    """Sequence blocks in, sequence blocks out: (out ``[B, L_loc, Hq, D]``, RowStats
    ``[B, Hq, L_loc]``)."""
    masks, extras = _local_inputs(u, masks, extras, q.shape[2] // u.num_devices)
    heads = lambda x: to_heads(x, u.axis_name)
    out, stats = u.implementation.forward(mods.at_offset(u.cfg), heads(q), heads(k), heads(v),
                                          _pairwise_heads(bias, u.axis_name), masks, extras)
    back = lambda x, s=1, h=2: to_sequence(x, u.axis_name, s, h)
    return back(out), online_softmax.RowStats(back(stats.max, 2, 1), back(stats.log_sum, 2, 1))


def backward(u: Ulysses, q, k, v, masks, stats, d_out, delta, extras=None, bias=None):
    """-> (dq, dk, dv) in sequence blocks; dbias (``bias``'s shape, rows local) when a bias is
    given and ``u.cfg.bias_gradient``, else None; this device's share of the mod_aux
    cotangents (``mods.zero_cotangents``' layout). The sinks need nothing here (the statistics
    hold them)."""
    user_aux = () if extras is None else extras.mod_aux
    masks, extras = _local_inputs(u, masks, extras, q.shape[2] // u.num_devices)
    heads = lambda x, s=1, h=2: to_heads(x, u.axis_name, s, h)
    stats = online_softmax.RowStats(heads(stats.max, 2, 1), heads(stats.log_sum, 2, 1))
    bias_heads = _pairwise_heads(bias, u.axis_name)
    dq, dk, dv, dbias, d_aux = u.implementation.backward(
        mods.at_offset(u.cfg), heads(q), heads(k), heads(v), bias_heads, masks, stats,
        heads(d_out), heads(delta, 2, 1), extras)
    grads = tuple(to_sequence(g, u.axis_name) for g in (dq, dk, dv))
    d_aux = ring.float_cotangents(u.cfg, d_aux[1:] if u.cfg.has_mods else (), user_aux)
    if bias is None or not u.cfg.bias_gradient:
        return grads + (None, d_aux)
    dbias = reduce_to(dbias, bias_heads.shape)
    return grads + (to_sequence(dbias, u.axis_name, seq_axis=2, head_axis=1), d_aux)


# --- The explicit functions' custom VJP (context_parallel.ulysses_attention, hybrid_attention) --

@dataclasses.dataclass(frozen=True)
class Hybrid:
    """Static description of the hybrid: the all-to-all over the inner axis, then ``ring`` (a
    zigzag ``ring.Ring`` over the outer axis) on the resharded blocks."""

    all_to_all: Ulysses
    ring: object  # ring.Ring

    @property
    def cfg(self) -> AttentionConfig:
        return self.all_to_all.cfg


def _axis_names(d) -> tuple:
    return (d.all_to_all.axis_name, d.ring.axis_name) if isinstance(d, Hybrid) else (d.axis_name,)


def _forward_of(d, q, k, v, bias, masks, extras):
    if isinstance(d, Hybrid):  # no bias (hybrid_attention takes none)
        return hybrid_forward(d.all_to_all, d.ring, q, k, v, masks, extras)
    return forward(d, q, k, v, masks, extras, bias)


def _backward_of(d, q, k, v, bias, masks, stats, d_out, delta, extras):
    """-> (dq, dk, dv, dbias or None, d_mod_aux)."""
    if isinstance(d, Hybrid):
        return hybrid_backward(d.all_to_all, d.ring, q, k, v, masks, stats, d_out, delta, extras)
    return backward(d, q, k, v, masks, stats, d_out, delta, extras, bias)


def _fwd(u, q, k, v, bias, masks, extras):
    backward_cfg, (q, k, v, bias, masks, extras) = from_primals(u.cfg, bias,
                                                                (q, k, v, bias, masks, extras), extras.mod_aux)
    out, stats = _forward_of(u, q, k, v, bias, masks, extras)
    return ((out, online_softmax.logsumexp(stats)),
            Residuals((q, k, v, bias, masks, extras, out, stats), backward_cfg))


def _bwd(u, residuals: Residuals, cotangents):
    q, k, v, bias, masks, extras, out, stats = residuals.arrays
    d_out, delta = delta_of(out, cotangents)
    if isinstance(u, Ulysses):  # bias_gradient: whether the bias is differentiated
        u = dataclasses.replace(u, cfg=residuals.cfg)
    dq, dk, dv, dbias, d_mod_aux = _backward_of(u, q, k, v, bias, masks, stats, d_out, delta,
                                                extras._replace(sinks=None))
    dbias = None if dbias is None else dbias.astype(bias.dtype)  # None: a constant bias
    d_extras = jax.tree.map(lambda _: None, extras)
    if extras.sinks is not None:  # this device's rows' share; an unvarying sink sums them
        d_sinks = reduce_to(dropout_sinks.sink_gradient(
            extras.sinks, online_softmax.logsumexp(stats), delta), extras.sinks.shape)
        d_sinks = vma.shared_parameter_cotangent(d_sinks, extras.sinks, _axis_names(u), q)
        d_extras = d_extras._replace(sinks=d_sinks.astype(extras.sinks.dtype))
    d_extras = d_extras._replace(mod_aux=ring.mod_aux_cotangents(d_mod_aux, extras.mod_aux,
                                                                  _axis_names(u), q))
    return dq, dk, dv, dbias, jax.tree.map(lambda _: None, masks), d_extras


def _primal(u, q, k, v, bias, masks, extras):
    out, stats = _forward_of(u, q, k, v, bias, masks, extras)
    return out, online_softmax.logsumexp(stats)


ulysses_vjp = jax.custom_vjp(_primal, nondiff_argnums=(0,))
ulysses_vjp.defvjp(_fwd, _bwd, symbolic_zeros=True)


# --- Hybrid (USP): all-to-all over the inner mesh axis, ring over the outer -----------------
# The sequence is sharded over (outer, inner): device (o, i) holds block o * |inner| + i. The
# all-to-all over ``inner`` gives each device block o of |outer| (contiguous: the inner blocks
# in order) for 1/|inner| of the heads; ``ring.contiguous_forward`` over ``outer`` runs on it
# (global positions unchanged: the outer blocks tile the whole sequence), and the result goes
# back by one more all-to-all. Fast links (inside a host) carry the all-to-all, the ring's
# N_outer steps cross the slow ones.

def hybrid_forward(u: Ulysses, ring_description, q, k, v, masks, extras=None):
    masks, extras = _local_inputs(u, masks, extras, q.shape[2] // u.num_devices)
    heads = lambda x: to_heads(x, u.axis_name)
    out, stats = ring.contiguous_forward(_after_all_to_all(u, ring_description), heads(q),
                                         heads(k), heads(v), masks, None, extras)
    back = lambda x, s=1, h=2: to_sequence(x, u.axis_name, s, h)
    return back(out), online_softmax.RowStats(back(stats.max, 2, 1), back(stats.log_sum, 2, 1))


def hybrid_backward(u: Ulysses, ring_description, q, k, v, masks, stats, d_out, delta, extras=None):
    """-> (dq, dk, dv, None, d_mod_aux): no bias."""
    user_aux = () if extras is None else extras.mod_aux
    masks, extras = _local_inputs(u, masks, extras, q.shape[2] // u.num_devices)
    heads = lambda x, s=1, h=2: to_heads(x, u.axis_name, s, h)
    stats = online_softmax.RowStats(heads(stats.max, 2, 1), heads(stats.log_sum, 2, 1))
    dq, dk, dv, _, d_aux = ring.contiguous_backward(
        _after_all_to_all(u, ring_description), heads(q), heads(k), heads(v), masks, stats,
        heads(d_out), heads(delta, 2, 1), None, extras)
    d_aux = ring.float_cotangents(u.cfg, d_aux[1:] if u.cfg.has_mods else (), user_aux)
    return tuple(to_sequence(g, u.axis_name) for g in (dq, dk, dv)) + (None, d_aux)


def _after_all_to_all(u: Ulysses, ring_description):
    """The hybrid's ring, whose mods take the all-to-all's head offset (``_local_inputs``)
    before the ring's own."""
    return dataclasses.replace(ring_description, cfg=mods.at_offset(ring_description.cfg))
