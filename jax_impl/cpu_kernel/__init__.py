"""The fused CPU kernels (``flash_cpu.cc``, XLA FFI custom calls): the default on a CPU.

``forward``/``backward`` keep the contract of ``implementations.py``. They cover the calls
most models make: any float dtype (computed in float32), causal or not, either alignment, local
windows, sequence lengths, segment ids, GQA/MQA, head_dim a multiple of 16. ``unsupported``
names what they do not take (a bias, a dense mask, a soft cap, dropout, sinks); such calls run
on the xla path.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_impl import masking, online_softmax, vma
from jax_impl.config import AttentionConfig
from jax_impl.cpu_kernel.build import unavailable
from jax_impl.xla import host_threads

__all__ = ["forward", "backward", "unsupported", "unavailable"]

HEAD_DIM_MULTIPLE = 16  # the kernels' products run in rows of SIMD vectors of up to 16 floats
# Tiles (query rows, keys) of the forward and backward, measured on the 2-core AVX-512 machine
# (benchmarks/README.md, "CPU: the fused kernel").
FORWARD_BLOCKS = (96, 128)   # block_k: a multiple of 64 (the K^T panels)
BACKWARD_BLOCKS = (64, 128)
PANEL = 64  # flash_cpu.cc's PW: K^T is read in panels of 64 keys
_UNBOUNDED = 1 << 30  # a band side with no bound (positions stay below 2**30)


def unsupported(*, head_dim: int, cfg: AttentionConfig | None = None, has_bias: bool = False,
                has_mask: bool = False, has_sinks: bool = False) -> str | None:
    """Why the CPU kernel cannot run such a call (it then runs on the xla path), or None.
    Without ``cfg`` only head_dim and the build are judged."""
    if head_dim % HEAD_DIM_MULTIPLE:
        return f"head_dim={head_dim} is not a multiple of {HEAD_DIM_MULTIPLE}"
    features = [] if cfg is None else [name for name, present in (
        ("a bias", has_bias), ("a dense mask", has_mask), ("logits_soft_cap", cfg.logits_soft_cap),
        ("dropout", cfg.dropout_rate), ("attention_sinks", has_sinks)) if present]
    if features:
        return f"the CPU kernel does not take {', '.join(features)}"
    if cfg is not None and cfg.block_sizes is not None and cfg.block_sizes.block_k % PANEL:
        return (f"block_sizes.block_k={cfg.block_sizes.block_k} is not a multiple of {PANEL} "
                "(the kernel reads keys in panels of 64)")
    return unavailable()


def _band(cfg: AttentionConfig, masks: masking.MaskInputs):
    """(d_lo, d_hi) ``[B]`` int32 of masking.diagonal_band, unbounded sides as +-2**30."""
    clip = lambda w: None if w is None else min(w, _UNBOUNDED)
    spec = dataclasses.replace(cfg.mask, window_left=clip(cfg.mask.window_left),
                               window_right=clip(cfg.mask.window_right))
    d_lo, d_hi = masking.diagonal_band(spec, masks.q_len, masks.kv_len, masks.position_offset)
    bound = lambda x, default: jnp.broadcast_to(  # a side may be a Python int (no lengths in it)
        jnp.clip(default if x is None else x, -_UNBOUNDED, _UNBOUNDED).astype(jnp.int32),
        masks.q_len.shape)
    return bound(d_lo, -_UNBOUNDED), bound(d_hi, _UNBOUNDED)


def _mask_operands(cfg, masks):
    segments = masks.q_segment_ids is not None
    none = jnp.zeros((1, 1), jnp.int32)
    return ((masks.q_len, masks.kv_len, *_band(cfg, masks),
             masks.q_segment_ids if segments else none, masks.kv_segment_ids if segments else none),
            np.int64(segments))


def _registered():
    reason = unavailable()  # builds and registers the handlers on first use
    if reason:
        raise RuntimeError(f"the CPU kernel cannot run: {reason}")


def _blocks(cfg: AttentionConfig, default):
    if cfg.block_sizes is not None:
        return cfg.block_sizes.block_q, cfg.block_sizes.block_k
    return default


def _key_panels(k):
    """k ``[B, Lk, Hkv, D]`` -> K^T panels ``[B, Hkv, Lk_pad / 64, D, 64]`` float32 (the
    forward's right operand of q.k, each key tile a contiguous block), zero past Lk."""
    b, lk, hkv, d = k.shape
    k = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, -lk % PANEL), (0, 0), (0, 0)))
    return jnp.transpose(k.reshape(b, -1, PANEL, hkv, d), (0, 3, 1, 4, 2))


