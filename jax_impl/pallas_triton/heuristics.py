"""Default tile sizes of the Pallas kernels, per head dim, dtype and causality, and their
shared-memory footprint.

The tiles come from ``tuned_blocks.json`` (the winners of ``tools/tune_blocks.py``, timed
on a GPU) when it has an entry for the (head-dim class, dtype, causal) of a call, else from
``rule_block_sizes``. The rule was chosen with the compile report (``python -m
tools.compile_report``, table in benchmarks/results/compile_report_sm90.md):
16-bit tiles whose every dot has M >= 64, so that Hopper runs it with ``wgmma``, that compile with
no register spills and fit the shared-memory budget. Short sequences clip the tiles to the next
power of two (never below 16, Triton's dot minimum) instead of padding to a full tile.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import pathlib

import numpy as np

from jax_impl.config import BlockSizes

MIN_BLOCK = 16
MAX_HEAD_DIM = 256
# Shared memory one thread block may use on sm_90 (H100/H200): 227 KiB.
SHARED_MEMORY_BUDGET = 232448
TUNED_BLOCKS_FILE = pathlib.Path(__file__).with_name("tuned_blocks.json")
KERNELS = ("forward", "dkdv", "dv", "dk", "dq")  # dkdv, or dv and dk where split_dkdv


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def head_dim_tile(head_dim: int) -> int:
    """Dp: the width of the kernels' head-dim tiles (a power of two, masked past head_dim)."""
    return max(MIN_BLOCK, next_power_of_two(head_dim))


def head_dim_class(head_dim: int) -> int:
    """64 (D <= 64), 128 or 256: the classes the tiles are chosen for."""
    return max(64, head_dim_tile(head_dim))


def rule_block_sizes(head_dim: int, dtype) -> BlockSizes:
    """The unclipped tiles for one (head-dim class, dtype) when no tuned entry exists.

    Dots' M: forward block_q (QK^T, PV); dK/dV block_k_dkv (all four: the transposed tiles
    K Q^T, V dO^T, P^T dO, dS^T Q); dQ block_q_dq (QK^T, dO V^T, dS K). 16-bit tiles keep all of them >= 64,
    so that every dot is a wgmma; 128-wide key tiles in the forward up to D=128.
    fp32 dots run on FMA units (precision HIGHEST, no TF32), whose operands a thread holds in
    registers over the whole head dim: small tiles over 8 warps, and from D=128 two stages and
    16-key dK/dV and dQ tiles, compile with no spills (triton 3.8).
    """
    d = head_dim_class(head_dim)
    if np.dtype(dtype).itemsize == 2:
        if d == 64:
            return BlockSizes(128, 128, 64, 64, 128, 64, num_warps=8, num_warps_bwd=8, num_stages=3)
        if d == 128:
            return BlockSizes(128, 64, 64, 64, 128, 64, num_warps=8, num_warps_bwd=8, num_stages=3)
        # D=256: dK and dV in two kernels (split_dkdv) and 2 stages (cp.async straight to shared
        # memory, no register staging): none spills.
        return BlockSizes(64, 32, 32, 64, 64, 16, num_warps=8, num_warps_bwd=8, num_stages=2)
    if d == 64:
        return BlockSizes(32, 32, 32, 32, 32, 32, num_warps=8, num_warps_bwd=8, num_stages=1)
    if d == 128:
        return BlockSizes(16, 32, 16, 16, 32, 16, num_warps=8, num_warps_bwd=8, num_stages=2)
    return BlockSizes(32, 32, 16, 16, 16, 16, num_warps=8, num_warps_bwd=8, num_stages=2)


# Registers per thread that dK/dV's two fp32 accumulators may take before the kernel is split
# in two (dV, then dK, each holding one): past it ptxas spills (D=256: 620-1,300 bytes per
# thread with one kernel, whatever the tiles, in the compile report).
DKDV_ACCUMULATOR_REGISTERS = 96


def split_dkdv(head_dim: int, blocks: BlockSizes) -> bool:
    """Whether the backward computes dV and dK in two kernels instead of one. The split costs
    one more dot per tile pair (S^T is recomputed: 5 dots instead of 4) and reads Q and dO
    twice; it is taken only where one kernel's accumulators alone would fill the registers."""
    registers = 2 * blocks.block_k_dkv * head_dim_tile(head_dim) // (32 * blocks.num_warps_bwd)
    return registers > DKDV_ACCUMULATOR_REGISTERS


def kernels(head_dim: int, blocks: BlockSizes) -> tuple[str, ...]:
    """The kernels of one forward + backward, in launch order."""
    return ("forward", *(("dv", "dk") if split_dkdv(head_dim, blocks) else ("dkdv",)), "dq")


# A score_mod adds its [bq, bk] tile of work to the forward's logits: on the tuned 4 warps of
# D=64 (128 x 64 tiles, 255 registers) ALiBi spilled 8-12 bytes; on 8 warps none does.
SCORE_MOD_FORWARD_WARPS = 8


