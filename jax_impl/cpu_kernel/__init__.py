"""The fused CPU kernels (``flash_cpu.h``, bound as XLA FFI custom calls in ``flash_cpu.cc``):
the default on a CPU.

``forward``/``backward`` keep the contract of ``implementations.py`` and take every call the
library takes: any float dtype (bfloat16 on the CPU's bfloat16 dot-product units where it
has them, ``bf16_dot.h``; else computed in float32), causal or not, either alignment, local
windows, sequence lengths, segment ids, a block_mask, score_mod and mask_mod (compiled into row
programs the kernels run, ``mod_program.py``; the mod_aux gradient summed per backward item),
GQA/MQA, a bias (with its gradient), a dense mask, the soft cap, dropout (the same hash as every
implementation), sinks, any head_dim (padded with zeros to a multiple of 16 in the copies the
kernels read), ring position offsets. With segment ids or a block_mask each kernel is given the
tile classes of its own grid (``block_mask.tile_classes``): it skips EMPTY tiles and masks no
pair of a FULL one. ``unsupported`` refuses mods the programs cannot express and what the
build or the tiles rule out.

``decode`` (forward only) serves few query rows against a long KV cache, dense or paged, read
in place (``decode.h``); ``decode_unsupported`` says which calls it cannot take.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_impl import block_mask, dropout_sinks, masking, mods, online_softmax, platform, vma
from jax_impl.call_features import CallFeatures
from jax_impl.config import AttentionConfig
from jax_impl.cpu_kernel import build, mod_program
from jax_impl.cpu_kernel.build import unavailable

__all__ = ["backward", "decode", "decode_splits", "decode_unsupported", "forward", "unavailable",
           "unsupported"]

HEAD_DIM_MULTIPLE = 16  # the kernels' products run in rows of SIMD vectors of up to 16 floats
# Tiles (query rows, keys) of the forward and backward, measured on the 2-core AVX-512 machine
# (benchmarks/README.md, "CPU: the fused kernel").
FORWARD_BLOCKS = (96, 128)   # block_k: a multiple of 64 (the K^T panels)
BACKWARD_BLOCKS = (64, 128)
PANEL = 64  # gemm.h's PW: K^T is read in panels of 64 keys
_UNBOUNDED = 1 << 30  # a band side with no bound (positions stay below 2**30)
# Bits of the kernels' `flags` attribute (flash_cpu.cc).
_SEGMENTS, _MASK, _BIAS, _SINKS, _DBIAS, _TILES, _MODS = 1, 2, 4, 8, 16, 32, 64


def unsupported(features: CallFeatures) -> str | None:
    """Why the CPU kernel cannot run such a call (it then runs on the xla path), or None:
    mods its programs cannot express (``mod_program.unsupported``), tiles it cannot take, or a
    kernel that cannot be built. Every other feature is taken."""
    cfg = features.cfg
    if why := mod_program.unsupported(cfg, features.mod_aux):
        return why
    if cfg.block_sizes is not None and cfg.block_sizes.block_k % PANEL:
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


def _operands(cfg: AttentionConfig, masks: masking.MaskInputs, bias, extras, shape, blocks):
    """The operands after q, k, v (mask rules, dense mask, bias, sinks, dropout seeds, the tile
    classes of the grid ``blocks`` for ``shape`` = (Lq, Lk), the mods' programs and mod_aux; a
    dummy where absent), the ``flags`` attribute that says which are present, and the mods'
    ``mod_program.Programs`` (None without mods)."""
    segments = masks.q_segment_ids is not None
    dummy = lambda dtype: jnp.zeros((1, 1), dtype)
    sinks = None if extras is None else extras.sinks
    seeds = None if extras is None or not cfg.dropout_rate else extras.dropout_seeds
    tiles = _tile_classes(cfg, masks, *shape, *blocks)
    mod_operands, programs = _mod_operands(cfg, extras)
    flags = (_SEGMENTS * segments | _MASK * (masks.mask is not None) | _BIAS * (bias is not None)
             | _SINKS * (sinks is not None) | _TILES * (tiles is not None)
             | _MODS * (programs is not None))
    present = lambda x, dtype: dummy(dtype) if x is None else x.astype(dtype)
    return ((masks.q_len, masks.kv_len, *_band(cfg, masks),
             masks.q_segment_ids if segments else dummy(jnp.int32),
             masks.kv_segment_ids if segments else dummy(jnp.int32),
             present(masks.mask, jnp.bool_),
             present(bias, jnp.float32), present(sinks, jnp.float32), present(seeds, jnp.uint32),
             present(tiles, jnp.int8), *mod_operands), flags, programs)


def _mod_operands(cfg: AttentionConfig, extras):
    """((the mods' program words, mod_aux packed as float32), their ``mod_program.Programs``),
    dummies and None without mods."""
    if not cfg.has_mods:
        return (jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.float32)), None
    mod_aux = () if extras is None else extras.mod_aux
    programs = mod_program.compile_mods(cfg, mod_aux)
    return (jnp.asarray(programs.words), programs.aux(mod_aux)), programs


def _tile_classes(cfg: AttentionConfig, masks: masking.MaskInputs, q_len: int, kv_len: int,
                  block_q: int, block_k: int):
    """int8 ``[Bc, Hc, nq, nk]`` tile classes of the grid (block_q, block_k), or None when only
    the band is known (the kernels' spans skip what lies outside it)."""
    return block_mask.tile_classes(cfg.mask, masks, q_len, kv_len, block_q, block_k,
                                   mask_mod=cfg.mask_mod is not None)


def _attributes(cfg: AttentionConfig, block_sizes, flags: int) -> dict:
    return dict(scale=np.float32(cfg.scale),
                soft_cap=np.float32(cfg.logits_soft_cap or 0.0),
                dropout_rate=np.float32(cfg.dropout_rate), block_q=np.int64(block_sizes[0]),
                block_k=np.int64(block_sizes[1]), flags=np.int64(flags))


def _registered():
    reason = unavailable()  # builds and registers the handlers on first use
    if reason:
        raise RuntimeError(f"the CPU kernel cannot run: {reason}")


def _blocks(cfg: AttentionConfig, default, masks: masking.MaskInputs):
    """The kernel's tiles: cfg.block_sizes, else ``default``, with a block_mask shrunk to the
    largest that nest in its tiles where they can (block_k a multiple of 64), so that its
    classes carry over exactly (else ``block_mask.on_grid`` gives the kernel its pair rule)."""
    if cfg.block_sizes is not None:
        return cfg.block_sizes.block_q, cfg.block_sizes.block_k
    tiles = masks.block_mask
    if tiles is None:
        return default
    block_q = max(x for x in range(1, default[0] + 1) if tiles.block_q % x == 0)
    block_k = [x for x in range(PANEL, default[1] + 1, PANEL) if tiles.block_kv % x == 0]
    return block_q, max(block_k, default=default[1])


def forward_blocks(cfg: AttentionConfig, masks: masking.MaskInputs) -> tuple[int, int]:
    """(block_q, block_k) of the forward kernel for a call with these mask inputs."""
    return _blocks(cfg, FORWARD_BLOCKS, masks)


def _padded_head_dim(d: int) -> int:
    return -(-d // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE


def _pad_features(x, dp: int, dtype=jnp.float32):
    """[..., D] -> [..., Dp] in ``dtype``, zeros past D (they add nothing to any product)."""
    x = x.astype(dtype)
    return x if x.shape[-1] == dp else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, dp - x.shape[-1])])


def _bf16_products(*arrays) -> bool:
    """Whether the call's products run on bfloat16 (bf16_dot.h: the CPU's bfloat16 dot-product
    units, P and dS rounded to bfloat16 where they meet V, dO, q and k) rather than widened to
    float32: every operand is bfloat16 and the build has the units."""
    return all(x.dtype == jnp.bfloat16 for x in arrays) and build.bf16_products()


def _pairs(x):
    """bfloat16 ``[..., Dp]`` -> uint32 ``[..., Dp / 2]``: values 2d and 2d + 1 in one word
    (2d in the low half), the kernels' operand element for bfloat16 products."""
    return jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2), jnp.uint32)


