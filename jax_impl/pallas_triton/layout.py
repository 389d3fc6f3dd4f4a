"""Tile geometry shared by the forward and backward kernels, and the loads and stores at its
edges.

Triton tiles are powers of two; sequence lengths and the head dim need not be. The last tile
of a sequence and the head-dim tail reach past the arrays: the kernels read those positions
as zeros (masked loads) and never write them (masked stores), so no operand is copied into a
padded buffer and no output is sliced out of one. Positions past a sequence are excluded by
the mask's length rule (they sit at or past q_len / kv_len: masking.with_padding switches the
rule on), zero head-dim columns add zero to every dot product. Users never see a divisibility
rule. Where the extents are whole tiles the loads and stores carry no mask at all.
"""
from __future__ import annotations

import dataclasses
import functools
import operator

import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from jax_impl.config import BlockSizes
from jax_impl.pallas_triton import heuristics


@dataclasses.dataclass(frozen=True)
class Layout:
    lq: int
    lk: int
    head_dim: int
    blocks: BlockSizes  # already clipped to the sequence lengths

    @classmethod
    def create(cls, lq: int, lk: int, head_dim: int, dtype, blocks: BlockSizes | None,
               causal: bool = False, score_mod: bool = False):
        """The clipped tiles of one call; user ``blocks`` that overflow shared memory are refused.
        ``score_mod``: the call has one (heuristics.default_block_sizes)."""
        requested = blocks
        blocks = blocks or heuristics.default_block_sizes(head_dim, dtype, causal, score_mod=score_mod)
        clip_q = lambda b: heuristics.clip_block(b, lq)
        clip_k = lambda b: heuristics.clip_block(b, lk)
        clipped = dataclasses.replace(
            blocks, block_q=clip_q(blocks.block_q), block_k=clip_k(blocks.block_k),
            block_q_dkv=clip_q(blocks.block_q_dkv), block_k_dkv=clip_k(blocks.block_k_dkv),
            block_q_dq=clip_q(blocks.block_q_dq), block_k_dq=clip_k(blocks.block_k_dq))
        if requested is not None:
            heuristics.check_shared_memory(head_dim, dtype, clipped, requested)
        return cls(lq, lk, head_dim, clipped)

    # The extents that whole tiles cover (tiles are powers of two: the largest divides by all):
    # the block of an operand that a kernel reads whole, and whether a sequence has a tail.
    @property
    def lq_tiled(self) -> int:
        b = self.blocks
        largest = max(b.block_q, b.block_q_dkv, b.block_q_dq)
        return tiles(self.lq, largest) * largest

    @property
    def lk_tiled(self) -> int:
        b = self.blocks
        largest = max(b.block_k, b.block_k_dkv, b.block_k_dq)
        return tiles(self.lk, largest) * largest

    @property
    def d_tile(self) -> int:
        return heuristics.head_dim_tile(self.head_dim)

    def features_within(self):
        """``[Dp]`` True on the real head-dim columns, or None when the head dim is a power of two."""
        return within(jnp.arange(self.d_tile, dtype=jnp.int32), self.head_dim)


def tiles(length: int, block: int) -> int:
    """Tiles of ``block`` that cover ``length`` (the last one may reach past it)."""
    return -(-length // block)


def within(positions, length: int):
    """``positions < length`` for one tile's positions ``[T]`` (``start + arange(T)``, ``start``
    a multiple of T), or None when ``length`` is a whole number of such tiles: then no tile
    reaches past it and the load or store that uses this needs no mask."""
    return None if length % positions.shape[0] == 0 else positions < length


def _outer_and(shape, valid):
    """The ``shape`` mask that is True where every axis's validity vector is (None: whole axis)."""
    parts = [v.reshape([-1 if a == axis else 1 for a in range(len(shape))])
             for axis, v in enumerate(valid) if v is not None]
    return None if not parts else jnp.broadcast_to(functools.reduce(operator.and_, parts), shape)


def load(ref, *valid):
    """``ref[...]`` (a ref or a view ``ref.at[...]``) with one validity vector (or None) per
    axis: positions that any axis marks invalid read as 0 instead of past the array's end."""
    mask = _outer_and(ref.shape, valid)
    return ref[...] if mask is None else plgpu.load(ref, mask=mask, other=0)


def store(ref, value, *valid):
    """``ref[...] = value``, writing only the positions that every axis marks valid."""
    mask = _outer_and(ref.shape, valid)
    if mask is None:
        ref[...] = value
    else:
        plgpu.store(ref, value, mask=mask)
