"""Pallas GPU (Triton) FlashAttention: forward and backward kernels behind one pair of calls."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_impl import block_mask, kernel_tiles, masking, online_softmax, platform, vma
from jax_impl.call_features import CallFeatures
from jax_impl.config import AttentionConfig
from jax_impl.dropout_sinks import SinksAndDropout
from jax_impl.pallas_triton import common
from jax_impl.pallas_triton.backward import backward_call
from jax_impl.pallas_triton.decoding import (  # noqa: F401 (Implementation.decode*)
    decode, decode_unsupported, pages_unsupported)
from jax_impl.pallas_triton.forward import forward_call
from jax_impl.pallas_triton.layout import Layout


def _kernel_operands(cfg, layout: Layout, q, k, v, bias, masks: masking.MaskInputs, mod_aux=()):
    """The config whose mask excludes the positions that the last tiles reach past (layout.py),
    the dense mask as int8, and (inside shard_map) every operand made to vary over the same
    manual axes (vma.out_struct)."""
    q, k, v, bias, masks, mod_aux = vma.like((q, k, v, bias, masks, mod_aux),
                                             vma.axes_of(q, k, v, bias, masks, mod_aux))
    cfg = dataclasses.replace(cfg, mask=masking.with_padding(
        cfg.mask, queries_padded=layout.lq_tiled != layout.lq, keys_padded=layout.lk_tiled != layout.lk))
    if not cfg.interpret:
        q = platform.requires_cuda(q, common.PLATFORM_ERROR)
    mask = None if masks.mask is None else masks.mask.astype(jnp.int8)
    return cfg, q, k, v, masks._replace(mask=None), mask, bias, mod_aux


def _dropout_offset(extras: SinksAndDropout, q):
    """The ring's [2] int32 dropout offset (varying over q's manual axes), or None."""
    if extras.dropout_offset is None or extras.dropout_seeds is None:
        return None
    return vma.like(jnp.asarray(extras.dropout_offset, jnp.int32), vma.axes_of(q))


def unsupported(features: CallFeatures) -> str | None:
    """Why the Triton kernels cannot run such a call, or None: mods that read mod_aux other than
    by indexing (kernel_tiles.ModAux); head_dim is judged by the table's max_head_dim."""
    return kernel_tiles.mods_unsupported(features.cfg, features.mod_aux)


def forward_blocks(cfg: AttentionConfig, q, k) -> tuple[int, int]:
    """(block_q, block_k) of the forward kernel for q [B, Lq, Hq, D] and k (arrays or
    ShapeDtypeStructs)."""
    blocks = Layout.create(q.shape[1], k.shape[1], q.shape[3], q.dtype, cfg.block_sizes,
                           cfg.mask.is_causal, cfg.score_mod is not None).blocks
    return blocks.block_q, blocks.block_k


def forward(cfg: AttentionConfig, q, k, v, bias, masks: masking.MaskInputs, extras=None):
    """q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D] -> (out [B, Lq, Hq, D], RowStats [B, Hq, Lq] f32)."""
    layout = Layout.create(q.shape[1], k.shape[1], q.shape[3], q.dtype, cfg.block_sizes,
                           cfg.mask.is_causal, cfg.score_mod is not None)
    extras = extras or SinksAndDropout()
    cfg, extras = block_mask.on_grid(cfg, masks, extras, [(layout.blocks.block_q, layout.blocks.block_k)])
    cfg, q, k, v, masks, mask, bias, mod_aux = _kernel_operands(cfg, layout, q, k, v, bias, masks,
                                                                extras.mod_aux)
    out, row_max, log_sum = forward_call(cfg, layout, q, k, v, masks, mask, bias, extras.sinks,
                                         extras.dropout_seeds, _dropout_offset(extras, q), mod_aux)
    return out, online_softmax.RowStats(row_max, log_sum)


def backward(cfg: AttentionConfig, q, k, v, bias, masks, stats, d_out, delta, extras=None):
    """-> (dq, dk, dv, dbias [B, Hq, Lq, Lk] f32 or None, d_mod_aux): ``d_mod_aux`` all None
    (aligned with ``extras.mod_aux``): summing it in the kernels would need atomics or a buffer
    per program (``implementations`` takes it from the xla backward)."""
    extras = extras or SinksAndDropout()
    d_mod_aux = tuple(None for _ in extras.mod_aux)
    layout = Layout.create(q.shape[1], k.shape[1], q.shape[3], q.dtype, cfg.block_sizes,
                           cfg.mask.is_causal, cfg.score_mod is not None)
    blocks = layout.blocks
    cfg, extras = block_mask.on_grid(cfg, masks, extras, [(blocks.block_q_dkv, blocks.block_k_dkv),
                                                          (blocks.block_q_dq, blocks.block_k_dq)])
    cfg, q, k, v, masks, mask, bias, mod_aux = _kernel_operands(cfg, layout, q, k, v, bias, masks,
                                                                extras.mod_aux)
    axes = vma.axes_of(q, d_out, stats, delta)
    q, k, v, masks, mask, bias, d_out, stats, delta, mod_aux = vma.like(
        (q, k, v, masks, mask, bias, d_out, stats, delta, mod_aux), axes)
    dq, dk, dv, dbias = backward_call(cfg, layout, q, k, v, d_out, stats, delta, masks, mask, bias,
                                      extras.dropout_seeds, _dropout_offset(extras, q), mod_aux)
    return dq, dk, dv, dbias, d_mod_aux

