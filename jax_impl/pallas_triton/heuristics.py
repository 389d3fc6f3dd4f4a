"""Default tile sizes of the Pallas kernels, per head dim and dtype.

Shared memory bounds the tiles: a [block, head_dim] tile of K and of V per pipeline stage,
so wide heads and 4-byte inputs take smaller tiles. Short sequences clip the tiles to the
next power of two (never below 16, Triton's dot minimum) instead of padding to a full tile.
"""
from __future__ import annotations

import itertools

import numpy as np

from jax_impl.config import BlockSizes

MIN_BLOCK = 16
MAX_HEAD_DIM = 256


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def padded_head_dim(head_dim: int) -> int:
    return max(MIN_BLOCK, next_power_of_two(head_dim))


def default_block_sizes(head_dim: int, dtype) -> BlockSizes:
    """The unclipped tiles for one (head_dim, dtype) class."""
    d = padded_head_dim(head_dim)
    wide = np.dtype(dtype).itemsize >= 4
    if d <= 64 and not wide:
        return BlockSizes(128, 64, 64, 64, 64, 64, num_warps=4, num_warps_bwd=4, num_stages=3)
    if d <= 128 and not wide:
        return BlockSizes(128, 64, 32, 64, 64, 32, num_warps=8, num_warps_bwd=8, num_stages=2)
    if d <= 64:  # fp32, small heads
        return BlockSizes(64, 64, 32, 64, 64, 32, num_warps=4, num_warps_bwd=4, num_stages=2)
    if d <= 128:
        return BlockSizes(64, 32, 32, 32, 32, 32, num_warps=4, num_warps_bwd=4, num_stages=2)
    return BlockSizes(32, 32, 16, 32, 32, 16, num_warps=4, num_warps_bwd=4, num_stages=1)


def clip_block(block: int, length: int) -> int:
    return min(block, max(MIN_BLOCK, next_power_of_two(length)))


def all_default_configs():
    """Every BlockSizes the heuristic can return, with a (head_dim, dtype) that selects it."""
    configs = {}
    for head_dim, dtype in itertools.product((16, 64, 128, 256), ("float32", "bfloat16", "float16")):
        configs.setdefault(default_block_sizes(head_dim, dtype), (head_dim, dtype))
    return configs
