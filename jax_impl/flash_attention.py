"""Public API: ``flash_attention``, a superset of ``jax.nn.dot_product_attention``.

This file validates arguments, normalises masks to the canonical shapes of
``masking.MaskInputs`` and dispatches; the algorithm lives in ``xla.py`` and
``pallas_triton/``, the mask rules in ``masking.py``.
"""
from __future__ import annotations

import functools
import inspect
import math
import sys
import types
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from jax_impl import dropout_sinks, implementations, masking, partitioned, recompute_vjp, reference
from jax_impl.config import AttentionConfig, BlockSizes
from jax_impl.implementations import IMPLEMENTATIONS
from jax_impl.pallas_triton import common

SUPPORTED_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)

# ``precision=`` may also be one of these jax.lax.DotAlgorithmPresets (float32 inputs only): each
# accumulates in float32 and lowers in Pallas Triton (TF32_TF32_F32_X3 as its tf32x3 dot) and
# in XLA on a CUDA GPU.
PRECISION_PRESETS = tuple(getattr(lax.DotAlgorithmPreset, name) for name in (
    "F32_F32_F32", "TF32_TF32_F32", "TF32_TF32_F32_X3", "BF16_BF16_F32", "BF16_BF16_F32_X3",
    "BF16_BF16_F32_X6", "BF16_BF16_F32_X9"))
# Those XLA:CPU refuses (jax 0.10; it runs the other presets at full float32, ignoring them).
GPU_ONLY_PRESETS = tuple(getattr(lax.DotAlgorithmPreset, name) for name in (
    "TF32_TF32_F32", "TF32_TF32_F32_X3", "BF16_BF16_F32_X9"))
GPU_ONLY_PRECISION_ERROR = (
    "precision={precision} runs only on a CUDA GPU (the call is being lowered for {{platform!r}}): "
    "XLA:CPU has no such dot, and the Pallas interpreter runs its dots through XLA. "
    "On a CPU use lax.Precision.HIGHEST (the default) or one of "
    + ", ".join(p.name for p in PRECISION_PRESETS if p not in GPU_ONLY_PRESETS)
    + " (XLA:CPU computes them in full float32).")


