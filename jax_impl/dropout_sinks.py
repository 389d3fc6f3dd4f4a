"""Attention dropout and attention sinks: the traced inputs and the per-tile math they add.

Dropout. The keep/drop decision for pair (b, h, i, j) is a counter-based hash, never a stored
mask: a per-(batch, head) 32-bit seed (``head_seeds``, derived once in plain XLA from the key,
the GLOBAL flat batch index and the head) is mixed per element with the query and key indices
(``keep``). So the forward and both backward kernels recompute the same pattern, for any tile
sizes and padding, in xla and in Pallas alike; a batch or head split across devices only
slices the ``[B, Hq]`` seed array. With ``broadcast_dropout`` (Flax's default) the pattern is
shared across batch and heads, as ``flax.linen.dot_product_attention_weights`` draws it with
shape ``[1..., 1, Lq, Lk]``: the seed array is then ``[1, 1]``.
Kept probabilities are scaled by ``1 / (1 - rate)`` (Flax, PyTorch). Dropout acts on the
normalised P only where it meets V: the row statistics and the logsumexp are unaffected.

Sinks. A sink is one more logit per (batch, head) that joins every row's softmax denominator
and carries no value: the online softmax starts from ``m = sink, l = 1`` instead of
``m = -inf, l = 0`` (``initial_stats``), so a row with no allowed key gives output 0 and
logsumexp = sink. Its gradient needs no kernel: P_sink = exp(sink - lse) from the saved
statistics and d sink = -sum_i P_sink_i * delta_i (``sink_gradient``).

Everything here uses jnp ops on uint32/int32/float32 that lower in XLA and in Pallas Triton.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# murmur3's 32-bit finaliser constants, and two odd multipliers that spread the counters.
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35
_GOLDEN, _PRIME = 0x9E3779B1, 0x27D4EB2F
# keep iff the top 24 bits of the hash are >= threshold: an int32 compare (no unsigned one
# needed in the kernel) at a resolution of 2^-24 in the rate.
_BITS = 24


class SinksAndDropout(NamedTuple):
    """Traced inputs beyond q, k, v, bias and the mask (None when unused)."""

    sinks: jax.Array | None = None          # [Bs, Hs] float32, Bs in {1, B}, Hs in {1, Hq}
    dropout_seeds: jax.Array | None = None  # [Bs, Hs] uint32 (see head_seeds)
    # int32 [2]: the global (query, key) index of local index (0, 0), added before hashing, so
    # a ring step's slice draws the one-device pattern. Only implementations with
    # ``takes_dropout_offset`` read it; the ring (ring.py) alone sets it.
    dropout_offset: jax.Array | None = None
    # The arrays score_mod and mask_mod read (mods.py); the floating ones are differentiable.
    mod_aux: tuple = ()


def _u32(x):
    return jnp.asarray(x).astype(jnp.uint32)


def mix(x):
    """murmur3 fmix32: a bijection of uint32 with full avalanche."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(_M1)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(_M2)
    return x ^ (x >> 16)


def key_words(rng, name: str = "rng"):
    """Two uint32 words from a PRNG key (typed or raw, any implementation); anything else is
    refused naming ``name`` (JAX's own errors do not say which argument)."""
    check_key(rng, name)
    return jax.random.bits(rng, (2,), jnp.uint32)


def check_key(rng, name: str):
    """Raises unless ``rng`` is one PRNG key: typed (shape ()) or raw uint32 data of the
    default implementation's key shape (uint32[2] for threefry)."""
    dtype, shape = getattr(rng, "dtype", None), getattr(rng, "shape", None)
    # The raw shape follows jax_default_prng_impl, so it is asked for, not assumed.
    raw = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    rule = (f"{name} must be a single PRNG key: a typed key from jax.random.key (shape ()) or "
            f"raw {raw.dtype}{list(raw.shape)} key data from jax.random.PRNGKey")
    if dtype is None:
        raise TypeError(f"{rule}; got {type(rng).__name__}")
    typed = jnp.issubdtype(dtype, jax.dtypes.prng_key)
    if not typed and dtype != raw.dtype:
        raise TypeError(f"{rule}; got {dtype}{list(shape)}")
    key_shape = () if typed else raw.shape
    if shape != key_shape:
        batch = len(shape) > len(key_shape) and shape[len(shape) - len(key_shape):] == key_shape
        raise ValueError(f"{rule}; got {dtype}{list(shape)}"
                         + (" (a batch of keys: one key per call is taken)" if batch else ""))


