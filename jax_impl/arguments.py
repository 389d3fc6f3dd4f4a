"""flash_attention's arguments: every check (an error names the argument and the rule), and
the canonical shapes of a validated call (``Call``: one flat batch axis, masks as
``masking.MaskInputs``, the static part as ``AttentionConfig``). ``flash_attention.py`` and
``context_parallel.py`` call ``validate``; nothing below them checks user input again.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_impl import block_mask as block_mask_lib
from jax_impl import cp_cost, dropout_sinks, implementations, masking, mods, platform
from jax_impl.call_features import CallFeatures
from jax_impl.config import AttentionConfig, BlockSizes
from jax_impl.mosaic_gpu.config import Config as MosaicConfig

SUPPORTED_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)
# What implementation= takes: the table's names (cuDNN included).
IMPLEMENTATION_NAMES = tuple(implementations.IMPLEMENTATIONS)

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


class Call(NamedTuple):
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
    # [B, P] int32 with k/v pages [num_pages, page_size, Hkv, D]; None: a dense cache.
    page_table: Any = None
    return_residual: bool = False

    def features(self) -> CallFeatures:
        """The call as the implementation table's rules judge it."""
        paged = self.page_table is not None
        lk = self.page_table.shape[1] * self.k.shape[1] if paged else self.k.shape[1]
        return CallFeatures.of(self.cfg, self.q, self.k, self.bias, self.masks, self.extras,
                               lk=lk, batch_dims=len(self.batch_shape), paged=paged,
                               return_residual=self.return_residual)

    def to_user(self, out, lse, return_residual: bool):
        """out [B, Lq, Hq, D] and lse [B, Hq, Lq] back in the caller's batch dims: out, or
        (out, logsumexp [..., Lq, Hq]) with return_residual."""
        out = out.reshape(self.batch_shape + out.shape[1:])
        if not return_residual:
            return out
        return out, jnp.swapaxes(lse, 1, 2).reshape(self.batch_shape + out.shape[-3:-1])


def validate(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
             query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
             implementation=None, return_residual=False, causal_alignment="top_left",
             q_segment_ids=None, kv_segment_ids=None, logits_soft_cap=None, block_sizes=None,
             precision=None, interpret=False, attention_sinks=None, context_parallel_strategy=None,
             dropout_rng=None,
             dropout_rate=0.0, broadcast_dropout=True, deterministic=None, dtype=None,
             module=None, force_fp32_for_softmax=False, qk_attn_weights_einsum=None,
             attn_weights_value_einsum=None, page_table=None, score_mod=None, mask_mod=None,
             mod_aux=(), block_mask=None) -> Call:
    """flash_attention's arguments checked (each error names its argument and the rule) and
    brought to canonical shapes. The defaults are flash_attention's (a test keeps them equal)."""
    for name, flag in (("is_causal", is_causal), ("return_residual", return_residual),
                       ("interpret", interpret), ("broadcast_dropout", broadcast_dropout),
                       ("force_fp32_for_softmax", force_fp32_for_softmax)):
        _flag(name, flag)
    _flag("deterministic", deterministic, none="a direct call: dropout active when dropout_rate > 0")
    _option("implementation", implementation, IMPLEMENTATION_NAMES,
            none="chosen per platform: explain_implementation says which")
    _option("causal_alignment", causal_alignment, masking.CAUSAL_ALIGNMENTS)
    _option("context_parallel_strategy", context_parallel_strategy, cp_cost.STRATEGIES,
            none="chosen by the cost model")
    mask = _validate_flax_keywords(dropout_rate, deterministic, module, qk_attn_weights_einsum,
                                   attn_weights_value_einsum, mask)
    del force_fp32_for_softmax  # the softmax is always fp32
    query, key, value, page_table, lk = _tensors(query, key, value, dtype, implementation,
                                                 page_table)
    if page_table is not None:
        _refuse_with_pages(bias=bias, mask=mask, q_segment_ids=q_segment_ids,
                           dropout=dropout_rate and not deterministic,
                           block_mask=block_mask is not None)
    batch_shape = query.shape[:-3]
    lq, hq, head_dim = query.shape[-3:]
    b = math.prod(batch_shape)
    full_shape = batch_shape + (hq, lq, lk)

    window_left, window_right = _window(local_window_size)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    spec = masking.MaskSpec(is_causal=bool(is_causal), bottom_right=causal_alignment == "bottom_right",
                            window_left=window_left, window_right=window_right,
                            has_q_lengths=query_seq_lengths is not None,
                            has_kv_lengths=key_value_seq_lengths is not None,
                            has_block_mask=block_mask is not None,
                            block_mask_of_mask_mod=block_mask_lib.made_from(block_mask, mask_mod))
    score_mod, mask_mod, mod_aux = _mods(score_mod, mask_mod, mod_aux, block_mask, batch=b,
                                         heads=hq, q_len=lq, kv_len=lk)
    masks = masking.MaskInputs(
        q_len=masking.lengths("query_seq_lengths", query_seq_lengths, batch_shape, lq),
        kv_len=masking.lengths("key_value_seq_lengths", key_value_seq_lengths, batch_shape, lk),
        q_segment_ids=_segment_ids("q_segment_ids", q_segment_ids, batch_shape, lq),
        kv_segment_ids=_segment_ids("kv_segment_ids", kv_segment_ids, batch_shape, lk),
        mask=pairwise("mask", mask, full_shape, is_mask=True),
        block_mask=block_mask,
    )
    bias = pairwise("bias", bias, full_shape, is_mask=False)

    scale, logits_soft_cap = _static_numbers(scale, logits_soft_cap, block_sizes, implementation,
                                             head_dim)
    rate = float(dropout_rate) if dropout_rate and not deterministic else 0.0
    seeds = None
    if rate:
        if dropout_rng is None:
            raise ValueError(f"dropout_rng must be a PRNG key when {dropout_rate=} and "
                             f"{deterministic=} (dropout is active)")
        words = dropout_sinks.key_words(dropout_rng, "dropout_rng")
        seeds = dropout_sinks.head_seeds(words, b, hq, bool(broadcast_dropout))
    extras = dropout_sinks.SinksAndDropout(sinks=_sinks(attention_sinks, batch_shape, hq),
                                           dropout_seeds=seeds, mod_aux=mod_aux)
    cfg = AttentionConfig(scale=scale, mask=spec, logits_soft_cap=logits_soft_cap,
                          block_sizes=block_sizes, interpret=bool(interpret),
                          precision=_precision(precision, query.dtype), dropout_rate=rate,
                          context_parallel_strategy=context_parallel_strategy,
                          score_mod=score_mod, mask_mod=mask_mod)
    flat = lambda x: x.reshape((b,) + x.shape[len(batch_shape):])
    if page_table is not None:  # the pages have no batch axis
        return Call(implementation, cfg, flat(query), key, value, bias, masks, batch_shape, extras,
                    page_table, bool(return_residual))
    return Call(implementation, cfg, flat(query), flat(key), flat(value), bias, masks, batch_shape,
                extras, None, bool(return_residual))


