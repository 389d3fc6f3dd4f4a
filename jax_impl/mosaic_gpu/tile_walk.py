"""The walk of one work item's streamed tiles, shared by a kernel's memory warpgroup and its
compute warpgroups (FlexAttention's one loop body over two lists; FlashAttention-4's
block-sparse walk).

A work item streams either the mask's band (``masking.kv_block_range`` or ``q_block_range``
of the CTA's rows: no lists) or the CTA's tile lists (``kernel_tiles.tile_lists``: the
partial tiles, then the full ones). ``TileWalk`` holds that order once:

- the memory warpgroup streams it in one loop (``streamed``: one copy of its TMA issue in the
  program);
- a compute warpgroup visits it as *stretches* (``stretches``), each with the mask rules of
  its tiles (``TileRules``) or None where none of the warpgroup's own rows may see them (the
  band outside its own range: the ring's barriers only). In the band walk a compute warpgroup
  splits the CTA's range by its own rows (``band_bounds``): outside, masked edge, interior,
  masked edge, outside.

``visit`` walks the stretches with one tile body; ``visit_pipelined`` the forward's software
pipeline (a prologue on the first attended tile, the body on the others, an epilogue).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from jax_impl.kernel_tiles import FULL_TILE, PARTIAL_TILE, TileRules, broadcast_index


def listed_tiles(lists, b, head, tile):
    """The tiles that item ``(tile, head, b)`` visits, from the refs of ``common.tile_lists`` (scalars
    read from global memory; batch and head axes broadcast where of size 1): the partial ones,
    then the full ones, as ``[(count, index_of(t), TileRules)]``."""
    counts, indices, full_counts, full_indices = lists
    walk = []
    for count_ref, index_ref, rules in ((counts, indices, PARTIAL_TILE),
                                        (full_counts, full_indices, FULL_TILE)):
        row = (broadcast_index(count_ref, 0, b), broadcast_index(count_ref, 1, head), tile)
        walk.append((count_ref[row], lambda t, index_ref=index_ref, row=row: index_ref[(*row, t)],
                     rules))
    return walk


def band_bounds(lo, hi, split):
    """The six bounds of a compute warpgroup's five stretches inside its CTA's range
    ``[lo, hi)``, from ``masking.kv_block_split`` (or ``q_block_split``) of its own rows:
    outside its own range, its masked edge, its interior, its other edge, outside again (an
    empty own range may sit anywhere)."""
    return [lo, *(jnp.minimum(jnp.maximum(x, lo), hi) for x in split), hi]


_BAND_RULES = (None, TileRules.band(True), TileRules.band(False), TileRules.band(True), None)


class TileWalk(NamedTuple):
    """One item's streamed tiles in the order the memory warpgroup loads them."""

    bounds: tuple | None   # the band: (lo, hi), or a compute warpgroup's six (band_bounds)
    listed: tuple | None   # the lists: ((count, index_of, TileRules) partial, then full)
    last: int = 0          # the lists' last entry (a static bound on every read)

    @classmethod
    def of(cls, lists, bounds, b, head, tile) -> "TileWalk":
        """The band's ``bounds`` when ``lists`` (the kernel's tile-list refs) is None, else
        item ``(tile, head, b)``'s lists (their counts read here)."""
        if lists is None:
            return cls(tuple(bounds), None)
        return cls(None, tuple(listed_tiles(lists, b, head, tile)), lists[1].shape[-1] - 1)

    def streamed(self):
        """The memory warpgroup's walk as ``(start, stop, index_of)``: one loop, the partial
        list then the full one (both reads stay inside the lists; the select picks one)."""
        if self.listed is None:
            return self.bounds[0], self.bounds[-1], lambda t: t
        (count, partial, _), (full_count, full, _) = self.listed
        last = self.last
        return 0, count + full_count, lambda t: jnp.where(
            t < count, partial(jnp.minimum(t, last)), full(jnp.clip(t - count, 0, last)))

    def stretches(self):
        """A compute warpgroup's walk: ``[(start, stop, index_of, rules or None)]`` in order;
        None: tiles that none of its rows may see."""
        if self.listed is None:
            b = self.bounds
            return [(start, stop, lambda t: t, rules)
                    for start, stop, rules in zip(b[:-1], b[1:], _BAND_RULES)]
        return [(0, count, index_of, rules) for count, index_of, rules in self.listed]

    def visit(self, attend, skip, carry):
        """``attend(j, carry, rules)`` on every tile of the stretches, ``skip(t, carry)`` on
        the passed ones, in order."""
        for start, stop, index_of, rules in self.stretches():
            body = skip if rules is None else (
                lambda t, carry, index_of=index_of, rules=rules: attend(index_of(t), carry, rules))
            carry = lax.fori_loop(start, stop, body, carry)
        return carry

    def visit_pipelined(self, first, body, last, skip, carry):
        """The forward's pipeline over the stretches: ``first(j, carry, rules)`` on the first
        attended tile (the prologue), ``body(j, carry, rules)`` on the others, ``last(carry)``
        once after them when any was attended (the epilogue), ``skip(t, carry)`` on the passed
        tiles. The band's attended stretches are contiguous; in the lists a tile that none of
        the warpgroup's rows may see is computed masked (its P is 0)."""
        if self.listed is None:
            b = self.bounds
            carry = lax.fori_loop(b[0], b[1], skip, carry)
            attends = b[1] < b[4]
            carry = lax.cond(attends, lambda x: first(b[1], x), lambda x: x, carry)
            after_first = b[1] + 1
            for start, stop, rules in zip(b[1:4], b[2:5], _BAND_RULES[1:4]):
                carry = lax.fori_loop(jnp.maximum(start, after_first), stop,
                                      functools.partial(body, rules=rules), carry)
            carry = lax.cond(attends, last, lambda x: x, carry)
            return lax.fori_loop(b[4], b[5], skip, carry)
        done = jnp.int32(0)  # tiles attended so far
        for count, index_of, rules in self.listed:
            carry = lax.cond((done == 0) & (count > 0), lambda x, index_of=index_of,
                             rules=rules: first(index_of(0), x, rules), lambda x: x, carry)
            carry = lax.fori_loop(jnp.where(done == 0, 1, 0), count,
                                  lambda t, x, index_of=index_of, rules=rules: body(
                                      index_of(t), x, rules), carry)
            done = done + count
        return lax.cond(done > 0, last, lambda x: x, carry)
