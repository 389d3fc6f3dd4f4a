"""Context parallelism: ring attention for code running inside ``jax.shard_map``.

Each device holds a block of the queries and a block of the keys/values along a sequence axis
of the mesh. The key/value blocks (with their segment ids) travel around the ring with
``lax.ppermute``; at every step each device runs the same blocked forward (xla or pallas) on its
query block against the visiting key block, and the partial (out, row statistics) pairs merge
exactly (``merge``). The backward is one more ring: K, V and the dK/dV accumulators travel
together while dQ stays home; it reuses the implementation's backward with the GLOBAL row
statistics and delta, which is exactly what a blocked backward takes from outside.

Global positions: a block is split into chunks; a pair (query chunk at global start qs, key
chunk at ks) runs with local lengths ``clip(len - start, 0, chunk)`` and
``MaskInputs.position_offset = qs - ks`` (+ ``kv_len - q_len`` for bottom-right), so causal
(both alignments), windows, lengths and segment ids mean exactly what they mean on one device.
A pair that the band and lengths rule out wholly is skipped (``lax.cond``).

Bias and dense mask (``[Bx, Hx, Lq_loc, Lk]``: this device's query rows, ALL key columns, the
columns in global key order): they stay home; each pair slices its rows (static) and the
columns of the visiting key chunk (``lax.dynamic_slice`` at global chunk index * chunk size,
so the layout does not matter). dbias is written pair by pair into the same layout, reduced
over the bias's broadcast batch/head axes as it goes.

Layouts (``layout=``):
* ``"zigzag"`` (default): the sequence is cut into ``2N`` chunks and device ``r`` holds chunks
  ``r`` and ``2N-1-r`` (``to_zigzag`` reorders a global array that way). Under a causal mask
  every device then does the same work: chunk ``r`` sees ``r`` full chunks and half of one,
  chunk ``2N-1-r`` sees ``2N-1-r`` and half of one: ``2N`` half-chunk units each.
* ``"contiguous"``: device ``r`` holds chunk ``r`` of ``N``; no reordering, but under a causal
  mask device ``N-1`` does ``2N-1`` units of work while device 0 does 1.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_impl import block_mask, dropout_sinks, masking, mods, online_softmax, vma
from jax_impl.config import AttentionConfig
from jax_impl.symbolic_zeros import Residuals, delta_of, from_primals, reduce_to

LAYOUTS = ("zigzag", "contiguous")


@dataclasses.dataclass(frozen=True)
class Ring:
    """The static description of one ring: hashable, a nondiff argument of the custom VJP."""

    axis_name: str
    num_devices: int
    layout: str
    implementation: object  # implementations.Implementation: one that takes position offsets
    cfg: AttentionConfig  # its mask spec is top-left: the alignment lives in the offsets
    bottom_right: bool

    @property
    def chunks(self) -> int:
        """Chunks per device block."""
        return 2 if self.layout == "zigzag" else 1


def chunk_ids(layout: str, num_devices: int, device):
    """Global chunk indices held by ``device``, in local order."""
    if layout == "zigzag":
        return [device, 2 * num_devices - 1 - device]
    return [device]


# --- Reordering of global arrays (outside shard_map) ---------------------------------------

def zigzag_permutation(length: int, num_devices: int) -> np.ndarray:
    """Indices ``p`` such that ``x[p]`` puts chunks ``r, 2N-1-r`` in device ``r``'s block."""
    if length % (2 * num_devices):
        raise ValueError(f"sequence length {length} must be a multiple of 2 * num_devices = "
                         f"{2 * num_devices} for the zigzag layout")
    chunk = length // (2 * num_devices)
    order = [c for r in range(num_devices) for c in chunk_ids("zigzag", num_devices, r)]
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in order])


def to_zigzag(x, num_devices: int, axis: int):
    """Reorder the sequence ``axis`` of a global array into the zigzag layout."""
    return jnp.take(x, zigzag_permutation(x.shape[axis], num_devices), axis=axis)


