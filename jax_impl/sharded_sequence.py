"""Sequence-sharded inputs under plain jit: the partitioned ops run the ring (``ring.py``).

Inputs arrive in the natural (contiguous) layout: device r holds chunks 2r and 2r+1 of 2N.
The ring wants the zigzag layout (chunks r and 2N-1-r) for balanced causal work, so the local
bodies reorder with two ``ppermute``s on the way in and two on the way out; each moves one
chunk per device, never the whole sequence. A bias or dense mask arrives sharded along its
query rows with every key column (``[Bx, Hx, Lq_loc, Lk]``): its rows are reordered the same
way, its columns stay in global order (the ring slices them per step), and dbias goes back
like the rows came.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from jax_impl import online_softmax, ring
from jax_impl.config import AttentionConfig


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


def make_ring(cfg: AttentionConfig, axis_name, n: int, implementation: str) -> ring.Ring:
    spec = dataclasses.replace(cfg.mask, bottom_right=False)
    return ring.Ring(axis_name, n, "zigzag", implementation,
                     dataclasses.replace(cfg, mask=spec), cfg.mask.bottom_right)


def _local_masks(masks, axis, n: int):
    seq = lambda x, a=1: to_zigzag_local(x, axis, n, a)
    return masks._replace(q_segment_ids=seq(masks.q_segment_ids),
                          kv_segment_ids=seq(masks.kv_segment_ids), mask=seq(masks.mask, 2))


def forward(description: ring.Ring, q, k, v, masks, bias=None):
    """Local body of the partitioned forward: contiguous blocks in and out."""
    axis, n = description.axis_name, description.num_devices
    seq = lambda x, a=1: to_zigzag_local(x, axis, n, a)
    out, stats = ring.ring_forward(description, seq(q), seq(k), seq(v),
                                   _local_masks(masks, axis, n), seq(bias, 2))
    back = lambda x, a: from_zigzag_local(x, axis, n, a)
    return back(out, 1), online_softmax.RowStats(back(stats.max, 2), back(stats.log_sum, 2))


def backward(description: ring.Ring, q, k, v, masks, stats, d_out, delta, bias=None):
    """Local body of the partitioned backward: -> (dq, dk, dv, dbias | None) in contiguous
    blocks; dbias float32 in the bias's (reduced) shape."""
    axis, n = description.axis_name, description.num_devices
    seq = lambda x, a=1: to_zigzag_local(x, axis, n, a)
    stats = online_softmax.RowStats(seq(stats.max, 2), seq(stats.log_sum, 2))
    *grads, dbias = ring.ring_backward(description, seq(q), seq(k), seq(v),
                                       _local_masks(masks, axis, n), stats, seq(d_out),
                                       seq(delta, 2), seq(bias, 2))
    grads = tuple(from_zigzag_local(g, axis, n, 1) for g in grads)
    return grads + (None if dbias is None else from_zigzag_local(dbias, axis, n, 2),)
