"""The Mosaic GPU kernel's tiles and pipeline depth, validated, and the defaults per head_dim.

A CTA takes ``2 * block_q`` query rows (one ``block_q`` tile per consumer warpgroup) and walks
key tiles of ``block_kv``; K and V sit in a ring of ``num_stages`` shared-memory stages. WGMMA
tiles are multiples of 64 rows, and the swizzled TMA tiles hold 64 columns of 16-bit values
(128 bytes), so both block sizes are multiples of 64.
"""
from __future__ import annotations

import dataclasses

import numpy as np

SHARED_MEMORY_BUDGET = 227 * 1024  # bytes a CTA may take on sm_90 (232448 opt-in less 1 KiB)
CONSUMERS = 2  # compute warpgroups per CTA (FlashAttention-3's forward)


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiles of ``implementation="mosaic_gpu"``.

    block_q: query rows per consumer warpgroup (a multiple of 64; the CTA takes twice this).
    block_kv: keys per pipeline stage (a multiple of 64).
    num_stages: K/V stages in shared memory (>= 2: one being read while the next is loaded).
    persistent: one CTA per SM walking the work items (FA3's static persistent scheduler);
      False: one CTA per work item.
    """

    block_q: int = 64
    block_kv: int = 128
    num_stages: int = 2
    persistent: bool = True

    def __post_init__(self):
        for name in ("block_q", "block_kv", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"mosaic_gpu.Config.{name}={value!r} must be an int")
        for name in ("block_q", "block_kv"):
            value = getattr(self, name)
            if value < 64 or value % 64:
                raise ValueError(f"mosaic_gpu.Config.{name}={value} must be a multiple of 64 "
                                 "(WGMMA tiles and 128-byte swizzled TMA tiles)")
        if self.block_q > 128:
            raise ValueError(f"mosaic_gpu.Config.block_q={self.block_q} must be 64 or 128 (one "
                             "consumer warpgroup's fp32 accumulator lives in its registers)")
        if not 2 <= self.num_stages <= 4:
            raise ValueError(f"mosaic_gpu.Config.num_stages={self.num_stages} must be in [2, 4]")
        if not isinstance(self.persistent, bool):
            raise TypeError(f"mosaic_gpu.Config.persistent={self.persistent!r} must be a bool")

    def shared_memory_bytes(self, head_dim: int, dtype) -> int:
        """Bytes of the kernel's scratch: Q (reused for O) per consumer, the K and V ring, the
        row statistics per consumer, and one 8-byte mbarrier per stage and role."""
        item = np.dtype(dtype).itemsize
        q = CONSUMERS * self.block_q * head_dim * item
        kv = 2 * self.num_stages * self.block_kv * head_dim * item
        stats = 2 * CONSUMERS * self.block_q * 4
        barriers = 8 * (4 * self.num_stages + CONSUMERS + 1)
        return q + kv + stats + barriers


def default_config(head_dim: int, dtype) -> Config:
    """The tiles for a call: 64 query rows per consumer, 128 keys per stage and two stages at
    head_dim 64 and 128 (JAX's and tokamax's choice for FlashAttention-3 on H100); at 256, 64
    keys per stage, so that the K/V ring and the accumulators fit."""
    del dtype  # 16-bit only (unsupported() refuses the rest)
    if head_dim <= 128:
        return Config(block_q=64, block_kv=128, num_stages=2)
    return Config(block_q=64, block_kv=64, num_stages=2)