def from_zigzag(x, num_devices: int, axis: int):
    """Inverse of ``to_zigzag``."""
    return jnp.take(x, np.argsort(zigzag_permutation(x.shape[axis], num_devices)), axis=axis)


# --- One (query chunk, key chunk) pair -------------------------------------------------------

def pair_masks(ring: Ring, masks: masking.MaskInputs, q_chunk, kv_chunk, cq: int, ck: int,
               q_seg, kv_seg, tiles=None) -> masking.MaskInputs:
    """Local mask inputs for query chunk ``q_chunk`` (size cq) against key chunk ``kv_chunk``.

    ``masks`` carries the GLOBAL lengths ``[B]`` and block_mask; ``tiles``: that block_mask's
    ``block_mask.dense_classes``, from which the pair's BlockMask is cut."""
    q_start, kv_start = q_chunk * cq, kv_chunk * ck
    base = masks.kv_len - masks.q_len if ring.bottom_right else jnp.zeros_like(masks.q_len)
    return masking.MaskInputs(
        q_len=jnp.clip(masks.q_len - q_start, 0, cq).astype(jnp.int32),
        kv_len=jnp.clip(masks.kv_len - kv_start, 0, ck).astype(jnp.int32),
        q_segment_ids=q_seg, kv_segment_ids=kv_seg, mask=None,
        position_offset=(base + q_start - kv_start).astype(jnp.int32),
        block_mask=pair_block_mask(masks.block_mask, tiles, q_chunk, kv_chunk, cq, ck))


