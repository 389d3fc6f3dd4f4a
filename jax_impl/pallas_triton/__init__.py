"""Pallas GPU (Triton) FlashAttention: forward and backward kernels behind one pair of calls."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_impl import masking, online_softmax, vma
from jax_impl.config import AttentionConfig
from jax_impl.dropout_sinks import SinksAndDropout
from jax_impl.pallas_triton import common
from jax_impl.pallas_triton.backward import backward_call
from jax_impl.pallas_triton.forward import forward_call
from jax_impl.pallas_triton.layout import Layout


def _padded_operands(cfg, layout: Layout, q, k, v, bias, masks: masking.MaskInputs):
    """Operands padded to whole tiles, and the config whose mask excludes the padding.

    Inside shard_map every operand is made to vary over the same manual axes (common.out_struct)."""
    q, k, v, bias, masks = vma.like((q, k, v, bias, masks), vma.axes_of(q, k, v, bias, masks))
    lq_pad, lk_pad = layout.lq_pad, layout.lk_pad
    cfg = dataclasses.replace(cfg, mask=masking.with_padding(
        cfg.mask, queries_padded=lq_pad != layout.lq, keys_padded=lk_pad != layout.lk))
    q = layout.pad(q, 1, lq_pad, 3)
    if not cfg.interpret:
        q = common.requires_cuda(q)
    k, v = layout.pad(k, 1, lk_pad, 3), layout.pad(v, 1, lk_pad, 3)
    padded_masks = masks._replace(
        q_segment_ids=layout.pad(masks.q_segment_ids, 1, lq_pad),
        kv_segment_ids=layout.pad(masks.kv_segment_ids, 1, lk_pad),
        mask=None)
    pair = lambda x: None if x is None else layout.pad(layout.pad(x, 2, lq_pad), 3, lk_pad)
    mask = None if masks.mask is None else pair(masks.mask.astype(jnp.int8))
    return cfg, q, k, v, padded_masks, mask, pair(bias)


def forward(cfg: AttentionConfig, q, k, v, bias, masks: masking.MaskInputs, extras=None):
    """q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D] -> (out [B, Lq, Hq, D], RowStats [B, Hq, Lq] f32)."""
    lq, d = q.shape[1], q.shape[3]
    layout = Layout.create(lq, k.shape[1], d, q.dtype, cfg.block_sizes, cfg.mask.is_causal)
    cfg, qp, kp, vp, padded_masks, mask, bias = _padded_operands(cfg, layout, q, k, v, bias, masks)
    extras = extras or SinksAndDropout()
    out, row_max, log_sum = forward_call(cfg, layout, qp, kp, vp, padded_masks, mask, bias,
                                         extras.sinks, extras.dropout_seeds)
    return out[:, :lq, :, :d], online_softmax.RowStats(row_max[:, :, :lq], log_sum[:, :, :lq])


def backward(cfg: AttentionConfig, q, k, v, bias, masks, stats, d_out, delta, extras=None):
    """-> (dq, dk, dv, dbias [B, Hq, Lq, Lk] f32 or None)."""
    lq, d, lk = q.shape[1], q.shape[3], k.shape[1]
    layout = Layout.create(lq, lk, d, q.dtype, cfg.block_sizes, cfg.mask.is_causal)
    cfg, qp, kp, vp, padded_masks, mask, bias = _padded_operands(cfg, layout, q, k, v, bias, masks)
    pad_rows = lambda x: layout.pad(x, 2, layout.lq_pad)
    axes = vma.axes_of(qp, d_out, stats, delta)
    qp, kp, vp, padded_masks, mask, bias, d_out, stats, delta = vma.like(
        (qp, kp, vp, padded_masks, mask, bias, d_out, stats, delta), axes)
    d_out = layout.pad(d_out, 1, layout.lq_pad, 3)
    dq, dk, dv, dbias = backward_call(cfg, layout, qp, kp, vp, d_out,
                                      online_softmax.RowStats(*map(pad_rows, stats)),
                                      pad_rows(delta), padded_masks, mask, bias,
                                      (extras or SinksAndDropout()).dropout_seeds)
    if dbias is not None:
        dbias = dbias[:, :, :lq, :lk]
    return dq[:, :lq, :, :d], dk[:, :lk, :, :d], dv[:, :lk, :, :d], dbias