def _value_pairs(v):
    """bfloat16 v ``[B, Lk, Hkv, Dp]`` -> uint32 ``[B, Hkv, Lk_pad / 2, Dp]``: keys 2j and 2j + 1
    of each feature in one word (the right operand of P.V in pairs of keys), zero past Lk."""
    b, lk, hkv, dp = v.shape
    v = jnp.pad(_head_major(v), ((0, 0), (0, 0), (0, -lk % PANEL), (0, 0)))
    v = jnp.swapaxes(v.reshape(b, hkv, -1, 2, dp), -1, -2)
    return jax.lax.bitcast_convert_type(v, jnp.uint32)


def _key_panels(k):
    """k ``[B, Lk, Hkv, D]`` -> K^T panels ``[B, Hkv, Lk_pad / 64, D, 64]`` float32 (the
    forward's right operand of q.k, each key tile a contiguous block), zero past Lk."""
    b, lk, hkv, d = k.shape
    k = jnp.pad(k, ((0, 0), (0, -lk % PANEL), (0, 0), (0, 0)))
    return jnp.transpose(k.reshape(b, -1, PANEL, hkv, d), (0, 3, 1, 4, 2))


def _varying_like_operands(results, *operands):
    """Inside jax.shard_map (check_vma) a custom call's results are typed unvarying; they vary
    over the manual axes as the operands do (ring attention's lax.cond needs both branches alike)."""
    return vma.like(results, vma.axes_of(*operands))