def pair_block_mask(global_mask, tiles, q_chunk, kv_chunk, cq: int, ck: int):
    """The chunk pair's BlockMask, cut from the global one's tile classes ``tiles`` (its tiles
    divide the chunks: ``block_mask_unfit`` says when they do not). None stays None."""
    if global_mask is None:
        return None
    bq, bk = global_mask.block_q, global_mask.block_kv
    rows = lax.dynamic_slice_in_dim(tiles, q_chunk * (cq // bq), cq // bq, axis=2)
    pair = lax.dynamic_slice_in_dim(rows, kv_chunk * (ck // bk), ck // bk, axis=3)
    return block_mask.BlockMask.from_tile_classes(pair, cq, ck, bq, bk, global_mask.mask_mod)


def block_mask_unfit(global_mask, cq: int, ck: int) -> str | None:
    """Why a global block_mask cannot be cut into chunk pairs of (cq, ck), or None."""
    if global_mask is None or (cq % global_mask.block_q == 0 and ck % global_mask.block_kv == 0):
        return None
    return (f"block_mask's tiles of {global_mask.block_q}x{global_mask.block_kv} do not divide "
            f"the ring's chunks of {cq} queries and {ck} keys (make it with a block_size that "
            "divides them)")


def pair_columns(x, a: int, kv_chunk, cq: int, ck: int):
    """Rows of local query chunk ``a`` and the columns of global key chunk ``kv_chunk`` of a
    ``[Bx, Hx, Lq_loc, Lk]`` bias or mask (None stays None)."""
    if x is None:
        return None
    rows = x[:, :, a * cq:(a + 1) * cq]
    return lax.dynamic_slice_in_dim(rows, kv_chunk * ck, ck, axis=3)


def pair_active(ring: Ring, pm: masking.MaskInputs, cq: int, ck: int):
    """False when the band, lengths and segment ids exclude every (query, key) pair of the
    chunk pair (its class as one tile, ``block_mask.tile_classes``): packed documents over a
    long context skip most steps."""
    classes = block_mask.tile_classes(ring.cfg.mask, pm, cq, ck, cq, ck, band_only=True)
    return jnp.any(classes != block_mask.EMPTY)


def _split(x, parts: int, axis: int):
    return [None] * parts if x is None else jnp.split(x, parts, axis=axis)


def _rotate(tree, ring: Ring):
    """Send every array of ``tree`` to the next device of the ring."""
    perm = [(i, (i + 1) % ring.num_devices) for i in range(ring.num_devices)]
    return jax.tree.map(lambda x: lax.ppermute(x, ring.axis_name, perm), tree)


def pair_extras(ring: Ring, extras, q_chunk, kv_chunk, cq: int, ck: int):
    """The local step's SinksAndDropout: the dropout seeds with the pair's global (query, key)
    start, so each step hashes global positions (the one-device pattern, bit for bit), and the
    mods' mod_aux led by that start (``mods.offset_aux``: they see global indices); no sinks
    (they join each row once, after the merge: ``with_sinks``). None with neither."""
    hashes = extras is not None and extras.dropout_seeds is not None and ring.cfg.dropout_rate
    if not (hashes or ring.cfg.has_mods):
        return None
    start = jnp.stack([q_chunk * cq, kv_chunk * ck]).astype(jnp.int32)
    return dropout_sinks.SinksAndDropout(
        dropout_seeds=extras.dropout_seeds if hashes else None,
        dropout_offset=start if hashes else None,
        mod_aux=mods.offset_aux(extras.mod_aux, q=start[0], kv=start[1]) if ring.cfg.has_mods else ())


def with_sinks(out, stats: online_softmax.RowStats, sinks):
    """Merge the sinks ``[Bs, Hs]`` into the merged ring output as one more partial result:
    a key with logit ``sink`` and value 0 (each row's denominator gets it once)."""
    if sinks is None:
        return out, stats
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[:, :, None], stats.max.shape)
    sink_stats = online_softmax.RowStats(jnp.where(sink > -jnp.inf, sink, jnp.inf),  # -inf: none
                                         jnp.zeros_like(sink))
    return online_softmax.merge(out, stats, jnp.zeros_like(out), sink_stats)


# --- Forward and backward rings -------------------------------------------------------------

def ring_forward(ring: Ring, q, k, v, masks: masking.MaskInputs, bias=None, extras=None):
    """-> (out ``[B, Lq_loc, Hq, D]`` in q's dtype, global RowStats ``[B, Hq, Lq_loc]``).

    ``masks.mask`` and ``bias``: ``[Bx, Hx, Lq_loc, Lk]`` (rows local, every key column).
    ``extras``: SinksAndDropout with ``[Bs, Hs]`` sinks and dropout seeds (global batch, head)."""
    impl = ring.implementation
    b, lq, hq, d = q.shape
    cq, ck = lq // ring.chunks, k.shape[1] // ring.chunks
    me = lax.axis_index(ring.axis_name)
    q_ids = chunk_ids(ring.layout, ring.num_devices, me)
    qs, q_segs = _split(q, ring.chunks, 1), _split(masks.q_segment_ids, ring.chunks, 1)
    axes = vma.axes_of(q, k, v, masks, bias, extras, me)  # fresh buffers vary like the operands
    cfg, tiles = mods.at_offset(ring.cfg), _global_tiles(masks)

    def step(s, carry):
        kv, outs, stats = carry
        incoming = _rotate(kv, ring)  # issued before the compute so the transfer can overlap it
        k_blk, v_blk, kv_seg = kv
        kv_ids = chunk_ids(ring.layout, ring.num_devices, (me - s) % ring.num_devices)
        ks, vs, kv_segs = (_split(x, ring.chunks, 1) for x in (k_blk, v_blk, kv_seg))
        outs, stats = list(outs), list(stats)
        for a in range(ring.chunks):
            for c in range(ring.chunks):
                pm = pair_masks(ring, masks, q_ids[a], kv_ids[c], cq, ck, q_segs[a], kv_segs[c],
                                tiles)
                pm = pm._replace(mask=pair_columns(masks.mask, a, kv_ids[c], cq, ck))
                o, st = lax.cond(
                    pair_active(ring, pm, cq, ck),
                    lambda qa, kc, vc, bp, pm, ex: impl.forward(cfg, qa, kc, vc, bp, pm, ex),
                    lambda qa, kc, vc, bp, pm, ex: vma.like(
                        (jnp.zeros(qa.shape, qa.dtype), online_softmax.empty_stats((b, hq, cq))), axes),
                    qs[a], ks[c], vs[c], pair_columns(bias, a, kv_ids[c], cq, ck), pm,
                    pair_extras(ring, extras, q_ids[a], kv_ids[c], cq, ck))
                outs[a], stats[a] = online_softmax.merge(outs[a], stats[a], o, st)
        return incoming, tuple(outs), tuple(stats)

    outs = vma.like(tuple(jnp.zeros((b, cq, hq, d), jnp.float32) for _ in range(ring.chunks)), axes)
    stats = vma.like(tuple(online_softmax.empty_stats((b, hq, cq)) for _ in range(ring.chunks)), axes)
    kv = (k, v, masks.kv_segment_ids)
    _, outs, stats = lax.fori_loop(0, ring.num_devices, step, (kv, outs, stats))
    out, stats = with_sinks(jnp.concatenate(outs, axis=1),
                            online_softmax.RowStats(*(jnp.concatenate(x, axis=2) for x in zip(*stats))),
                            None if extras is None else extras.sinks)
    return out.astype(q.dtype), stats


def ring_backward(ring: Ring, q, k, v, masks, stats, d_out, delta, bias=None, extras=None):
    """-> (dq, dk, dv, dbias or None, d_mod_aux) of the local blocks; dK/dV accumulators travel with K and
    V, one step behind: at step s a device sends the accumulator of the block it visited at
    step s-1 together with its K/V block, before the step's compute, and adds its own share to
    the accumulator it receives after it (the visiting block's: the previous device visited it
    at step s-1). Every send of a step is then independent of its compute, so XLA:GPU, which
    combines a step's collective-permutes into one, can still overlap it with the compute
    (sending dK/dV after the compute made the combined send wait for it). dbias (float32,
    ``bias``'s shape: rows local, every key column) stays home, and is None when
    ``ring.cfg.bias_gradient`` is False (a constant bias). The sinks need nothing here:
    the global statistics include them (dsinks: ``dropout_sinks.sink_gradient``). d_mod_aux:
    this device's share of the mod_aux cotangents, summed over the steps in order."""
    impl = ring.implementation
    lq = q.shape[1]
    cq, ck = lq // ring.chunks, k.shape[1] // ring.chunks
    me = lax.axis_index(ring.axis_name)
    q_ids = chunk_ids(ring.layout, ring.num_devices, me)
    split_q = lambda x: _split(x, ring.chunks, 1)
    split_rows = lambda x: _split(x, ring.chunks, 2)
    qs, dos, q_segs = split_q(q), split_q(d_out), split_q(masks.q_segment_ids)
    deltas = split_rows(delta)
    row_stats = [online_softmax.RowStats(m, l)
                 for m, l in zip(split_rows(stats.max), split_rows(stats.log_sum))]
    axes = vma.axes_of(q, k, v, masks, bias, stats, d_out, delta, extras, me)
    with_dbias = bias is not None and ring.cfg.bias_gradient
    cfg, tiles = mods.at_offset(ring.cfg), _global_tiles(masks)
    mod_aux = () if extras is None else extras.mod_aux
    if mod_aux:  # varying, so the kernels' cotangents stay this device's share (summed once: _ring_bwd)
        extras = extras._replace(mod_aux=vma.like(mod_aux, axes))

    def step(s, carry):
        kv, dkv_sent, dqs, dbias, d_mod_aux = carry
        incoming, dkv = _rotate((kv, dkv_sent), ring)  # both before the compute (docstring)
        k_blk, v_blk, kv_seg = kv
        kv_ids = chunk_ids(ring.layout, ring.num_devices, (me - s) % ring.num_devices)
        ks, vs, kv_segs = (_split(x, ring.chunks, 1) for x in (k_blk, v_blk, kv_seg))
        dks, dvs = split_q(dkv[0]), split_q(dkv[1])
        dqs = list(dqs)
        for a in range(ring.chunks):
            for c in range(ring.chunks):
                pm = pair_masks(ring, masks, q_ids[a], kv_ids[c], cq, ck, q_segs[a], kv_segs[c],
                                tiles)
                pm = pm._replace(mask=pair_columns(masks.mask, a, kv_ids[c], cq, ck))
                bp = pair_columns(bias, a, kv_ids[c], cq, ck)

                def compute(qa, kc, vc, bp, pm, st, do, dl, ex):
                    dq, dk, dv, db, d_aux = impl.backward(cfg, qa, kc, vc, bp, pm, st, do, dl, ex)
                    db = reduce_to(db, bp.shape).astype(jnp.float32) if with_dbias else None
                    d_aux = float_cotangents(ring.cfg, d_aux[1:] if cfg.has_mods else (), mod_aux)
                    return (dq.astype(jnp.float32), dk.astype(jnp.float32),
                            dv.astype(jnp.float32), db, d_aux)

                def skip(qa, kc, vc, bp, *_):
                    return vma.like((jnp.zeros(qa.shape, jnp.float32), jnp.zeros(kc.shape, jnp.float32),
                                     jnp.zeros(vc.shape, jnp.float32),
                                     jnp.zeros(bp.shape, jnp.float32) if with_dbias else None,
                                     mods.zero_cotangents(ring.cfg, mod_aux)), axes)

                dq, dk, dv, db, d_aux = lax.cond(pair_active(ring, pm, cq, ck), compute, skip, qs[a], ks[c],
                                          vs[c], bp, pm, row_stats[a], dos[a], deltas[a],
                                          pair_extras(ring, extras, q_ids[a], kv_ids[c], cq, ck))
                if dbias is not None:  # each (row chunk, key chunk) is visited exactly once
                    dbias = lax.dynamic_update_slice(dbias, db, (0, 0, a * cq, kv_ids[c] * ck))
                dqs[a] = dqs[a] + dq
                dks[c] = dks[c] + dk
                dvs[c] = dvs[c] + dv
                d_mod_aux = mods.add_cotangents(d_mod_aux, d_aux)
        return (incoming, (jnp.concatenate(dks, axis=1), jnp.concatenate(dvs, axis=1)), tuple(dqs),
                dbias, d_mod_aux)

    zeros = lambda x: vma.like(jnp.zeros(x.shape, jnp.float32), axes)
    dqs = tuple(zeros(x) for x in qs)
    kv = (k, v, masks.kv_segment_ids)
    dbias = zeros(bias) if with_dbias else None
    # Step 0 sends zeros (no block visited yet); after the loop each device holds the complete
    # dK/dV of the block it visited last, block me+1's: one more send (in k's dtype) takes it home.
    _, dkv, dqs, dbias, d_mod_aux = lax.fori_loop(
        0, ring.num_devices, step,
        (kv, (zeros(k), zeros(v)), dqs, dbias, vma.like(mods.zero_cotangents(ring.cfg, mod_aux), axes)))
    dk, dv = _rotate((dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)), ring)
    return jnp.concatenate(dqs, axis=1).astype(q.dtype), dk, dv, dbias, d_mod_aux


def _global_tiles(masks: masking.MaskInputs):
    """The tile classes of the call's global block_mask (``pair_masks`` cuts each pair's), or None."""
    return None if masks.block_mask is None else block_mask.dense_classes(masks.block_mask)


def float_cotangents(cfg, d_aux: tuple, mod_aux: tuple) -> tuple:
    """A local kernel's mod_aux cotangents as ``mods.zero_cotangents(cfg, ...)`` lays them out
    (float32; zeros where the implementation gave None for an entry that gets a gradient)."""
    if not d_aux:
        return mods.zero_cotangents(cfg, mod_aux)
    return tuple(None if not wanted else
                 jnp.zeros(jnp.shape(x), jnp.float32) if d is None else d.astype(jnp.float32)
                 for d, x, wanted in zip(d_aux, mod_aux, mods.gradient_entries(cfg, mod_aux)))


def _ring_fwd(ring, q, k, v, bias, masks, extras):
    # symbolic_zeros=True: every array arrives as a CustomVJPPrimal(value, perturbed).
    backward_cfg, (q, k, v, bias, masks, extras) = from_primals(ring.cfg, bias,
                                                                (q, k, v, bias, masks, extras), extras.mod_aux)
    out, stats = ring_forward(ring, q, k, v, masks, bias, extras)
    return ((out, online_softmax.logsumexp(stats)),
            Residuals((q, k, v, bias, masks, extras, out, stats), backward_cfg))


def _ring_bwd(ring, residuals: Residuals, cotangents):
    q, k, v, bias, masks, extras, out, stats = residuals.arrays
    d_out, delta = delta_of(out, cotangents)
    ring = dataclasses.replace(ring, cfg=residuals.cfg)
    dq, dk, dv, dbias, d_mod_aux = ring_backward(ring, q, k, v, masks, stats, d_out, delta, bias,
                                                 extras._replace(sinks=None))
    dbias = None if dbias is None else dbias.astype(bias.dtype)  # None: a constant bias
    d_extras = jax.tree.map(lambda _: None, extras)
    if extras.sinks is not None:  # this device's rows' share; an unvarying sink sums the ring's
        d_sinks = reduce_to(dropout_sinks.sink_gradient(
            extras.sinks, online_softmax.logsumexp(stats), delta), extras.sinks.shape)
        d_sinks = vma.shared_parameter_cotangent(d_sinks, extras.sinks, (ring.axis_name,), q)
        d_extras = d_extras._replace(sinks=d_sinks.astype(extras.sinks.dtype))
    d_extras = d_extras._replace(mod_aux=mod_aux_cotangents(d_mod_aux, extras.mod_aux,
                                                             (ring.axis_name,), q))
    return dq, dk, dv, dbias, jax.tree.map(lambda _: None, masks), d_extras


def mod_aux_cotangents(d_mod_aux, mod_aux, axis_names: tuple, rows) -> tuple:
    """A strategy's mod_aux cotangents from this device's share (float32, None where not
    floating): summed over the axes as ``vma.shared_parameter_cotangent`` says, in each
    entry's dtype."""
    return tuple(None if d is None else
                 vma.shared_parameter_cotangent(d, x, axis_names, rows).astype(x.dtype)
                 for d, x in zip(d_mod_aux, mod_aux))


def _ring_primal(ring, q, k, v, bias, masks, extras):
    out, stats = ring_forward(ring, q, k, v, masks, bias, extras)
    return out, online_softmax.logsumexp(stats)


ring_vjp = jax.custom_vjp(_ring_primal, nondiff_argnums=(0,))
ring_vjp.defvjp(_ring_fwd, _ring_bwd, symbolic_zeros=True)


# --- Sequence-sharded inputs under plain jit (partitioned.py) -----------------------------
# Inputs arrive in the natural (contiguous) layout: device r holds chunks 2r and 2r+1 of 2N.
# The ring wants the zigzag layout (chunks r and 2N-1-r) for balanced causal work, so the local
# bodies reorder with two ``ppermute``s on the way in and two on the way out; each moves one
# chunk per device, never the whole sequence. A bias or dense mask arrives sharded along its
# query rows with every key column (``[Bx, Hx, Lq_loc, Lk]``): its rows are reordered the same
# way, its columns stay in global order (the ring slices them per step), and dbias goes back
# like the rows came.

def _zigzag_home(chunk, n: int):
    """The device that holds global chunk ``chunk`` in the zigzag layout."""
    return chunk if chunk < n else 2 * n - 1 - chunk


def to_zigzag_local(x, axis_name, n: int, axis: int):
    """Contiguous block (chunks 2r, 2r+1) -> zigzag block (chunks r, 2N-1-r), per device."""
    if x is None:
        return None
    halves = jnp.split(x, 2, axis=axis)
    received = [lax.ppermute(halves[h], axis_name,
                             [(d, _zigzag_home(2 * d + h, n)) for d in range(n)]) for h in (0, 1)]
    even = lax.axis_index(axis_name) % 2 == 0  # chunk r arrives in the permutation of r's parity
    first = jnp.where(even, received[0], received[1])
    second = jnp.where(even, received[1], received[0])
    return jnp.concatenate([first, second], axis=axis)


def from_zigzag_local(x, axis_name, n: int, axis: int):
    """Inverse of ``to_zigzag_local``: chunk c goes home to device c // 2, half c % 2."""
    first, second = jnp.split(x, 2, axis=axis)
    even = lax.axis_index(axis_name) % 2 == 0
    even_chunk = jnp.where(even, first, second)   # the even one of chunks r, 2N-1-r
    odd_chunk = jnp.where(even, second, first)
    chunk_of = lambda r, parity: r if r % 2 == parity else 2 * n - 1 - r
    back = [lax.ppermute(c, axis_name, [(r, chunk_of(r, parity) // 2) for r in range(n)])
            for parity, c in ((0, even_chunk), (1, odd_chunk))]
    return jnp.concatenate(back, axis=axis)


def zigzag_ring(cfg: AttentionConfig, axis_name, n: int, implementation) -> Ring:
    spec = dataclasses.replace(cfg.mask, bottom_right=False)
    return Ring(axis_name, n, "zigzag", implementation,
                     dataclasses.replace(cfg, mask=spec), cfg.mask.bottom_right)


def _local_masks(masks, axis, n: int):
    seq = lambda x, a=1: to_zigzag_local(x, axis, n, a)
    return masks._replace(q_segment_ids=seq(masks.q_segment_ids),
                          kv_segment_ids=seq(masks.kv_segment_ids), mask=seq(masks.mask, 2))


def contiguous_forward(description: Ring, q, k, v, masks, bias=None, extras=None):
    """Local body of the partitioned forward: contiguous blocks in and out."""
    axis, n = description.axis_name, description.num_devices
    seq = lambda x, a=1: to_zigzag_local(x, axis, n, a)
    out, stats = ring_forward(description, seq(q), seq(k), seq(v),
                              _local_masks(masks, axis, n), seq(bias, 2), extras)
    back = lambda x, a: from_zigzag_local(x, axis, n, a)
    return back(out, 1), online_softmax.RowStats(back(stats.max, 2), back(stats.log_sum, 2))


def contiguous_backward(description: Ring, q, k, v, masks, stats, d_out, delta, bias=None,
                        extras=None):
    """Local body of the partitioned backward: -> (dq, dk, dv, dbias | None, d_mod_aux) in
    contiguous blocks; dbias float32 in the bias's (reduced) shape."""
    axis, n = description.axis_name, description.num_devices
    seq = lambda x, a=1: to_zigzag_local(x, axis, n, a)
    stats = online_softmax.RowStats(seq(stats.max, 2), seq(stats.log_sum, 2))
    *grads, dbias, d_mod_aux = ring_backward(description, seq(q), seq(k), seq(v),
                                             _local_masks(masks, axis, n), stats, seq(d_out),
                                             seq(delta, 2), seq(bias, 2), extras)
    grads = tuple(from_zigzag_local(g, axis, n, 1) for g in grads)
    return grads + (None if dbias is None else from_zigzag_local(dbias, axis, n, 2), d_mod_aux)
