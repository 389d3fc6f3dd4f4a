"""Pallas Mosaic TPU FlashAttention: the forward kernel (forward.py) and the dK/dV and dQ
kernels (backward.py), which recompute P from the forward's natural-log RowStats.

``forward`` and ``backward`` keep the contract of ``implementations.py`` (RowStats: an empty
row has max = +inf and log_sum = 0). ``unsupported`` names every feature of a call that the
kernels do not take (the automatic choice then runs xla); ``unavailable`` says why the kernels
cannot be offered in this installation.

The non-finite rule (online_softmax: q's rows that hold a non-finite value all NaN, k's rows
their key's poison, v's non-finite entries 0) costs the forward one XLA read of k and v (a
flag, ``forward.all_finite``) and a pass over each q tile in VMEM; only when the flag says K or
V holds a non-finite value do their tiles take it, in VMEM.

Mods that read only the indices are traced into the kernels; a mod with mod_aux is refused
(``unsupported``), so the automatic choice runs it on xla and says so.
"""
from __future__ import annotations

import jax.numpy as jnp

from jax_impl import block_mask, masking, online_softmax
from jax_impl.call_features import CallFeatures
from jax_impl.config import AttentionConfig, BlockSizes
from jax_impl.dropout_sinks import SinksAndDropout
from jax_impl.mosaic_tpu import common

__all__ = ["forward", "backward", "unsupported", "unavailable", "block_shape", "DTYPES"]

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# Imported here, before the functions of the same names are defined below (importing a
# submodule later would rebind the package's attribute to the module).
try:
    from jax_impl.mosaic_tpu import backward as _backward_kernels, forward as _forward_kernel
    _UNAVAILABLE = None
except Exception as e:  # ImportError, or an API that moved
    _UNAVAILABLE = f"jax.experimental.pallas.tpu cannot be used here: {type(e).__name__}: {e}"


def unavailable() -> str | None:
    """Why the kernels cannot be offered in this installation, or None."""
    return _UNAVAILABLE


def unsupported(features: CallFeatures) -> str | None:
    """Why the Mosaic TPU forward cannot run such a call, or None; every feature it does not
    take is named. It takes causal (both alignments), windows, lengths, segment ids, GQA/MQA,
    the soft cap, block_mask (on tiles inside its own), mask_mod and score_mod (refused with
    mod_aux), sinks, position offsets, a dense mask, a bias and dropout (the shared hash: the
    same pattern as every implementation's), any head_dim (a full block)."""
    cfg, dtype, block_mask_tiles = features.cfg, features.dtype, features.block_mask_tiles
    mod_aux = features.mod_aux
    if _UNAVAILABLE:
        return _UNAVAILABLE
    if dtype is not None and jnp.dtype(dtype) not in DTYPES:
        return f"dtype {jnp.dtype(dtype)} is not bfloat16 or float32"
    given = isinstance(cfg.block_sizes, BlockSizes)
    if block_mask_tiles is not None and any(
            tile % (block if given else common.NUM_LANES)
            for block, tile in zip(_tiles_wanted(cfg), block_mask_tiles * 3)):
        return (f"a block_mask of {block_mask_tiles[0]}x{block_mask_tiles[1]} tiles: the kernels "
                "read a block_mask on tiles inside its own (multiples of 128 that divide them, "
                "those of block_sizes where given), and cannot evaluate it pair by pair")
    reason = common.precision_unsupported(cfg, dtype)
    if reason:
        return reason
    if cfg.has_mods and mod_aux:
        return (f"score_mod or mask_mod with mod_aux ({len(mod_aux)} arrays): the Mosaic TPU "
                "kernels trace mods on tile indices only, and gather from no mod_aux array")
    if cfg.block_sizes is not None:
        if not isinstance(cfg.block_sizes, BlockSizes):
            return (f"block_sizes is a {type(cfg.block_sizes).__name__}; the Mosaic TPU kernel "
                    "takes jax_impl.BlockSizes (its block_q and block_k)")
        for name in ("block_q", "block_k"):
            value = getattr(cfg.block_sizes, name)
            if value % common.NUM_LANES:
                return (f"BlockSizes.{name}={value} is not a multiple of {common.NUM_LANES} "
                        "(the TPU's lanes)")
    reason = _backward_kernels.blocks_unsupported(cfg)
    if reason:
        return reason
    if block_mask_tiles is not None and (features.lq is None or block_mask.needs_pair_rule(
            cfg, block_mask_tiles, (features.lq, features.lk),
            _grids(cfg, features.lq, features.lk, block_mask_tiles),
            has_segment_ids=features.has_segment_ids)):
        return ("a block_mask with a mask_mod it was not made from (create_block_mask), where "
                "another rule (a band, lengths, segment ids, a ragged last tile) makes a tile "
                "inside its FULL tiles partial: its meaning there is pair by pair "
                "(block_mask.PairRule), which the kernels cannot evaluate")
    return None


