"""Padding and tile geometry shared by the forward and backward kernels.

Triton tiles are powers of two, so the wrapper pads sequence lengths up to a whole number of
tiles and the head dim up to a power of two, with zeros. Padded keys and queries are excluded
by the mask's length rule (they sit at or past q_len / kv_len), padded head-dim columns add
zero to every dot product; outputs are sliced back. Users never see a divisibility rule.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_impl.config import BlockSizes
from jax_impl.pallas_triton import heuristics


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclasses.dataclass(frozen=True)
class Layout:
    lq: int
    lk: int
    head_dim: int
    blocks: BlockSizes  # already clipped to the sequence lengths

    @classmethod
    def create(cls, lq: int, lk: int, head_dim: int, dtype, blocks: BlockSizes | None,
               causal: bool = False):
        """The clipped tiles of one call; user ``blocks`` that overflow shared memory are refused."""
        requested = blocks
        blocks = blocks or heuristics.default_block_sizes(head_dim, dtype, causal)
        clip_q = lambda b: heuristics.clip_block(b, lq)
        clip_k = lambda b: heuristics.clip_block(b, lk)
        clipped = dataclasses.replace(
            blocks, block_q=clip_q(blocks.block_q), block_k=clip_k(blocks.block_k),
            block_q_dkv=clip_q(blocks.block_q_dkv), block_k_dkv=clip_k(blocks.block_k_dkv),
            block_q_dq=clip_q(blocks.block_q_dq), block_k_dq=clip_k(blocks.block_k_dq))
        if requested is not None:
            heuristics.check_shared_memory(head_dim, dtype, clipped, requested)
        return cls(lq, lk, head_dim, clipped)

    @property
    def lq_pad(self) -> int:  # tiles are powers of two: the largest divides by all
        b = self.blocks
        return _round_up(self.lq, max(b.block_q, b.block_q_dkv, b.block_q_dq))

    @property
    def lk_pad(self) -> int:
        b = self.blocks
        return _round_up(self.lk, max(b.block_k, b.block_k_dkv, b.block_k_dq))

    @property
    def d_pad(self) -> int:
        return heuristics.padded_head_dim(self.head_dim)

    def pad(self, x, seq_axis: int | None, seq_len: int | None, head_axis: int | None = None):
        """Zero-pad one sequence axis to ``seq_len`` and, if given, one head-dim axis to d_pad."""
        if x is None:
            return None
        widths = [(0, 0)] * x.ndim
        if seq_axis is not None:
            widths[seq_axis] = (0, seq_len - x.shape[seq_axis])
        if head_axis is not None:
            widths[head_axis] = (0, self.d_pad - x.shape[head_axis])
        return x if all(w == (0, 0) for w in widths) else jnp.pad(x, widths)