def _tensors(query, key, value, dtype, implementation, page_table):
    """query, key and value as arrays (cast to ``dtype`` where given) with their shapes and
    dtypes checked, and (page_table checked, or None; the logical key length)."""
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
    lq, hq, head_dim = query.shape[-3:]
    lk, hkv, key_head_dim = key.shape[-3:]
    if page_table is not None:
        page_table, lk = _page_table(page_table, key, batch_shape)
    elif key.shape[:-3] != batch_shape:
        raise ValueError(f"query and key must share batch dims; got {query.shape=} {key.shape=}")
    if head_dim != key_head_dim:
        raise ValueError(f"query head_dim={head_dim} must equal key/value head_dim={key_head_dim}")
    if min(lq, lk, hq, hkv, head_dim) < 1:
        raise ValueError(f"sequence lengths, heads and head_dim must be >= 1; got "
                         f"{query.shape=} {key.shape=}")
    if hq % hkv:
        raise ValueError(f"num_q_heads={hq} must be a multiple of num_kv_heads={hkv}")
    return query, key, value, page_table, lk


def _static_numbers(scale, logits_soft_cap, block_sizes, implementation, head_dim):
    """(scale, soft cap) as floats, block_sizes checked: each is static."""
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
    if isinstance(block_sizes, MosaicConfig):
        if implementation != "mosaic_gpu":
            raise TypeError("block_sizes is a jax_impl.mosaic_gpu.Config: it applies to "
                            f"implementation='mosaic_gpu' only; got {implementation=}")
    elif block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be a jax_impl.BlockSizes (or, with "
                        f"implementation='mosaic_gpu', a jax_impl.mosaic_gpu.Config); got "
                        f"{type(block_sizes).__name__}")
    return float(scale), None if logits_soft_cap is None else float(logits_soft_cap)


def _mods(score_mod, mask_mod, mod_aux, block_mask, *, batch, heads, q_len, kv_len) -> tuple:
    """Checks score_mod, mask_mod, mod_aux and block_mask (errors name them); -> (score_mod,
    mask_mod, mod_aux as a tuple of arrays) with the arrays the mods close over moved into
    mod_aux (``mods.hoisted``). The mods' indices are flat: b over the flattened batch dims, h
    the query head."""
    if not isinstance(mod_aux, (tuple, list)):
        raise TypeError(f"mod_aux must be a tuple of the arrays score_mod and mask_mod read; got "
                        f"{type(mod_aux).__name__}")
    for position, x in enumerate(mod_aux):
        if x is None or not (hasattr(x, "dtype") or isinstance(x, (bool, int, float, list, tuple))):
            raise TypeError(f"mod_aux[{position}] must be an array (or a number); got "
                            f"{type(x).__name__}")
    mod_aux = tuple(jnp.asarray(x) for x in mod_aux)
    if mod_aux and score_mod is None and mask_mod is None:
        raise ValueError("mod_aux was given without score_mod or mask_mod: nothing reads it")
    indices = mods.check(score_mod, mask_mod, mod_aux, batch=batch, heads=heads, q_len=q_len,
                         kv_len=kv_len)
    checked_block_mask(block_mask, mask_mod, batch=batch, heads=heads, q_len=q_len, kv_len=kv_len)
    return mods.hoisted(score_mod, mask_mod, mod_aux, indices)