def _varying_like_operands(results, *operands):
    """Inside jax.shard_map (check_vma) a custom call's results are typed unvarying; they vary
    over the manual axes as the operands do (ring attention's lax.cond needs both branches alike)."""
    return vma.like(results, vma.axes_of(*operands))


def _head_major(x):  # [B, L, H, D] -> [B, H, L, D] float32
    return jnp.swapaxes(x.astype(jnp.float32), 1, 2)


def forward(cfg: AttentionConfig, q, k, v, bias, masks: masking.MaskInputs, extras=None):
    """-> (out ``[B, Lq, Hq, D]`` in q's dtype, RowStats ``[B, Hq, Lq]`` float32)."""
    _registered()
    b, lq, hq, _ = q.shape
    mask_args, segments = _mask_operands(cfg, masks)
    block_q, block_k = _blocks(cfg, FORWARD_BLOCKS)
    stats = jax.ShapeDtypeStruct((b, hq, lq), jnp.float32)
    out, row_max, log_sum = _varying_like_operands(jax.ffi.ffi_call(
        "jax_flash_attention_cpu_forward",
        (jax.ShapeDtypeStruct(q.shape, jnp.float32), stats, stats), vmap_method="sequential",
    )(q.astype(jnp.float32), _key_panels(k), _head_major(v), *mask_args,
      scale=np.float32(cfg.scale), block_q=np.int64(block_q), block_k=np.int64(block_k),
      has_segments=segments), q, k, v, masks)
    return out.astype(q.dtype), online_softmax.RowStats(row_max, log_sum)


def backward(cfg: AttentionConfig, q, k, v, bias, masks: masking.MaskInputs, stats, d_out, delta,
             extras=None):
    """-> (dq, dk, dv in the inputs' dtypes, None): FlashAttention-2's backward, one item per
    (batch row, kv head, key chunk); with fewer (batch row, kv head) pairs than threads the key
    tiles are dealt to chunks, each with its own float32 dq summed here."""
    _registered()
    b, lq, hq, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    mask_args, segments = _mask_operands(cfg, masks)
    block_q, block_k = _blocks(cfg, BACKWARD_BLOCKS)
    chunks = max(1, min(-(-host_threads() // (b * hkv)), -(-lk // block_k)))
    kv_shape = jax.ShapeDtypeStruct((b, hkv, lk, d), jnp.float32)
    dq_parts, dk, dv = _varying_like_operands(jax.ffi.ffi_call(
        "jax_flash_attention_cpu_backward",
        (jax.ShapeDtypeStruct((chunks, b, hq, lq, d), jnp.float32), kv_shape, kv_shape),
        vmap_method="sequential",
    )(*map(_head_major, (q, k, v)), *mask_args, _head_major(d_out), stats.max, stats.log_sum, delta,
      scale=np.float32(cfg.scale), block_q=np.int64(block_q), block_k=np.int64(block_k),
      has_segments=segments, chunks=np.int64(chunks)), q, k, v, masks, stats, d_out, delta)
    dq = jnp.swapaxes(jnp.sum(dq_parts, axis=0), 1, 2) * cfg.scale
    return dq.astype(q.dtype), *(jnp.swapaxes(x, 1, 2).astype(y.dtype) for x, y in ((dk, k), (dv, v))), None