def _tiles_wanted(cfg: AttentionConfig | None) -> tuple[int, ...]:
    """The (block_q, block_k) of the forward, dK/dV and dQ kernels before any clipping."""
    sizes = cfg.block_sizes if cfg is not None and isinstance(cfg.block_sizes, BlockSizes) else None
    if sizes is None:
        return (_forward_kernel.DEFAULT_BLOCK,) * 2 + (_backward_kernels.DEFAULT_BLOCK,) * 4
    return (sizes.block_q, sizes.block_k, sizes.block_q_dkv, sizes.block_k_dkv, sizes.block_q_dq,
            sizes.block_k_dq)


def _grids(cfg: AttentionConfig, lq: int, lk: int, mask_tiles) -> tuple:
    """The (rows, keys) tiles of the forward, dK/dV and dQ kernels for these lengths."""
    found = [_forward_kernel.block_shape(cfg, lq, lk, mask_tiles)]
    backward = _backward_kernels.blocks(cfg, lq, lk, mask_tiles)
    if backward is not None:
        found += [(backward.q_dkv, backward.k_dkv), (backward.q_dq, backward.k_dq)]
    return tuple(grid for grid in found if grid is not None)


def _no_tiles_inside(cfg: AttentionConfig, masks) -> str:
    return (unsupported(CallFeatures(cfg, 0, block_mask_tiles=common.mask_tiles(masks)))
            or "its block_sizes, clipped to these sequences, do not divide the block_mask's tiles")


def block_shape(cfg: AttentionConfig, lq: int, lk: int, masks=None) -> tuple[int, int]:
    """The forward's (block_q, block_k) for sequences of Lq and Lk (and the call's mask inputs:
    a block_mask's tiles)."""
    shape = _forward_kernel.block_shape(cfg, lq, lk, None if masks is None else common.mask_tiles(masks))
    if shape is None:
        raise ValueError("implementation='mosaic_tpu' cannot run this call: "
                         + _no_tiles_inside(cfg, masks))
    return shape


def forward(cfg: AttentionConfig, q, k, v, bias, masks: masking.MaskInputs, extras=None):
    """q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D] -> (out [B, Lq, Hq, D], RowStats [B, Hq, Lq] f32)."""
    from jax.experimental.pallas import tpu as pltpu

    extras = extras or SinksAndDropout()
    reason = unsupported(CallFeatures.of(cfg, q, k, bias, masks, extras))
    if reason:
        raise ValueError(f"implementation='mosaic_tpu' cannot run this call: {reason}")
    block_shape(cfg, q.shape[1], k.shape[1], masks)  # raises where no tiles fit a block_mask
    if bias is not None and jnp.dtype(bias.dtype).itemsize > 4:
        bias = bias.astype(jnp.float32)  # the logits are float32 (the reference's cast too)
    out, row_max, log_sum = _forward_kernel.forward_call(
        cfg, q, k, v, masks, bias, extras.sinks, extras.dropout_seeds,
        finite=_forward_kernel.all_finite(k, v),
        interpret=pltpu.InterpretParams() if cfg.interpret else None)
    return out, online_softmax.RowStats(row_max, log_sum)


def backward(cfg: AttentionConfig, q, k, v, bias, masks, stats, d_out, delta, extras=None):
    """-> (dq, dk, dv, dbias or None, d_mod_aux): the kernels (backward.py)."""
    if _backward_kernels.blocks(cfg, q.shape[1], k.shape[1], common.mask_tiles(masks)) is None:
        raise ValueError("implementation='mosaic_tpu' backward cannot run this call: "
                         + _no_tiles_inside(cfg, masks))
    return _backward_kernels.backward(cfg, q, k, v, bias, masks, stats, d_out, delta, extras)