def flash_attention(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, bias: ArrayLike | None = None,
    mask: ArrayLike | None = None, *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size: int | tuple[int | None, int | None] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
    causal_alignment: str = "top_left",
    q_segment_ids=None,
    kv_segment_ids=None,
    logits_soft_cap: float | None = None,
    block_sizes: BlockSizes | None = None,
    precision=None,
    interpret: bool = False,
    attention_sinks=None,
    # Keywords that Flax's attention modules pass to an `attention_fn`:
    dropout_rng=None,
    dropout_rate: float = 0.0,
    broadcast_dropout: bool = True,
    deterministic: bool | None = None,
    dtype=None,
    module=None,
    force_fp32_for_softmax: bool = False,
    qk_attn_weights_einsum=None,
    attn_weights_value_einsum=None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Exact softmax attention, computed tile by tile (FlashAttention), forward and backward.

    Shapes (``...`` = any number of batch dims, possibly none):
      query ``[..., Lq, Hq, D]``, key and value ``[..., Lk, Hkv, D]`` with ``Hq % Hkv == 0``
      (GQA/MQA: query head h reads kv head ``h // (Hq // Hkv)``); returns ``[..., Lq, Hq, D]``
      in the input dtype, and with ``return_residual=True`` also the logsumexp ``[..., Lq, Hq]``
      (float32, natural log, ``-inf`` for a row with no allowed key), as jax.nn does.

    Arguments shared with ``jax.nn.dot_product_attention`` mean the same:
      bias: float, broadcastable to ``[..., Hq, Lq, Lk]``, added to the logits; differentiable.
      mask: bool, broadcastable to ``[..., Hq, Lq, Lk]``; True = may attend.
      scale: multiplies q.k; default ``1/sqrt(D)``.
      is_causal: key j allowed for query i when ``j <= i`` (top-left, as jax.nn and torch SDPA).
      query_seq_lengths / key_value_seq_lengths: int ``[...]``; queries/keys at or past the length
        take no part (their output rows are 0).
      local_window_size: ``w`` or ``(left, right)`` (None = unbounded side): key j allowed when
        ``i - left <= j <= i + right``, measured from the same diagonal as causal.
      implementation: "pallas_triton" (the GPU kernel), "cpu" (the fused C++ CPU kernel; no
        bias, dense mask, soft cap, dropout or sinks, head_dim a multiple of 16), "xla" (the same
        blocked algorithm in plain JAX, linear memory, any device), "reference" (dense; for
        checking), or None: pallas_triton on a CUDA GPU and cpu on a CPU where eligible, xla
        elsewhere; ``explain_implementation`` says why.

    Additions:
      causal_alignment: "top_left" or "bottom_right" (the last valid query aligns with the last
        valid key, as FlashAttention-2 and KV-cache decoding; with lengths, per batch row).
      q_segment_ids / kv_segment_ids: int ``[..., Lq]`` / ``[..., Lk]``; only equal ids attend
        (packed sequences).
      logits_soft_cap: c > 0: logits become ``c * tanh(logits / c)`` before the bias is added.
      block_sizes: tile sizes (``BlockSizes``); None: per-device heuristics.
      precision: of float32 matmuls: a ``lax.Precision`` or its name in any case ("highest",
        jnp.dot's aliases; default HIGHEST: full fp32, never silent TF32) or, for float32
        inputs, one of ``PRECISION_PRESETS`` (or its name)
        (``lax.DotAlgorithmPreset``: TF32_TF32_F32_X3 is 3xTF32 on the tensor cores; TF32
        presets and BF16_BF16_F32_X9 run only on a CUDA GPU).
      interpret: run the Pallas kernel in the Pallas interpreter (any device; slow; for tests).
      attention_sinks: float, broadcastable to ``[..., Hq]``: one learnable logit per head that
        joins every row's softmax denominator and carries no value (gpt-oss); differentiable.
        It enters the logsumexp; a row with no allowed key gives output 0.
      dropout_rate / dropout_rng / broadcast_dropout / deterministic: attention dropout as Flax
        means it: active when ``dropout_rate > 0`` and not ``deterministic`` (None: as Flax's
        ``dot_product_attention``, not deterministic); P is dropped with a pattern hashed from
        the key and (batch, head, query, key) indices, shared across batch and heads when
        ``broadcast_dropout``, and kept values are scaled by ``1 / (1 - dropout_rate)``.
        ``jax_impl.dropout_mask`` materialises the pattern.

    A query row with no allowed key gives output 0, logsumexp -inf and zero gradients.
    Flax keywords (``dropout_*``, ``deterministic``, ``dtype``, ``module``, ...) are honoured or
    refused with an error, so the function is usable as ``attention_fn`` directly.
    """
    call = _validate(**locals())
    out, lse = _dispatch(call)
    out = out.reshape(call.batch_shape + out.shape[1:])
    if not return_residual:
        return out
    return out, jnp.swapaxes(lse, 1, 2).reshape(call.batch_shape + out.shape[-3:-1])


class _Call(NamedTuple):
    """A validated call in canonical shapes (one flat batch axis)."""

    implementation: str | None
    cfg: AttentionConfig
    q: Any       # [B, Lq, Hq, D]
    k: Any       # [B, Lk, Hkv, D]
    v: Any       # [B, Lk, Hkv, D]
    bias: Any    # [Bb, Hb, Lq, Lk] or None
    masks: masking.MaskInputs
    batch_shape: tuple
    extras: dropout_sinks.SinksAndDropout = dropout_sinks.SinksAndDropout()


def _validate(query, key, value, bias, mask, *, scale, is_causal, query_seq_lengths,
              key_value_seq_lengths, local_window_size, implementation, return_residual,
              causal_alignment, q_segment_ids, kv_segment_ids, logits_soft_cap, block_sizes,
              precision, interpret, attention_sinks, dropout_rng, dropout_rate, broadcast_dropout,
              deterministic, dtype, module, force_fp32_for_softmax, qk_attn_weights_einsum,
              attn_weights_value_einsum) -> _Call:
    mask = _validate_flax_keywords(dropout_rate, deterministic, module, qk_attn_weights_einsum,
                                   attn_weights_value_einsum, mask)
    del force_fp32_for_softmax  # the softmax is always fp32
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    if dtype is not None:
        query, key, value = (x.astype(dtype) for x in (query, key, value))
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim < 3:
            raise ValueError(f"{name} must have shape [batch..., seq_len, heads, head_dim]; got {x.shape=}")
        oracle = x.dtype == jnp.float64 and implementation == "reference"
        if x.dtype not in SUPPORTED_DTYPES and not oracle:
            raise TypeError(f"{name}.dtype={x.dtype} must be float32, float16 or bfloat16 "
                            "(float64 only with implementation='reference', the test oracle)")
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(f"query, key and value must share a dtype; got {query.dtype=}, "
                        f"{key.dtype=}, {value.dtype=}")
    if key.shape != value.shape:
        raise ValueError(f"key and value must have the same shape; got {key.shape=} {value.shape=}")
    batch_shape = query.shape[:-3]
    if key.shape[:-3] != batch_shape:
        raise ValueError(f"query and key must share batch dims; got {query.shape=} {key.shape=}")
    lq, hq, head_dim = query.shape[-3:]
    lk, hkv, key_head_dim = key.shape[-3:]
    if head_dim != key_head_dim:
        raise ValueError(f"query head_dim={head_dim} must equal key/value head_dim={key_head_dim}")
    if min(lq, lk, hq, hkv, head_dim) < 1:
        raise ValueError(f"sequence lengths, heads and head_dim must be >= 1; got "
                         f"{query.shape=} {key.shape=}")
    if hq % hkv:
        raise ValueError(f"num_q_heads={hq} must be a multiple of num_kv_heads={hkv}")
    b = math.prod(batch_shape)
    full_shape = batch_shape + (hq, lq, lk)

    if causal_alignment not in masking.CAUSAL_ALIGNMENTS:
        raise ValueError(f"{causal_alignment=} must be one of {masking.CAUSAL_ALIGNMENTS}")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"{is_causal=} must be a Python bool (it is static)")
    window_left, window_right = _window(local_window_size)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    spec = masking.MaskSpec(is_causal=bool(is_causal), bottom_right=causal_alignment == "bottom_right",
                            window_left=window_left, window_right=window_right,
                            has_q_lengths=query_seq_lengths is not None,
                            has_kv_lengths=key_value_seq_lengths is not None)
    masks = masking.MaskInputs(
        q_len=_lengths("query_seq_lengths", query_seq_lengths, batch_shape, lq),
        kv_len=_lengths("key_value_seq_lengths", key_value_seq_lengths, batch_shape, lk),
        q_segment_ids=_segment_ids("q_segment_ids", q_segment_ids, batch_shape, lq),
        kv_segment_ids=_segment_ids("kv_segment_ids", kv_segment_ids, batch_shape, lk),
        mask=_pairwise("mask", mask, full_shape, is_mask=True),
    )
    bias = _pairwise("bias", bias, full_shape, is_mask=False)

    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif (not isinstance(scale, (int, float, np.integer, np.floating)) or isinstance(scale, bool)
          or not np.isfinite(scale) or scale <= 0):
        raise ValueError(f"{scale=} must be a positive finite Python float (it is static)")
    if logits_soft_cap is not None and (
            not isinstance(logits_soft_cap, (int, float, np.integer, np.floating))
            or isinstance(logits_soft_cap, bool) or not np.isfinite(logits_soft_cap) or logits_soft_cap <= 0):
        raise ValueError(f"{logits_soft_cap=} must be None or a positive finite Python float "
                         "(it is static: a traced or array value cannot be used)")
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be a jax_impl.BlockSizes; got {type(block_sizes).__name__}")
    if implementation is not None:
        implementations.get(implementation)  # a clear error for an unknown name
    if interpret and implementation not in (None, "pallas_triton"):
        raise ValueError(f"interpret=True runs the Pallas kernel; it does not apply to {implementation=}")
    if implementation == "pallas_triton" or interpret:
        reason = _head_dim_unsupported("pallas_triton", head_dim)
        if reason:
            raise ValueError(f"implementation='pallas_triton' cannot run this call: {reason}")
        implementation = "pallas_triton"
    rate = float(dropout_rate) if dropout_rate and not deterministic else 0.0
    seeds = None
    if rate:
        if dropout_rng is None:
            raise ValueError(f"dropout_rng must be a PRNG key when {dropout_rate=} and "
                             f"{deterministic=} (dropout is active)")
        words = dropout_sinks.key_words(dropout_rng, "dropout_rng")
        seeds = dropout_sinks.head_seeds(words, b, hq, bool(broadcast_dropout))
    extras = dropout_sinks.SinksAndDropout(sinks=_sinks(attention_sinks, batch_shape, hq), dropout_seeds=seeds)
    cfg = AttentionConfig(scale=float(scale), mask=spec,
                          logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
                          block_sizes=block_sizes, interpret=bool(interpret),
                          precision=_precision(precision, query.dtype), dropout_rate=rate)
    if implementation == "cpu":
        reason = implementations.unsupported("cpu", head_dim=head_dim, platform="cpu",
                                             features=_features(cfg, bias, masks, extras))
        if reason:
            raise ValueError(f"implementation='cpu' cannot run this call: {reason}")
    flat = lambda x: x.reshape((b,) + x.shape[len(batch_shape):])
    return _Call(implementation, cfg, flat(query), flat(key), flat(value), bias, masks, batch_shape,
                 extras)


def _validate_flax_keywords(dropout_rate, deterministic, module, qk_einsum, value_einsum, mask):
    """Refuses what cannot run fused; returns ``mask`` read as a Flax module means it.

    Flax's masks are float 0/1, not bool: ``make_attention_mask``, ``make_causal_mask`` and
    ``combine_masks`` (which both modules apply to the KV-cache mask in ``decode``) return
    float32, and Flax's own attention reads any nonzero entry as "may attend". Both Flax
    modules always pass ``deterministic`` (a bool); a direct call leaves it None. So a non-bool
    mask is read Flax's way (``mask != 0``) only when ``deterministic`` is given; in a direct
    call it is still refused (``_pairwise``), so an additive float mask is never misread.
    """
    if (not isinstance(dropout_rate, (int, float, np.integer, np.floating))
            or isinstance(dropout_rate, bool) or not 0.0 <= float(dropout_rate) < 1.0):
        raise ValueError(f"{dropout_rate=} must be a Python float in [0, 1) (it is static)")
    if module is not None:
        raise NotImplementedError(
            "flash_attention never materialises the attention weights, so it cannot sow them "
            "(module was given: sow_weights=True); call the module with sow_weights=False")
    if qk_einsum is not None or value_einsum is not None:
        raise NotImplementedError("custom einsums (qk_attn_weights_einsum, "
                                  "attn_weights_value_einsum) cannot run inside the fused kernel")
    if mask is not None and deterministic is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            mask = mask != 0
    return mask


def _sinks(sinks, batch_shape, hq):
    """attention_sinks broadcastable to [batch..., Hq] -> [Bs, Hs] (Bs in {1, B}, Hs in {1, Hq})."""
    if sinks is None:
        return None
    sinks = jnp.asarray(sinks)
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"attention_sinks must be floating point; got {sinks.dtype}")
    return _per_batch_and_head("attention_sinks", sinks, batch_shape, hq, ())


def _window(local_window_size):
    if local_window_size is None:
        return None, None
    is_int = lambda s: isinstance(s, (int, np.integer)) and not isinstance(s, (bool, np.bool_))
    sides = (local_window_size, local_window_size) if is_int(local_window_size) else local_window_size
    if (not isinstance(sides, (tuple, list)) or len(sides) != 2
            or any(s is not None and (not is_int(s) or s < 0) for s in sides)):
        raise ValueError(f"{local_window_size=} must be an int >= 0 or a pair (left, right) of "
                         "ints >= 0 or None (it is static)")
    return tuple(None if s is None else int(s) for s in sides)


def _lengths(name, lengths, batch_shape, seq_len):
    """[B] int32 lengths, clamped to [0, seq_len]: concrete values outside are refused; traced
    ones (under jit) cannot be checked, and past the sequence they mean the whole sequence."""
    b = math.prod(batch_shape)
    if lengths is None:
        return jnp.full((b,), seq_len, jnp.int32)
    values = _concrete(lengths)  # before any cast: int64 values must not wrap
    lengths = jnp.asarray(lengths) if values is None else values
    if not np.issubdtype(lengths.dtype, np.integer):
        raise TypeError(f"{name} must be integers; got {lengths.dtype}")
    if lengths.shape != batch_shape:
        raise ValueError(f"{name}.shape={lengths.shape} must equal the batch shape {batch_shape}")
    if values is not None:
        if values.size and (values.min() < 0 or values.max() > seq_len):
            raise ValueError(f"{name} must lie in [0, {seq_len}]; got values in "
                             f"[{values.min()}, {values.max()}]")
        return jnp.asarray(values.reshape(b), jnp.int32)
    # Clamped before the int32 cast, which could wrap a traced int64 length.
    return jnp.clip(lengths, 0, seq_len).reshape(b).astype(jnp.int32)


def _concrete(x):
    """x as numpy when its values are known at trace time, else None (traced under jit)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _segment_ids(name, ids, batch_shape, seq_len):
    if ids is None:
        return None
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{name} must be integers; got {ids.dtype}")
    if ids.shape != batch_shape + (seq_len,):
        raise ValueError(f"{name}.shape={ids.shape} must be {batch_shape + (seq_len,)} "
                         "(batch dims, then sequence)")
    return ids.reshape(-1, seq_len).astype(jnp.int32)


def _pairwise(name, x, full_shape, *, is_mask):
    """A mask/bias broadcastable to [..., Hq, Lq, Lk] -> [Bx, Hx, Lq, Lk] (_per_batch_and_head)."""
    if x is None:
        return None
    x = jnp.asarray(x)
    if is_mask and x.dtype != jnp.bool_:
        raise TypeError(f"mask.dtype={x.dtype} must be bool (True = may attend); pass an additive "
                        "float mask as bias")
    if not is_mask and not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"bias.dtype={x.dtype} must be floating (it is added to the logits)")
    return _per_batch_and_head(name, x, full_shape[:-3], full_shape[-3], full_shape[-2:])


def _per_batch_and_head(name, x, batch_shape, hq, seq_shape):
    """x broadcastable to ``[batch..., Hq, *seq_shape]`` -> ``[Bx, Hx, *seq_shape]``, Bx in
    {1, B}, Hx in {1, Hq}: batch and head axes stay broadcast when they were, the sequence axes
    are materialised (the kernels read [Lq, Lk] tiles)."""
    full = batch_shape + (hq,) + seq_shape
    try:
        if x.ndim > len(full) or np.broadcast_shapes(x.shape, full) != full:
            raise ValueError
    except ValueError:
        axes = ", ".join(("Hq", "Lq", "Lk")[:1 + len(seq_shape)])
        raise ValueError(f"{name}.shape={x.shape} must broadcast to [batch..., {axes}] = "
                         f"{full}") from None
    x = x.reshape((1,) * (len(full) - x.ndim) + x.shape)
    batch_ndim = len(batch_shape)
    batch = (1,) * batch_ndim if all(n == 1 for n in x.shape[:batch_ndim]) else batch_shape
    x = jnp.broadcast_to(x, batch + (x.shape[batch_ndim],) + seq_shape)
    return x.reshape((-1,) + x.shape[batch_ndim:])


# Spelled out: lax.Precision(name) accepts only some spellings, and which varies across jax
# versions (0.10 takes 'highest' but not 'HIGHEST'). The aliases are jax's own (jnp.dot's).
_PRECISION_ALIASES = {"fastest": lax.Precision.DEFAULT, "bfloat16": lax.Precision.DEFAULT,
                      "bfloat16_3x": lax.Precision.HIGH, "tensorfloat32": lax.Precision.HIGH,
                      "float32": lax.Precision.HIGHEST}
_PRECISION_NAMES = {**{p.name.lower(): p for p in lax.Precision}, **_PRECISION_ALIASES}


def _precision(precision, dtype):
    presets = ", ".join(p.name for p in PRECISION_PRESETS)
    if precision is None:
        return lax.Precision.HIGHEST
    if isinstance(precision, (tuple, list)):
        pair = {_precision(p, dtype) for p in precision}
        if len(precision) != 2 or len(pair) != 1:
            raise ValueError(f"{precision=}: only a pair of equal precisions is supported")
        return pair.pop()
    if isinstance(precision, lax.DotAlgorithmPreset):
        if precision not in PRECISION_PRESETS:
            raise ValueError(f"precision={precision} is not supported: a jax.lax.DotAlgorithmPreset "
                             f"must accumulate in float32 and be one of {presets}")
        if dtype != jnp.float32:
            raise ValueError(f"precision={precision} applies to float32 inputs only; {dtype} inputs "
                             "always multiply natively with float32 accumulation: pass precision=None")
        return precision
    if isinstance(precision, str):
        if precision.lower() in _PRECISION_NAMES:
            return _PRECISION_NAMES[precision.lower()]
        try:  # a preset's name, as jnp.dot takes it
            return _precision(lax.DotAlgorithmPreset[precision.upper()], dtype)
        except KeyError:
            raise ValueError(f"{precision=} must be a jax.lax.Precision, one of 'default', 'high', "
                             f"'highest' (any case, or jax's aliases {', '.join(_PRECISION_ALIASES)}), "
                             f"or (float32 inputs) a jax.lax.DotAlgorithmPreset or its name among "
                             f"{presets}") from None
    if not isinstance(precision, lax.Precision):
        raise TypeError(f"{precision=} must be None, a jax.lax.Precision or its name, or a "
                        f"jax.lax.DotAlgorithmPreset among {presets}")
    return precision


def gpu_only_precision_guard(implementation, cfg, q):
    """q, marked so that lowering for a non-CUDA platform raises GPU_ONLY_PRECISION_ERROR when
    the precision is a GPU-only preset and the dots go through XLA (xla, reference, the Pallas
    interpreter); the compiled Pallas kernel has its own CUDA guard."""
    if cfg.precision not in GPU_ONLY_PRESETS or (implementation == "pallas_triton" and not cfg.interpret):
        return q
    return common.requires_cuda(q, GPU_ONLY_PRECISION_ERROR.format(precision=cfg.precision.name))


# --- Dispatch ------------------------------------------------------------------------------

def _head_dim_unsupported(name: str, head_dim: int) -> str | None:
    """What rules ``name`` out for this head_dim on a CUDA GPU (the platform is decided later)."""
    return implementations.unsupported(name, head_dim=head_dim, platform="cuda")


def _dispatch(call: _Call):
    if call.q.shape[0] == 0:  # an empty batch: an empty result, as jax.nn gives
        return (jnp.zeros(call.q.shape, call.q.dtype),
                jnp.full((0, call.q.shape[2], call.q.shape[1]), -jnp.inf, jnp.float32))
    return _attention(call.q, call.k, call.v, call.bias, call.masks, call.extras,
                      implementation=call.implementation, cfg=call.cfg)


# Jitted so that an eager call compiles once per shape and configuration, not on every call.
@functools.partial(jax.jit, static_argnames=("implementation", "cfg"))
def _attention(q, k, v, bias, masks, extras, *, implementation, cfg):
    run = lambda impl: lambda *args: _run(impl, cfg, *args)
    if implementation is not None:
        return run(implementation)(q, k, v, bias, masks, extras)
    features = _features(cfg, bias, masks, extras)
    # Decided where the call is lowered, so that jax.export for "cuda" works on a CPU host.
    per_platform = {platform: run(name) for platform, name in (("cuda", "pallas_triton"), ("cpu", "cpu"))
                    if implementations.unsupported(name, head_dim=q.shape[-1], platform=platform,
                                                   features=features) is None}
    if not per_platform:
        return run("xla")(q, k, v, bias, masks, extras)
    return lax.platform_dependent(q, k, v, bias, masks, extras, **per_platform, default=run("xla"))


def _features(cfg, bias, masks, extras) -> implementations.CallFeatures:
    return implementations.CallFeatures(cfg, has_bias=bias is not None, has_mask=masks.mask is not None,
                                        has_sinks=extras.sinks is not None)


def _run(implementation, cfg, q, k, v, bias, masks, extras):
    q = gpu_only_precision_guard(implementation, cfg, q)
    if implementation == "reference":
        return reference.attention(q, k, v, bias, masks, cfg,
                                   logits_dtype=jnp.promote_types(q.dtype, jnp.float32),
                                   extras=extras)
    return recompute_vjp.attention(implementation, cfg, q, k, v, bias, masks, extras)


class ImplementationChoice(NamedTuple):
    chosen: str
    reasons: dict  # implementation -> None if eligible, else why not
    # How sharded inputs run (partitioned.explain): local / ring / gathered; None unsharded.
    strategy: str | None = None


def explain_implementation(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                           bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                           platform: str | None = None,
                           implementation: str | None = None, interpret: bool = False,
                           **kwargs) -> ImplementationChoice:
    """Which implementation ``flash_attention`` would use for these arguments, and why not the others.

    ``platform`` defaults to ``jax.default_backend()``; pass "cuda" or "cpu" to ask about
    another. Arguments are validated exactly as ``flash_attention`` validates them.
    """
    call = _validate(query, key, value, bias, mask,
                     **_defaults({**kwargs, "implementation": implementation, "interpret": interpret}))
    platform = platform or jax.default_backend()
    strategy = lambda chosen: partitioned.explain(  # --- sharded inputs (partitioned.py)
        chosen, query, call.q.shape, call.k.shape, bias is not None or mask is not None)
    features = _features(call.cfg, call.bias, call.masks, call.extras)
    reasons = {name: impl.unsupported(head_dim=call.q.shape[-1], platform=platform,
                                      interpret=call.cfg.interpret, features=features)
               for name, impl in IMPLEMENTATIONS.items()}
    if call.implementation is not None:
        chosen = call.implementation
        for name in reasons:
            if name != chosen and reasons[name] is None:
                reasons[name] = f"implementation={chosen!r} was requested"
        return ImplementationChoice(chosen, reasons, strategy(chosen))
    chosen = next(name for name, impl in IMPLEMENTATIONS.items()
                  if impl.automatic and reasons[name] is None)
    for name, impl in IMPLEMENTATIONS.items():
        if name == chosen or reasons[name] is not None:
            continue
        reasons[name] = (f"{chosen} is eligible and preferred" if impl.automatic else
                         "never chosen automatically: it materialises the [Lq, Lk] logits")
    return ImplementationChoice(chosen, reasons, strategy(chosen))


def _defaults(kwargs):
    """flash_attention's keyword defaults, overridden by kwargs."""
    params = inspect.signature(flash_attention).parameters
    defaults = {name: p.default for name, p in params.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    unknown = set(kwargs) - set(defaults)
    if unknown:
        raise TypeError(f"unexpected keyword arguments: {sorted(unknown)}")
    return {**defaults, **kwargs}


class _CallableModule(types.ModuleType):
    """This module calls ``flash_attention``, so ``jax_impl.flash_attention(q, k, v)`` works as
    users write it, while ``import jax_impl.flash_attention`` still names the module."""

    def __call__(self, *args, **kwargs):
        return flash_attention(*args, **kwargs)


__signature__ = inspect.signature(flash_attention)  # what inspect.signature(module) reports
sys.modules[__name__].__class__ = _CallableModule
