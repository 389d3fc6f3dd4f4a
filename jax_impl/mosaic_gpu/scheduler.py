"""Work order of the forward: which (query pair, head, batch row) each CTA takes, and when.

A work item is one CTA's ``2 * block_q`` query rows (a *pair* of consumer tiles) of one
(batch row, query head). Items are numbered heaviest first: under a band bounded above
(causal, a right window: ``masking.later_query_tiles_heavier``) the last pair sees the most key
tiles, so item 0 is the last pair; within a pair, the heads and batch rows follow each other
(heads fastest, so the query heads of one kv head run side by side and share K/V in L2).

Persistent (FlashAttention-3's static persistent scheduler, ``tile_scheduler.hpp``): the grid
is ``num_ctas`` CTAs (one per SM); CTA ``c`` takes items ``c, c + num_ctas, c + 2 num_ctas, ...``,
so the heavy items start first everywhere and the light ones fill the tail. Not persistent:
one CTA per item, launched in item order. The kernel body sees only ``WorkOrder.item``.
"""
from __future__ import annotations

import dataclasses

from jax import lax

DEFAULT_NUM_SMS = 132  # H100 SXM and H200; a CUDA device, when there is one, says its own


@dataclasses.dataclass(frozen=True)
class WorkOrder:
    num_pairs: int     # query pairs per (batch row, head): cdiv(Lq, 2 * block_q)
    heads: int         # query heads
    batch: int
    heavy_last: bool   # later pairs see more key tiles (masking.later_query_tiles_heavier)
    num_ctas: int      # CTAs of the grid

    @classmethod
    def create(cls, num_pairs: int, heads: int, batch: int, heavy_last: bool, persistent: bool,
               num_sms: int = DEFAULT_NUM_SMS) -> "WorkOrder":
        items = num_pairs * heads * batch
        return cls(num_pairs, heads, batch, heavy_last, min(items, num_sms) if persistent else items)

    @property
    def num_items(self) -> int:
        return self.num_pairs * self.heads * self.batch

    def item(self, w):
        """Work item ``w`` (traced int32) -> (pair, head, batch row)."""
        per_pair = self.heads * self.batch
        rank, rest = lax.div(w, per_pair), lax.rem(w, per_pair)
        pair = self.num_pairs - 1 - rank if self.heavy_last else rank
        return pair, lax.rem(rest, self.heads), lax.div(rest, self.heads)

    def items_of(self, cta):
        """How many items CTA ``cta`` takes: ``cdiv(num_items - cta, num_ctas)``."""
        return lax.div(self.num_items - cta + self.num_ctas - 1, self.num_ctas)

    def work(self, cta, i):
        """CTA ``cta``'s ``i``-th item."""
        return cta + i * self.num_ctas

    def loop(self, cta, body, carry):
        """``body(pair, head, batch, carry) -> carry`` over CTA ``cta``'s items, in order."""
        def step(i, carry):
            return body(*self.item(self.work(cta, i)), carry)
        return lax.fori_loop(0, self.items_of(cta), step, carry)
