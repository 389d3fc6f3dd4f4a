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
# Registers per thread after setmaxnreg, every kernel: FA3's split for two compute warpgroups
# and a memory one, 2 x 128 x 240 + 128 x 24 = 64512 of the SM's 65536. (The forward's 232/40
# until 2026-12-02 spilled where this does not: every feature at once at D=128, D=256.)
CONSUMER_REGISTERS = 240
PRODUCER_REGISTERS = 24
ALIGNMENT_SLACK = 3 * 1024  # Mosaic's padding between the forward's buffers (shared_memory_bytes)
BACKWARDS = ("mosaic_gpu", "pallas_triton")
DQ_STRATEGIES = ("separate", "fused")  # BackwardConfig.dq


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiles of ``implementation="mosaic_gpu"``.

    block_q: query rows per consumer warpgroup (a multiple of 64; the CTA takes twice this).
    block_kv: keys per pipeline stage (a multiple of 64).
    num_stages: K/V stages in shared memory (>= 2: one being read while the next is loaded).
    persistent: one CTA per SM walking the work items (FA3's static persistent scheduler);
      False: one CTA per work item.
    backward: whose backward kernels differentiate the call: "mosaic_gpu" (this package's
      dK/dV and dQ kernels), "pallas_triton" (the Triton kernels with their own tiles, from
      the same RowStats: the route to compare with, or to fall back on), or None (the
      default: "mosaic_gpu" compiled, "pallas_triton" interpreted, where the Mosaic one can
      hang: docs/limitations.md).
    backward_config: the tiles and dQ strategy of this package's backward kernels
      (``BackwardConfig``, e.g. ``BackwardConfig(dq="fused")``); None: ``default_backward_config``.
    overlap: FA3's intra-warpgroup overlap in the forward: the next tile's S = Q K^T issued with
      this tile's P V and the softmax run while P V is in flight (True, the default at head_dim
      64/128); False: P V waited before the next S, fewer registers live (head_dim 256).
    pack_query_group: whether the forward packs the query heads that share a kv head into one
      work item's rows (GQA/MQA; row r is query r // G of the group's head r % G): None (the
      default) where ``packs_query_group`` finds it pays (few query rows), True always (MHA
      has nothing to pack), False never. A call with dropout, a bias or a dense mask is never
      packed (they differ per query head within a tile's rows); True with one of them is
      refused by name.
    """

    block_q: int = 64
    block_kv: int = 128
    num_stages: int = 2
    persistent: bool = True
    backward: str | None = None
    backward_config: "BackwardConfig | None" = None
    pack_query_group: bool | None = None
    overlap: bool = True

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
        if self.backward is not None and self.backward not in BACKWARDS:
            raise ValueError(f"mosaic_gpu.Config.backward={self.backward!r} must be one of "
                             f"{BACKWARDS}")
        if self.backward_config is not None and not isinstance(self.backward_config,
                                                               BackwardConfig):
            raise TypeError(f"mosaic_gpu.Config.backward_config={self.backward_config!r} must be "
                            "a mosaic_gpu.BackwardConfig or None")
        if not isinstance(self.overlap, bool):
            raise TypeError(f"mosaic_gpu.Config.overlap={self.overlap!r} must be a bool")
        if self.pack_query_group not in (None, True, False):
            raise TypeError(f"mosaic_gpu.Config.pack_query_group={self.pack_query_group!r} must "
                            "be None (where it pays), True or False")

    @property
    def rows_per_cta(self) -> int:
        return CONSUMERS * self.block_q

    def shared_memory_bytes(self, head_dim: int, dtype, pairwise_bytes: int = 0,
                            segment_ids: bool = False) -> int:
        """Bytes of the kernel's scratch: Q (reused for O) per consumer, the K and V ring, the
        row statistics per consumer, one 8-byte mbarrier per stage and role, and Mosaic's
        alignment of the buffers (measured: 2.9-3.0 KiB above their sum in every compiled
        configuration, benchmarks/results/mosaic_forward_tiles_sm90.md). ``pairwise_bytes``:
        bytes per (query, key) pair of the bias and mask tiles streamed beside K and V (the
        bias's itemsize, plus 1 for the int8 mask; 0: neither), with their two barriers.
        ``segment_ids``: the key tiles' ids (int32) in a ring beside K's, taken in whole KiB
        (compiled with 64-key stages, its 512 bytes left the next buffer's 1 KiB alignment
        424 bytes past this estimate)."""
        item = np.dtype(dtype).itemsize
        q = CONSUMERS * self.block_q * head_dim * item
        kv = 2 * self.num_stages * self.block_kv * head_dim * item
        stats = 2 * CONSUMERS * self.block_q * 4
        barriers = 8 * (4 * self.num_stages + CONSUMERS + 1)
        pairwise = 0
        if pairwise_bytes:
            pairwise = (self.num_stages * CONSUMERS * self.block_q * self.block_kv * pairwise_bytes
                        + 8 * 2 * self.num_stages)
        ids = segment_ids * -(-self.num_stages * self.block_kv * 4 // 1024) * 1024
        return q + kv + stats + barriers + pairwise + ids + ALIGNMENT_SLACK


PREVIOUS_DEFAULT = Config(block_q=64, block_kv=128, num_stages=2)  # every head_dim until 0.2.0


DROPOUT_D128 = Config(block_q=64, block_kv=64, num_stages=2)  # head_dim 128 with dropout


PAIRWISE = Config(block_q=64, block_kv=64, num_stages=2)  # with a bias or a dense mask


def default_config(head_dim: int, dtype, *, dropout: bool = False,
                   pairwise_bytes: int = 0) -> Config:
    """The tiles for a call, chosen from the compiled sweep (docs/design.md, "Forward tiles";
    benchmarks/results/mosaic_forward_tiles_sm90.md), not yet from GPU timings:

    - head_dim 64: 128 query rows per consumer (a 256-row CTA), 64 keys per stage, two stages:
      each K/V tile brought into shared memory serves twice the query rows of 64 x 128 (half the
      ring's traffic per FLOP, where D=64 has the least arithmetic per byte; FA3 too takes its
      largest query blocks at hdim 64), with the same accumulator registers per thread
      (S 128 x 64 = 64 x 128 in fp32), 0 spills and 68 KiB of shared memory;
    - head_dim 128: 64 x 128 x 2 (``PREVIOUS_DEFAULT``): the only 128-key candidate that fits
      (a third stage or 192 keys need 228 KiB), and 128 query rows spill;
    - head_dim 256: 64 x 64 x 2 without the intra-warpgroup overlap (``D256``): the ring fits
      (196 KiB), and O's 64 x 256 fp32 accumulator (128 registers per thread) leaves too few
      registers to keep P_{j-1} and a running P V beside S (the overlap spilled 16-24 bytes in
      the masked tiles, none without it).

    ``Config(64, 128, 2)`` (``PREVIOUS_DEFAULT``) stays selectable at every head_dim.

    With dropout at head_dim 128, 64 keys per stage (``DROPOUT_D128``), taken when 64 x 128
    spilled 20 bytes in the masked tiles; both compile without spills now
    (benchmarks/results/mosaic_compile_report_sm90.md, "dropout" rows): a GPU's timing is to
    choose between them.

    With a bias or a dense mask (``pairwise_bytes`` > 0: bytes per pair of their tiles,
    ``Config.shared_memory_bytes``): at head_dim 64 the defaults above (128 x 64 x 2) where
    their ring fits the shared memory and no dropout is asked (0 spills with a bias, a mask,
    both, or segment ids beside them; a float32 bias with a mask needs 229 KiB; with dropout
    they spill 12-36 bytes in the masked tiles), else 64 x 64 x 2 (``PAIRWISE``, 0 spills);
    at head_dim 128 always ``PAIRWISE``: on 64 x 128 a mask spills 64/64 bytes in the causal
    tiles and a 16-bit bias needs 228 KiB ("bias_mask" rows of the compile report)."""
    tiles = _default_tiles(head_dim, dropout)
    if head_dim > 128 or not pairwise_bytes:
        return tiles  # at 256 a bias or mask ring does not fit beside K and V: not offered
    if head_dim > 64 or dropout or tiles.shared_memory_bytes(
            head_dim, dtype, pairwise_bytes) > SHARED_MEMORY_BUDGET:
        return PAIRWISE
    return tiles


PACKING_GAIN = 0.9  # pack where it leaves at most this share of the unpacked work items


def packs_query_group(config: Config, lq: int, groups: int, *,
                      per_head_pairs: bool = False) -> bool:
    """Whether the forward packs each kv head's ``groups`` query heads into one work item's
    rows (``Config.pack_query_group``; None decides here). It pays where Lq fills few CTA rows:
    unpacked, each query head's Lq rows are padded to whole items of ``2 * block_q`` rows and
    every item reads the kv head's K and V tiles again; packed, the group's Lq * groups rows
    fill the items and each K/V tile serves them all. Packed where that leaves at most
    ``PACKING_GAIN`` of the unpacked items (FlashAttention-3's PackGQA rule, in items): e.g.
    Lq=64 with 8 query heads per kv head at D=128, 4 items instead of 8. ``per_head_pairs``:
    the call has dropout (its hash is seeded per query head), a bias or a dense mask (their
    tiles are per head): never packed."""
    if groups == 1 or per_head_pairs or config.pack_query_group is False:
        return False
    if config.pack_query_group:
        return True
    rows = config.rows_per_cta
    return -(-lq * groups // rows) <= PACKING_GAIN * groups * -(-lq // rows)


D256 = Config(block_q=64, block_kv=64, num_stages=2, overlap=False)  # head_dim 256


def _default_tiles(head_dim: int, dropout: bool) -> Config:
    if head_dim <= 64:
        return Config(block_q=128, block_kv=64, num_stages=2)
    if head_dim <= 128:
        return DROPOUT_D128 if dropout else PREVIOUS_DEFAULT
    return D256


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Tiles of the backward kernels (backward.py). Each CTA's two compute warpgroups own one
    tile each of the side that stays (``block_kv`` keys in dK/dV, ``block_q`` queries in dQ)
    and walk the other side's tiles, which the memory warpgroup streams through a ring of
    ``num_stages`` stages. 64 x 64 tiles keep dK, dV (2 x 64 x 128 fp32) and the two
    transposed logit tiles of dK/dV in one warpgroup's registers at head_dim 128.

    dq: where dQ is computed. "separate" (the default): a dQ kernel of its own recomputes S and
      dP per query tile (7 GEMMs per tile pair) and writes each dQ row once: bitwise
      repeatable. "fused": the dK/dV kernel adds dS K of each tile pair into an fp32 dQ in
      global memory by TMA reduce-add (FlashAttention-3's 5 GEMMs, no dQ kernel), in whatever
      order the CTAs finish: NOT bitwise repeatable (fp32 sums in a varying order)."""

    block_q: int = 64
    block_kv: int = 64
    num_stages: int = 2
    dq: str = "separate"

    def __post_init__(self):
        for name in ("block_q", "block_kv"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 64 or value % 64 or value > 128:
                raise ValueError(f"mosaic_gpu.BackwardConfig.{name}={value!r} must be 64 or 128")
        if not isinstance(self.num_stages, int) or not 2 <= self.num_stages <= 4:
            raise ValueError(f"mosaic_gpu.BackwardConfig.num_stages={self.num_stages!r} must be "
                             "in [2, 4]")
        if self.dq not in DQ_STRATEGIES:
            raise ValueError(f"mosaic_gpu.BackwardConfig.dq={self.dq!r} must be one of "
                             f"{DQ_STRATEGIES} (dQ in a kernel of its own, or in dK/dV's)")

    def shared_memory_bytes(self, head_dim: int, dtype, segment_ids: bool = False,
                            pairwise_bytes: int = 0) -> int:
        """The larger of the two kernels' scratch: dK/dV holds K and V per consumer and a ring
        of Q, dO and three row vectors; dQ holds Q, dO and three row vectors per consumer and a
        ring of K, V and the keys' poison; both hold a tile's row and column offsets per
        consumer (int32, read by the mask of edge tiles), and with segment ids a ring of the
        streamed tiles' ids (int32, one more barrier per stage). With ``dq="fused"`` there is
        no dQ kernel, and dK/dV holds per consumer dS^T (16-bit, dQ's left operand) and the
        fp32 dQ tile that the TMA reduce-add reads. ``pairwise_bytes``: bytes per (query, key)
        pair of a bias and a dense mask (``Config.shared_memory_bytes``; a bias with dbias is
        read as float32: 4), whose tiles (both warpgroups' rows by the streamed tile) each
        kernel streams in a ring of its own, one barrier per stage each; dK/dV's bias is
        float32 whatever the bias's dtype."""
        item = np.dtype(dtype).itemsize
        own = lambda rows: CONSUMERS * 2 * rows * head_dim * item
        ring = lambda rows: self.num_stages * 2 * rows * head_dim * item
        dkdv = own(self.block_kv) + ring(self.block_q) + self.num_stages * 3 * self.block_q * 4
        dq = (own(self.block_q) + CONSUMERS * 3 * self.block_q * 4 + ring(self.block_kv)
              + self.num_stages * self.block_kv * 4)
        if self.dq == "fused":
            dkdv += CONSUMERS * self.block_q * (self.block_kv * item + head_dim * 4)
            dq = 0
        positions = 2 * CONSUMERS * max(self.block_q, self.block_kv) * 4  # edge tiles' offsets
        ids = segment_ids * self.num_stages * (max(self.block_q, self.block_kv) * 4 + 8)
        has_bias, has_mask = pairwise_bytes >= 2, pairwise_bytes % 2  # a bias: 2 or 4 bytes
        pairwise_ring = lambda per_pair: self.num_stages * (
            CONSUMERS * self.block_q * self.block_kv * per_pair + 8 * (has_bias + has_mask))
        if pairwise_bytes:  # dK/dV reads the bias as float32 (backward_call says why)
            dkdv += pairwise_ring(4 * has_bias + has_mask)
            dq += pairwise_ring(pairwise_bytes) if self.dq != "fused" else 0
        return max(dkdv, dq) + positions + ids + 8 * (6 * self.num_stages + CONSUMERS * 3)


def default_backward_config(head_dim: int, dtype) -> BackwardConfig:
    """64 x 64 tiles and two stages at head_dim 64 and 128."""
    del head_dim, dtype
    return BackwardConfig()
