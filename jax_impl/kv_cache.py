"""A paged KV cache for ``flash_attention(q, k_pages, v_pages, page_table=...)``: build a page
table, append new keys and values at each sequence's length, gather pages back to dense.

Pages are ``[num_pages, page_size, Hkv, D]``, shared by the batch; row b's logical key j lives
in slot ``j % page_size`` of page ``page_table[b, j // page_size]``. Everything here is
functional; under ``jax.jit(..., donate_argnums=...)`` the append is a scatter into the donated
pages, in place (no copy of the cache).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_impl import arguments, masking


def make_page_table(batch: int, pages_per_sequence: int, *, num_pages: int | None = None,
                    key=None) -> jax.Array:
    """int32 ``[batch, pages_per_sequence]``: distinct pages for every (row, slot), in order
    (row b owns pages ``b * P ... b * P + P - 1``), or, with a PRNG ``key``, a random choice of
    distinct pages out of ``num_pages`` (default ``batch * P``): a shuffled table."""
    needed = batch * pages_per_sequence
    num_pages = needed if num_pages is None else num_pages
    if batch < 1 or pages_per_sequence < 1:
        raise ValueError(f"batch={batch} and pages_per_sequence={pages_per_sequence} must be >= 1")
    if num_pages < needed:
        raise ValueError(f"num_pages={num_pages} must be at least batch * pages_per_sequence = {needed}")
    ids = (jnp.arange(needed, dtype=jnp.int32) if key is None
           else jax.random.permutation(key, num_pages)[:needed].astype(jnp.int32))
    return ids.reshape(batch, pages_per_sequence)


def init_pages(num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype=jnp.float32):
    """Empty (zero) pages ``[num_pages, page_size, kv_heads, head_dim]``."""
    return jnp.zeros((num_pages, page_size, kv_heads, head_dim), dtype)


def _table(pages, page_table, name="k_pages"):
    """page_table's ids (``arguments.page_ids``), once the pages' and the table's shapes are checked."""
    if pages.ndim != 4:
        raise ValueError(f"{name} must be [num_pages, page_size, Hkv, D]; got {name}.shape={pages.shape}")
    table = arguments.page_ids(page_table, pages.shape[0])
    if table.ndim != 2:
        raise ValueError(f"page_table must be int [batch, pages_per_sequence]; got shape={table.shape}")
    return table


def append(k_pages, v_pages, page_table, lengths, new_keys, new_values):
    """Write ``new_keys``/``new_values`` ``[B, n, Hkv, D]`` at positions ``lengths[b] ...
    lengths[b] + n - 1`` of each row -> ``(k_pages, v_pages)``; the new lengths are
    ``lengths + n``.

    ``lengths`` must be int ``[B]``, traced or not. Concrete lengths past the table's capacity
    (``P * page_size``) raise; traced ones never write out of bounds: writes past the capacity
    are dropped. Page ids follow ``arguments.page_ids``' rule.
    """
    k_pages, v_pages = jnp.asarray(k_pages), jnp.asarray(v_pages)
    new_keys, new_values = jnp.asarray(new_keys), jnp.asarray(new_values)
    table = _table(k_pages, page_table)
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"k_pages and v_pages must have the same shape; got {k_pages.shape} {v_pages.shape}")
    num_pages, page_size, hkv, d = k_pages.shape
    batch, pages_per_sequence = table.shape
    if new_keys.shape != new_values.shape or new_keys.ndim != 4 or new_keys.shape[0] != batch \
            or new_keys.shape[2:] != (hkv, d):
        raise ValueError(f"new_keys and new_values must be [batch={batch}, n, Hkv={hkv}, D={d}]; got "
                         f"{new_keys.shape} and {new_values.shape}")
    n = new_keys.shape[1]
    capacity = pages_per_sequence * page_size
    known = masking.concrete(lengths)
    lengths = jnp.asarray(lengths) if known is None else known
    # dtype and shape are known at trace time: a traced float or misshapen length is refused too.
    if lengths.shape != (batch,) or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"lengths must be int [batch={batch}]; got shape {lengths.shape} dtype {lengths.dtype}")
    if known is not None and known.size and (known.min() < 0 or known.max() + n > capacity):
        raise ValueError(f"lengths + n must lie in [0, {capacity}] (pages_per_sequence * "
                         f"page_size); got lengths in [{known.min()}, {known.max()}] and n={n}")
    positions = jnp.asarray(lengths, jnp.int32)[:, None] + jnp.arange(n, dtype=jnp.int32)  # [B, n]
    slot_of_table = jnp.clip(positions // page_size, 0, pages_per_sequence - 1)
    pages = jnp.take_along_axis(table, slot_of_table, axis=1)
    # Past the capacity -> index num_pages: dropped.
    pages = jnp.where((positions >= 0) & (positions < capacity), pages, num_pages)
    slots = positions % page_size
    write = lambda cache, new: cache.at[pages, slots].set(new.astype(cache.dtype), mode="drop")
    return write(k_pages, new_keys), write(v_pages, new_values)


def gather(pages, page_table):
    """The dense cache ``[B, P * page_size, Hkv, D]`` the pages hold (a copy: for checking, or
    for gradients, which the paged call does not give). Page ids follow
    ``arguments.page_ids``' rule, so under ``jit`` too this holds what
    ``flash_attention(page_table=...)`` reads."""
    pages = jnp.asarray(pages)
    table = _table(pages, page_table, "pages")
    batch, pages_per_sequence = table.shape
    return pages[table].reshape(batch, pages_per_sequence * pages.shape[1], *pages.shape[2:])