def _head_major(x):  # [B, L, H, Dp] -> [B, H, L, Dp]
    return jnp.swapaxes(x, 1, 2)


def forward(cfg: AttentionConfig, q, k, v, bias, masks: masking.MaskInputs, extras=None):
    """-> (out ``[B, Lq, Hq, D]`` in q's dtype, RowStats ``[B, Hq, Lq]`` float32)."""
    _registered()
    b, lq, hq, d = q.shape
    dp = _padded_head_dim(d)
    blocks = _blocks(cfg, FORWARD_BLOCKS, masks)
    cfg, extras = block_mask.on_grid(cfg, masks, extras or dropout_sinks.SinksAndDropout(), [blocks])
    operands, flags, _ = _operands(cfg, masks, bias, extras, (lq, k.shape[1]), blocks)
    stats = jax.ShapeDtypeStruct((b, hq, lq), jnp.float32)
    if _bf16_products(q, k, v):
        q16, k16, v16 = (_pad_features(x, dp, jnp.bfloat16) for x in (q, k, v))
        target, attributes = "jax_flash_attention_cpu_forward_bf16", dict(keys=np.int64(k.shape[1]))
        q_op, k_op, v_op = _pairs(q16), _key_panels(_pairs(k16)), _value_pairs(v16)
    else:
        q32, k32, v32 = (_pad_features(x, dp) for x in (q, k, v))
        target, attributes = "jax_flash_attention_cpu_forward", {}
        q_op, k_op, v_op = q32, _key_panels(k32), _head_major(v32)
    out, row_max, log_sum = _varying_like_operands(jax.ffi.ffi_call(
        target, (jax.ShapeDtypeStruct((b, lq, hq, dp), jnp.float32), stats, stats),
        vmap_method="sequential",
    )(q_op, k_op, v_op, *operands, **_attributes(cfg, blocks, flags), **attributes),
      q, k, v, bias, masks, extras)
    return out[..., :d].astype(q.dtype), online_softmax.RowStats(row_max, log_sum)