def default_block_sizes(head_dim: int, dtype, causal: bool = False, table: dict | None = None, *,
                        score_mod: bool = False) -> BlockSizes:
    """The unclipped tiles for one call: the tuned entry if there is one, else the rule; with a
    ``score_mod`` the forward runs on at least SCORE_MOD_FORWARD_WARPS warps (same tiles)."""
    table = tuned_block_sizes() if table is None else table
    tuned = table.get((head_dim_class(head_dim), np.dtype(dtype).name, bool(causal)))
    blocks = tuned or rule_block_sizes(head_dim, dtype)
    if score_mod and blocks.num_warps < SCORE_MOD_FORWARD_WARPS:
        blocks = dataclasses.replace(blocks, num_warps=SCORE_MOD_FORWARD_WARPS)
    return blocks


def read_tuned_table(path) -> dict:
    """{(head-dim class, dtype name, causal): BlockSizes} from a tuned_blocks.json."""
    with open(path) as f:
        entries = json.load(f)["entries"]
    return {(e["head_dim"], np.dtype(e["dtype"]).name, bool(e["causal"])): BlockSizes(**e["block_sizes"])
            for e in entries}


@functools.lru_cache(maxsize=None)
def tuned_block_sizes() -> dict:
    return read_tuned_table(TUNED_BLOCKS_FILE) if TUNED_BLOCKS_FILE.exists() else {}


def clip_block(block: int, length: int) -> int:
    return min(block, max(MIN_BLOCK, next_power_of_two(length)))


def all_default_configs():
    """Every BlockSizes the heuristic can return, with a (head_dim, dtype, causal) that selects it."""
    configs = {}
    for head_dim, dtype, causal in itertools.product(
            (16, 64, 128, 256), ("float32", "bfloat16", "float16"), (False, True)):
        configs.setdefault(default_block_sizes(head_dim, dtype, causal), (head_dim, dtype, causal))
    return configs


# --- shared memory ---------------------------------------------------------------------------
# Fitted to what Triton 3.8 allocates for these kernels on sm_90a (the compile report's
# `shared`), as an upper bound: tests/tools/test_compile_report.py checks it against every
# default configuration and a few user ones. Per kernel, in elements of the input dtype: the
# tiles loaded once (their buffers are reused by the output's epilogue), and `num_stages`
# copies of the tiles the key or query loop streams.
SCRATCH_ALLOWANCE = 4096  # bytes: reductions and layout conversions of fp32 / mma.sync code


def shared_memory_estimate(kernel: str, head_dim: int, dtype, blocks: BlockSizes) -> int:
    """Bytes of shared memory one program of ``kernel`` (one of KERNELS) needs."""
    d, size = head_dim_tile(head_dim), np.dtype(dtype).itemsize
    stages = max(1, blocks.num_stages)
    row_stats = 0
    if kernel == "forward":  # Q held; K and V streamed
        tiles = blocks.block_q * d + stages * 2 * blocks.block_k * d
    elif kernel in ("dkdv", "dk", "dv"):  # Q, dO (+ 4 fp32 row vectors) streamed; P^T
        bq, bk = blocks.block_q_dkv, blocks.block_k_dkv
        held = 1 if kernel == "dv" else 2  # dV: K (and its epilogue); else K and V
        tiles = held * bk * d + stages * 2 * bq * d + bk * bq
        row_stats = stages * 4 * bq * 4  # max, log-sum, delta, the non-finite rule's poison
    elif kernel == "dq":  # Q and dO held; K and V streamed
        tiles = 2 * blocks.block_q_dq * d + stages * 2 * blocks.block_k_dq * d
    else:
        raise ValueError(f"kernel={kernel!r} must be one of {KERNELS}")
    return tiles * size + row_stats + SCRATCH_ALLOWANCE


def check_shared_memory(head_dim: int, dtype, blocks: BlockSizes, requested: BlockSizes) -> None:
    """Refuse ``requested`` (the user's block_sizes) when a kernel's tiles (``blocks``, clipped
    to the sequence) overflow SHARED_MEMORY_BUDGET: Triton would fail at launch."""
    for kernel in kernels(head_dim, blocks):
        need = shared_memory_estimate(kernel, head_dim, dtype, blocks)
        if need > SHARED_MEMORY_BUDGET:
            raise ValueError(
                f"block_sizes={requested} needs about {need} bytes ({need / 1024:.0f} KiB) of shared "
                f"memory in the {kernel} kernel at head_dim={head_dim}, dtype={np.dtype(dtype).name}; "
                f"the budget is {SHARED_MEMORY_BUDGET} bytes ({SHARED_MEMORY_BUDGET // 1024} KiB per "
                "block on H100/H200): use smaller tiles or fewer num_stages")