def head_seeds(words, batch: int, heads: int, broadcast: bool):
    """The per-(global flat batch index, head) seeds: ``[B, Hq]``, or ``[1, 1]`` when broadcast."""
    b, h = (1, 1) if broadcast else (batch, heads)
    bi = jnp.arange(b, dtype=jnp.uint32)[:, None]
    hi = jnp.arange(h, dtype=jnp.uint32)[None, :]
    return mix(mix(words[0] ^ mix(bi * jnp.uint32(_GOLDEN) + words[1])) + hi * jnp.uint32(_PRIME))


def threshold(rate: float) -> int:
    return int(round(rate * (1 << _BITS)))


def keep(seed, rows, cols, rate: float):
    """Bool keep mask for absolute query indices ``rows [..., Tq, 1]`` and key indices
    ``cols [..., 1, Tk]`` under ``seed`` (uint32, broadcastable to ``[..., 1, 1]``)."""
    return kept(mix(row_key(seed, rows) ^ column_key(seed, cols)), rate)


# keep's three factors, for kernels that hold rows and columns in their own layouts (the Mosaic
# GPU forward: one row key per row, one column key per column, one mix per pair).
def row_key(seed, rows):
    """One mix per query row."""
    return mix(seed ^ (_u32(rows) * jnp.uint32(_GOLDEN)))


def column_key(seed, cols):
    """No mix: a multiply and an add per key column."""
    return _u32(cols) * jnp.uint32(_PRIME) + seed


def kept(bits, rate: float):
    """The keep decision of a pair's mixed bits: their top 24 bits against the threshold."""
    return (bits >> (32 - _BITS)).astype(jnp.int32) >= threshold(rate)


def apply_dropout(x, keep_mask, rate: float):
    """x times 1 / (1 - rate) where kept, times 0 where dropped. ``keep_mask`` None: x.

    A product, not a select: a NaN row (the non-finite rule) stays NaN at its dropped pairs,
    as the arithmetic of the softmax normalised after the product gives."""
    if keep_mask is None:
        return x
    return x * jnp.where(keep_mask, 1.0 / (1.0 - rate), 0.0).astype(x.dtype)


def initial_stats(sink, shape):
    """The online softmax's (m, l) before any key: (-inf, 0), or (sink, 1) with a sink
    (a -inf sink is no sink)."""
    if sink is None:
        return jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32)
    sink = jnp.broadcast_to(sink.astype(jnp.float32), shape)
    return sink, jnp.where(sink > -jnp.inf, 1.0, 0.0).astype(jnp.float32)


def sink_gradient(sinks, lse, delta):
    """d sinks ``[B, Hq]`` (before summing over the sinks' broadcast axes) from the logsumexp
    and delta = rowsum(dO * O) - d(lse), each ``[B, Hq, Lq]``: out and lse depend on the sink
    only through P_sink = exp(sink - lse)."""
    sinks = sinks.astype(jnp.float32)[:, :, None]
    # lse >= sink: P_sink <= 1; a -inf sink (no sink) has P_sink = 0, also in an empty row
    # (lse = -inf, where the difference is NaN).
    p_sink = jnp.where(sinks > -jnp.inf, jnp.exp(sinks - lse), 0.0)
    return -jnp.sum(p_sink * delta, axis=-1)


def dropout_mask(rng, shape, rate: float, *, broadcast_dropout: bool = True):
    """The keep mask ``flash_attention(..., dropout_rng=rng, dropout_rate=rate)`` uses, as bool
    ``[batch..., Hq, Lq, Lk]`` (``shape``); True = kept (and scaled by ``1 / (1 - rate)``).

    For tests and debugging: it materialises ``Lq * Lk`` per (batch, head).
    """
    *batch_shape, hq, lq, lk = shape
    b = 1
    for n in batch_shape:
        b *= n
    seeds = head_seeds(key_words(rng), b, hq, broadcast_dropout)[:, :, None, None]
    rows = jnp.arange(lq, dtype=jnp.int32)[:, None]
    cols = jnp.arange(lk, dtype=jnp.int32)[None, :]
    mask = keep(seeds, rows, cols, float(rate))
    return jnp.broadcast_to(mask, (b, hq, lq, lk)).reshape(tuple(shape))