def backward(cfg: AttentionConfig, q, k, v, bias, masks: masking.MaskInputs, stats, d_out, delta,
             extras=None):
    """-> (dq, dk, dv in the inputs' dtypes, dbias ``[B, Hq, Lq, Lk]`` float32 or None):
    FlashAttention-2's backward, one item per (batch row, kv head, key chunk); with fewer
    (batch row, kv head) pairs than threads the key tiles are dealt to chunks, each with its
    own float32 dq summed here."""
    _registered()
    b, lq, hq, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    dp = _padded_head_dim(d)
    block_q, block_k = _blocks(cfg, BACKWARD_BLOCKS, masks)
    extras = extras or dropout_sinks.SinksAndDropout()
    d_mod_aux_entries = len(extras.mod_aux)  # the caller's (on_grid may add the tile classes)
    cfg, extras = block_mask.on_grid(cfg, masks, extras, [(block_q, block_k)])
    operands, flags, programs = _operands(cfg, masks, bias, extras, (lq, lk), (block_q, block_k))
    with_dbias = bias is not None and cfg.bias_gradient
    chunks = max(1, min(-(-platform.host_threads() // (b * hkv)), -(-lk // block_k)))
    kv_shape = jax.ShapeDtypeStruct((b, hkv, lk, dp), jnp.float32)
    dbias_shape = (b, hq, lq, lk) if with_dbias else (1, 1, 1, 1)
    with_d_aux = programs is not None and programs.scatters
    d_aux_shape = (b * hkv * chunks, programs.aux_floats) if with_d_aux else (1, 1)
    if _bf16_products(q, k, v):
        target = "jax_flash_attention_cpu_backward_bf16"
        operand = lambda x: _head_major(_pairs(_pad_features(x, dp, jnp.bfloat16)))
    else:
        target, operand = "jax_flash_attention_cpu_backward", lambda x: _head_major(_pad_features(x, dp))
    dq_parts, dk, dv, dbias, d_aux_parts = _varying_like_operands(jax.ffi.ffi_call(
        target,
        (jax.ShapeDtypeStruct((chunks, b, hq, lq, dp), jnp.float32), kv_shape, kv_shape,
         jax.ShapeDtypeStruct(dbias_shape, jnp.float32), jax.ShapeDtypeStruct(d_aux_shape, jnp.float32)),
        vmap_method="sequential",
    )(*(operand(x) for x in (q, k, v)), *operands, operand(d_out), stats.max, stats.log_sum, delta,
      **_attributes(cfg, (block_q, block_k), flags | _DBIAS * with_dbias), chunks=np.int64(chunks)),
      q, k, v, bias, masks, extras, stats, d_out, delta)
    dq = jnp.swapaxes(jnp.sum(dq_parts, axis=0), 1, 2)[..., :d] * cfg.scale
    dk, dv = (jnp.swapaxes(x, 1, 2)[..., :d].astype(y.dtype) for x, y in ((dk, k), (dv, v)))
    mod_aux = () if extras is None else extras.mod_aux
    if cfg.score_mod is None:
        d_mod_aux = ()
    elif with_d_aux:  # the items' sums, added in item order
        d_mod_aux = programs.cotangents(jnp.sum(d_aux_parts, axis=0), mod_aux)
    else:
        d_mod_aux = mods.zero_cotangents(cfg, mod_aux)
    return dq.astype(q.dtype), dk, dv, dbias if with_dbias else None, d_mod_aux[:d_mod_aux_entries]


DECODE_CACHE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
DECODE_MAX_QUERY_ROWS = 16
DECODE_MIN_KEYS_PER_SPLIT = 512  # below this a split's fixed cost outweighs its keys
_PAGED, _BF16_PRODUCTS = 1, 128  # decode flags (flash_cpu.cc)


def decode_unsupported(*, q_len: int | None = None, dtype=None, has_bias: bool = False,
                       has_mask: bool = False, has_segment_ids: bool = False,
                       dropout_rate: float = 0.0) -> str | None:
    """Why ``decode`` cannot take such a call (the caller then takes its regular path), or None."""
    if q_len is not None and q_len > DECODE_MAX_QUERY_ROWS:
        return f"{q_len} query rows: the decode kernel takes at most {DECODE_MAX_QUERY_ROWS}"
    if dtype is not None and jnp.dtype(dtype) not in [jnp.dtype(t) for t in DECODE_CACHE_DTYPES]:
        return f"cache dtype {jnp.dtype(dtype)}: the decode kernel reads float32, bfloat16, float16"
    for present, what in ((has_bias, "a bias"), (has_mask, "a dense mask"),
                          (has_segment_ids, "segment ids"), (dropout_rate, "dropout")):
        if present:
            return f"{what}: the decode kernel does not take it"
    return unavailable()


def decode_splits(batch: int, kv_len: int, threads: int | None = None) -> int:
    """How many key ranges each batch row is split into (one item per (batch row, split), all
    kv heads in it): four items per thread (a thread that the OS delays leaves its share to the
    others), no split under DECODE_MIN_KEYS_PER_SPLIT keys. A function of the shapes and the
    thread count only, so that repeated calls give the same bits."""
    threads = platform.host_threads() if threads is None else threads
    wanted = -(-4 * threads // batch)
    return max(1, min(wanted, kv_len // DECODE_MIN_KEYS_PER_SPLIT))


def decode(cfg: AttentionConfig, q, k, v, masks: masking.MaskInputs, extras=None, page_table=None,
           *, splits: int | None = None):
    """Decode forward: -> (out ``[B, Lq, Hq, D]`` in q's dtype, RowStats ``[B, Hq, Lq]``).

    q ``[B, Lq, Hq, D]`` (Lq <= 16); k, v a dense cache ``[B, Lk, Hkv, D]`` (page_table None)
    or pages ``[num_pages, page_size, Hkv, D]`` with page_table ``[B, pages_per_sequence]``
    int32 (logical key j of row b: page ``page_table[b, j // page_size]``, slot
    ``j % page_size``). Lengths, band and position offset come from ``masks`` in logical keys.
    The cache is passed to the kernel as it is: no copy, cast or relayout of it. RowStats as
    ``forward`` returns them (so ``backward`` runs from them for a dense cache).
    ``splits`` overrides ``decode_splits`` (tests: every split count gives the same answer).
    """
    _registered()
    b, lq, hq, d = q.shape
    if masks.mask is not None or masks.q_segment_ids is not None:
        raise ValueError("cpu_kernel.decode takes no dense mask and no segment ids "
                         "(masks.mask and masks.q_segment_ids must be None)")
    if extras is not None and extras.dropout_seeds is not None and cfg.dropout_rate:
        raise ValueError("cpu_kernel.decode takes no dropout (cfg.dropout_rate must be 0)")
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"k and v must share shape and dtype; got {k.shape} {k.dtype}, {v.shape} {v.dtype}")
    reason = decode_unsupported(q_len=lq, dtype=k.dtype)
    if reason:
        raise ValueError(f"cpu_kernel.decode cannot run this call: {reason}")
    hkv, dk = k.shape[2], k.shape[3]
    if dk != d or hq % hkv:
        raise ValueError(f"q {q.shape} and cache {k.shape} must share head_dim, with Hq a multiple of Hkv")
    if page_table is None:
        if k.shape[0] != b:
            raise ValueError(f"a dense cache k must be [B={b}, Lk, Hkv, D]; got {k.shape}")
        lk, flags, table = k.shape[1], 0, jnp.zeros((1, 1), jnp.int32)
    else:
        if page_table.ndim != 2 or page_table.shape[0] != b or not jnp.issubdtype(page_table.dtype, jnp.integer):
            raise ValueError(f"page_table must be int32 [B={b}, pages_per_sequence]; got "
                             f"{page_table.shape} {page_table.dtype}")
        lk, flags, table = page_table.shape[1] * k.shape[1], _PAGED, page_table.astype(jnp.int32)
    sinks = None if extras is None else extras.sinks
    mod_operands, programs = _mod_operands(cfg, extras)
    flags |= (_SINKS * (sinks is not None) | _MODS * (programs is not None)
              | _BF16_PRODUCTS * _bf16_products(q, k, v))
    if splits is None:
        splits = decode_splits(b, lk)
    dp = _padded_head_dim(d)
    stats = jax.ShapeDtypeStruct((b, hq, lq), jnp.float32)
    d_lo, d_hi = _band(cfg, masks)
    out, row_max, log_sum = _varying_like_operands(jax.ffi.ffi_call(
        "jax_flash_attention_cpu_decode",
        (jax.ShapeDtypeStruct((b, lq, hq, dp), jnp.float32), stats, stats), vmap_method="sequential",
    )(_pad_features(q, dp), k, v, table, masks.q_len, masks.kv_len, d_lo, d_hi,
      jnp.zeros((1, 1), jnp.float32) if sinks is None else sinks.astype(jnp.float32),
      *mod_operands, scale=np.float32(cfg.scale), soft_cap=np.float32(cfg.logits_soft_cap or 0.0),
      flags=np.int64(flags), splits=np.int64(splits)), q, k, v, masks, extras, page_table)
    return out[..., :d].astype(q.dtype), online_softmax.RowStats(row_max, log_sum)