def checked_block_mask(block_mask, mask_mod, *, batch: int, heads: int, q_len: int, kv_len: int):
    """``block_mask`` (or None) checked against the call's flat batch, query heads and the
    sequence lengths its tiles span (the global ones in a sharded strategy); a block_mask with
    partial tiles needs its mask_mod."""
    if block_mask is None:
        return None
    block_mask_lib.check_block_mask(block_mask, batch=batch, heads=heads, q_len=q_len,
                                    kv_len=kv_len)
    if mask_mod is None:
        partial = masking.concrete(block_mask.kv_num_blocks)
        if partial is None or partial.any():
            raise ValueError(
                "block_mask has partial tiles (or is traced, so it may) but no mask_mod was "
                "given: the pairs of a partial tile are decided by mask_mod; pass the mask_mod "
                "the block_mask was made from (create_block_mask), or a concrete block_mask "
                "whose tiles are all empty or full")
    return block_mask


def _page_table(page_table, pages, batch_shape):
    """-> (page_table [B, P] int32, logical key length P * page_size); ids follow
    ``page_ids``' rule."""
    if pages.ndim != 4:
        raise ValueError(f"with page_table, key and value are pages [num_pages, page_size, "
                         f"num_kv_heads, head_dim]; got key.shape={pages.shape}")
    num_pages, page_size = pages.shape[:2]
    if min(num_pages, page_size) < 1:
        raise ValueError(f"key/value pages need num_pages >= 1 and page_size >= 1; got {pages.shape=}")
    table = page_ids(page_table, num_pages)
    if table.shape[:-1] != batch_shape or table.ndim != len(batch_shape) + 1 or table.shape[-1] < 1:
        raise ValueError(f"page_table.shape={table.shape} must be [batch..., pages_per_sequence] "
                         f"with the query's batch dims {batch_shape} and pages_per_sequence >= 1")
    pages_per_sequence = table.shape[-1]
    return table.reshape(-1, pages_per_sequence), pages_per_sequence * page_size


def page_ids(page_table, num_pages: int) -> jax.Array:
    """``page_table`` as int32 ids under the one rule of every paged entry point (``gather``,
    ``append``, ``flash_attention(page_table=...)`` and so each decode path): integers with
    ``0 <= id < num_pages``. Concrete ids out of range raise. Traced ids (under ``jit``) cannot
    be checked and are clamped into ``[0, num_pages - 1]`` by all of them alike, so a gather
    then a dense call reads what the paged call reads, and an append writes where both read
    (a clamped id names a valid but wrong page: check tables before ``jit``)."""
    values = masking.concrete(page_table)  # before any cast: int64 ids must not wrap
    table = jnp.asarray(page_table) if values is None else values
    if not np.issubdtype(table.dtype, np.integer):
        raise TypeError(f"page_table must be integers (int32 page ids); got {table.dtype}")
    if values is None:  # clamped before the int32 cast, which could wrap a traced int64 id
        return jnp.clip(table, 0, num_pages - 1).astype(jnp.int32)
    if values.size and (values.min() < 0 or values.max() >= num_pages):
        raise ValueError(f"page_table ids must lie in [0, num_pages={num_pages}) (0 <= id < "
                         f"num_pages); got values in [{values.min()}, {values.max()}]")
    return jnp.asarray(values, jnp.int32)


def _refuse_with_pages(*, bias, mask, q_segment_ids, dropout, block_mask):
    for given, name in ((bias is not None, "bias"), (mask is not None, "mask"),
                        (q_segment_ids is not None, "q_segment_ids/kv_segment_ids"),
                        (bool(dropout), "dropout_rate > 0"), (block_mask, "block_mask")):
        if given:
            raise ValueError(f"{name} cannot be used with page_table: a paged KV cache runs on "
                             "the decode path, which takes lengths, causal, windows, soft cap, "
                             "sinks and (on xla) score_mod and mask_mod only")


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


def _flag(name, value, *, none: str | None = None):
    """A static boolean argument: a Python (or numpy) bool, never another type read as one;
    also None where ``none`` says what None means."""
    if isinstance(value, (bool, np.bool_)) or (value is None and none):
        return
    allowed = f"None ({none}) or a Python bool" if none else "a Python bool"
    raise TypeError(f"{name}={value!r} must be {allowed} (it is static)")


def _option(name, value, choices, *, none: str | None = None):
    """A static str argument: one of ``choices``; also None where ``none`` says what None means."""
    if value is None and none:
        return
    allowed = (f"None ({none}) or " if none else "") + f"one of {choices}"
    if not isinstance(value, str):
        raise TypeError(f"{name}={value!r} must be {allowed}: a str (it is static)")
    if value not in choices:
        raise ValueError(f"{name}={value!r} must be {allowed}")


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


def pairwise(name, x, full_shape, *, is_mask):
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
    return platform.requires_cuda(q, GPU_ONLY_PRECISION_ERROR.format(precision=cfg.precision.name))
