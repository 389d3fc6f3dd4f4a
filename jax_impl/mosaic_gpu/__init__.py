"""Pallas Mosaic GPU FlashAttention for Hopper (sm_90a): FlashAttention-3's forward.

``forward`` and ``backward`` keep the contract of ``implementations.py`` (natural-log
``RowStats``: an empty row has max = +inf and log_sum = 0, as every backend writes them); the
backward (backward.py: dK/dV per key tile, dQ per query tile, no atomics) recomputes P from
them. ``backward_unsupported`` says when the table sends the backward to pallas_triton instead
(the caller's ``Config(backward="pallas_triton")``, an interpreted call that did not choose
``Config(backward="mosaic_gpu")``, or dbias with the fused dQ: pallas_triton's backward
reads the same RowStats). A bias and a dense mask stream through the backward's rings as
through the forward's; the dQ kernel writes dbias. With segment ids, a block_mask or a mod
every kernel walks the lists of its non-empty tiles (full ones without the per-pair mask);
score_mod and mask_mod are traced on the fragments' global indices, their mod_aux read by
scalar indices (its gradient is the xla backward's: implementations.py).
``unsupported`` names every feature of a call that the kernel does not take;
``unavailable`` says why the kernel cannot be offered at all here (jax older than 0.11, or no
``jax.experimental.pallas.mosaic_gpu``).

The non-finite rule (online_softmax) costs one XLA pass over q, k and v before the kernel, as
the kernel reads its operands only through TMA into shared memory: q's rows that hold a
non-finite value become all NaN (q enters only S, whose select keeps the NaN at the allowed
pairs), k's rows take the poison of their key's K and V rows (k too enters only S), and v's
non-finite entries become 0 (P V reads v where P = 0; a key whose V row is non-finite has a
poisoned k, so every row that attends it is NaN all the same).
"""
from __future__ import annotations


import jax
import jax.numpy as jnp

from jax_impl import block_mask, kernel_tiles, masking, online_softmax, platform, vma
from jax_impl.call_features import CallFeatures
from jax_impl.config import AttentionConfig
from jax_impl.dropout_sinks import SinksAndDropout
from jax_impl.mosaic_gpu.config import (CONSUMERS, SHARED_MEMORY_BUDGET, BackwardConfig, Config,
                                        default_backward_config, default_config,
                                        packs_query_group)

__all__ = ["Config", "BackwardConfig", "forward", "backward", "backward_unsupported", "unsupported", "unavailable", "HEAD_DIMS", "DTYPES"]

MIN_JAX = (0, 11)
HEAD_DIMS = (64, 128, 256)  # the forward's
BACKWARD_HEAD_DIMS = (64, 128)  # the backward's: at 256 pallas_triton's (backward_unsupported)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
PLATFORM_ERROR = (
    "implementation='mosaic_gpu' runs only on a CUDA GPU of compute capability 9.0 (H100, H200; "
    "the call is being lowered for {platform!r}). Use implementation='pallas_triton' on other "
    "GPUs, implementation='xla' on any device, or implementation=None to choose automatically.")


def _import_error() -> str | None:
    if jax.__version_info__[:2] < MIN_JAX:
        return (f"the Mosaic GPU kernel needs jax >= {'.'.join(map(str, MIN_JAX))}; this is jax "
                f"{jax.__version__}")
    try:
        # Imported here, before the functions of the same names below are defined: importing
        # a submodule later would rebind the package's attribute to the module.
        from jax_impl.mosaic_gpu import forward as _, backward as _b  # noqa: F401  (plgpu)
    except Exception as e:  # ImportError, or an API that moved
        return f"jax.experimental.pallas.mosaic_gpu cannot be used here: {type(e).__name__}: {e}"
    return None


_UNAVAILABLE = _import_error()


def unavailable() -> str | None:
    """Why the kernel cannot be offered in this installation, or None."""
    return _UNAVAILABLE


def unsupported(features: CallFeatures) -> str | None:
    """Why the Mosaic GPU forward cannot run such a call, or None. Every feature it does not
    take yet is named. A bias and a dense mask are taken (``backward_unsupported`` says when
    their backward is pallas_triton's); a chosen ``Config`` and its ``backward_config`` must
    fit them in shared memory beside their tiles (judged for a float32 bias, the widest the
    kernels read). Sinks and segment ids are taken, forward and backward."""
    cfg, head_dim, dtype, mod_aux = features.cfg, features.head_dim, features.dtype, features.mod_aux
    has_bias, has_mask = features.has_bias, features.has_mask
    has_segment_ids = features.has_segment_ids
    if _UNAVAILABLE:
        return _UNAVAILABLE
    if head_dim not in HEAD_DIMS:
        return f"head_dim={head_dim} is not one of {HEAD_DIMS}"
    if dtype is not None and jnp.dtype(dtype) not in DTYPES:
        return f"dtype {jnp.dtype(dtype)} is not bfloat16 or float16 (wgmma's 16-bit operands)"
    if head_dim not in BACKWARD_HEAD_DIMS:
        refused = [x for x, given in (("a bias", has_bias), ("a dense mask", has_mask),
                                      ("dropout", bool(cfg is not None and cfg.dropout_rate)))
                   if given]
        if refused:
            return (f"head_dim={head_dim} with {' and '.join(refused)}: at head_dim 256 a bias "
                    "or mask ring does not fit the shared memory beside K and V (192 KiB), and "
                    "dropout's hash spilled 52 bytes (compiled for sm_90a)")
    if why := kernel_tiles.mods_unsupported(cfg, mod_aux):
        return why
    if features.block_mask_tiles is not None and (features.lq is None or block_mask.needs_pair_rule(
            cfg, features.block_mask_tiles, (features.lq, features.lk), _grids(
                _forward_config(cfg, head_dim, dtype or jnp.bfloat16, has_bias, has_mask),
                _backward_config(cfg, head_dim, dtype or jnp.bfloat16)),
            has_segment_ids=has_segment_ids)):
        return ("a block_mask whose tiles do not hold its meaning on this kernel's tiles (they "
                "do not nest, or a mask_mod it was not made from meets a tile that another rule "
                "makes partial): its meaning pair by pair (block_mask.PairRule) reads it by "
                "q_idx and kv_idx, which this kernel's mod_aux reads cannot (make it with "
                "create_block_mask from the call's mask_mod)")
    if cfg is not None:
        if cfg.block_sizes is not None and not isinstance(cfg.block_sizes, Config):
            return ("block_sizes is a BlockSizes (the Triton kernels' tiles); this kernel takes "
                    "jax_impl.mosaic_gpu.Config")
        if isinstance(cfg.block_sizes, Config) and cfg.block_sizes.pack_query_group:
            per_head = [x for x, given in (("dropout", bool(cfg.dropout_rate)), ("a bias", has_bias),
                                           ("a dense mask", has_mask),
                                           ("a block_mask", cfg.mask.has_block_mask),
                                           ("score_mod and mask_mod", cfg.has_mods)) if given]
            if per_head:
                return (f"Config(pack_query_group=True) packs a kv head's query heads into one "
                        f"tile's rows, where {' and '.join(per_head)} would differ per query head "
                        "within a tile (None packs only the calls that allow it)")
        if isinstance(cfg.block_sizes, Config):
            need = cfg.block_sizes.shared_memory_bytes(  # 16-bit only
                head_dim, jnp.bfloat16, pairwise_bytes=_pairwise_bytes(has_bias, has_mask),
                segment_ids=has_segment_ids)
            if need > SHARED_MEMORY_BUDGET:
                with_pairwise = " ".join(
                    x for x, given in (("with a bias", has_bias), ("with a mask", has_mask),
                                       ("with segment ids", has_segment_ids)) if given)
                return (f"block_sizes={cfg.block_sizes} needs {need / 1024:.1f} KiB of shared "
                        f"memory at head_dim={head_dim}{' ' * bool(with_pairwise)}{with_pairwise}, "
                        f"over the {SHARED_MEMORY_BUDGET // 1024} KiB an sm_90 block may take: "
                        "fewer num_stages or smaller tiles")
            backward = cfg.block_sizes.backward_config
            need = None if backward is None else backward.shared_memory_bytes(
                head_dim, jnp.bfloat16, has_segment_ids, _pairwise_bytes(has_bias, has_mask))
            if need is not None and need > SHARED_MEMORY_BUDGET:
                return (f"backward_config={backward} needs {need / 1024:.1f} KiB of shared "
                        f"memory at head_dim={head_dim}, over the {SHARED_MEMORY_BUDGET // 1024} "
                        "KiB an sm_90 block may take: 64-row tiles (dq='fused' holds dS^T and "
                        "an fp32 dQ tile per warpgroup beside K and V; a bias and a mask a ring "
                        "of their own)")
    return None


def _forward_config(cfg: AttentionConfig, head_dim: int, dtype, has_bias: bool, has_mask: bool,
                    bias_dtype=jnp.float32) -> Config:
    """The forward's Config: the caller's, else the default for the call."""
    if isinstance(cfg.block_sizes, Config):
        return cfg.block_sizes
    return default_config(head_dim, dtype, dropout=bool(cfg.dropout_rate),
                          pairwise_bytes=_pairwise_bytes(has_bias, has_mask, bias_dtype))


def _backward_config(cfg: AttentionConfig, head_dim: int, dtype) -> BackwardConfig:
    chosen = cfg.block_sizes.backward_config if isinstance(cfg.block_sizes, Config) else None
    return chosen or default_backward_config(head_dim, dtype)


def _grids(forward: Config, backward: BackwardConfig) -> tuple:
    """The (rows, keys) tiles of the forward, dQ and dK/dV kernels' tile lists."""
    return ((forward.rows_per_cta, forward.block_kv),
            (CONSUMERS * backward.block_q, backward.block_kv),
            (backward.block_q, CONSUMERS * backward.block_kv))


def _pairwise_bytes(has_bias: bool, has_mask: bool, bias_dtype=jnp.float32) -> int:
    """Shared-memory bytes per (query, key) pair of the bias and mask tiles (the mask as int8)."""
    return has_bias * jnp.dtype(bias_dtype).itemsize + has_mask


def _num_sms() -> int | None:
    """The SMs of the CUDA device a call will run on, if one is visible (None: the scheduler's
    default, the H100's and H200's 132, e.g. when compiling on a host without a GPU)."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return None
    return getattr(devices[0], "core_count", None) if devices else None


def forward(cfg: AttentionConfig, q, k, v, bias, masks: masking.MaskInputs, extras=None):
    """q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D] -> (out [B, Lq, Hq, D], RowStats [B, Hq, Lq] f32)."""
    from jax_impl.mosaic_gpu.forward import Geometry, forward_call
    extras = extras or SinksAndDropout()
    reason = unsupported(CallFeatures.of(cfg, q, k, bias, masks, extras))
    if reason:
        raise ValueError(f"implementation='mosaic_gpu' cannot run this call: {reason}")
    if bias is not None and jnp.dtype(bias.dtype).itemsize > 4:
        bias = bias.astype(jnp.float32)  # the logits are float32 (the reference's cast too)
    bias_dtype = None if bias is None else jnp.dtype(bias.dtype)
    config = _forward_config(cfg, q.shape[-1], q.dtype, bias is not None, masks.mask is not None,
                             bias_dtype or jnp.float32)
    operands = (q, k, v, masks, extras.sinks, extras.dropout_seeds, extras.dropout_offset,
                extras.mod_aux)
    q, k, v, masks, sinks, seeds, dropout_offset, mod_aux = vma.like(operands,
                                                                     vma.axes_of(*operands))
    interpret = None
    if cfg.interpret:
        from jax.experimental.pallas import mosaic_gpu as plgpu
        interpret = plgpu.InterpretGPUParams()
    else:
        q = platform.requires_cuda(q, PLATFORM_ERROR)
    batch, lq, heads, head_dim = q.shape
    geometry = Geometry(batch, lq, k.shape[1], heads, k.shape[2], head_dim, jnp.dtype(q.dtype),
                        config, bias_dtype, masks.mask is not None)
    packed = packs_query_group(config, lq, heads // k.shape[2], per_head_pairs=bool(
        cfg.dropout_rate) or bias is not None or masks.mask is not None or cfg.has_mods
        or masks.block_mask is not None)
    q, k, v = online_softmax.operands_poisoned(q, k, v)
    out, row_max, log_sum = forward_call(
        cfg, geometry, q, k, v, masks.q_len, masks.kv_len, masks.position_offset,
        None if sinks is None else sinks.astype(jnp.float32), masks.q_segment_ids,
        masks.kv_segment_ids, seeds, dropout_offset, bias, masks.mask,
        block_mask=masks.block_mask, mod_aux=mod_aux, num_sms=_num_sms(), interpret=interpret,
        pack_query_group=packed)
    return out, online_softmax.RowStats(row_max, log_sum)


def _backward_refuses(cfg: AttentionConfig, has_bias: bool, head_dim: int | None) -> str | None:
    """What the backward kernels do not take, or None (``backward_unsupported``)."""
    if head_dim is not None and head_dim not in BACKWARD_HEAD_DIMS:
        return (f"head_dim={head_dim}: the dK/dV kernel's fp32 dK and dV (2 x 64 x {head_dim} "
                "per warpgroup) do not fit its registers")
    chosen = cfg.block_sizes.backward_config if isinstance(cfg.block_sizes, Config) else None
    if has_bias and cfg.bias_gradient and chosen is not None and chosen.dq == "fused":
        return ("a differentiated bias with BackwardConfig(dq='fused'): dbias is written by the "
                "dQ kernel, which the fused dQ does without")
    return None


def backward_unsupported(cfg: AttentionConfig, *, has_bias: bool = False,
                         head_dim: int | None = None) -> str | None:
    """Why this package's backward kernels do not differentiate a call that its forward runs,
    or None: head_dim 256 (the forward's alone), a differentiated bias (``cfg.bias_gradient``)
    with ``BackwardConfig(dq="fused")`` (dbias is the dQ kernel's), the caller chose another
    backward (``Config.backward``), or the call is interpreted and chose none (the interpreted
    backward can hang: docs/limitations.md). Every input the forward takes (a bias, a dense mask, segment ids,
    dropout, each with any other), the backward takes too."""
    reason = _backward_refuses(cfg, has_bias, head_dim)
    if reason:
        return reason
    config = cfg.block_sizes
    chosen = config.backward if isinstance(config, Config) else None
    if chosen == "pallas_triton":
        return "mosaic_gpu.Config(backward='pallas_triton') chose that backward"
    if cfg.interpret and chosen is None:
        return ("interpreted, the Mosaic GPU backward can hang (docs/limitations.md); "
                "Config(backward='mosaic_gpu') runs it all the same")
    return None


def backward(cfg: AttentionConfig, q, k, v, bias, masks: masking.MaskInputs, stats, d_out, delta,
             extras=None):
    """-> (dq, dk, dv, dbias [B, Hq, Lq, Lk] float32 or None, d_mod_aux all None): the
    Mosaic GPU dK/dV and dQ
    kernels (backward.py) from the forward's RowStats; dbias with a bias and
    ``cfg.bias_gradient``. Calls they cannot take raise; the table routes those elsewhere
    (``backward_unsupported``)."""
    from jax_impl.mosaic_gpu.backward import backward_call
    extras = extras or SinksAndDropout()
    reason = unsupported(CallFeatures.of(cfg, q, k, bias, masks, extras))
    reason = reason or _backward_refuses(cfg, bias is not None, q.shape[-1])
    if reason:
        raise ValueError(f"implementation='mosaic_gpu' cannot run this backward: {reason}")
    chosen = _backward_config(cfg, q.shape[-1], q.dtype)
    operands = (q, k, v, masks, d_out, stats, delta, extras.dropout_seeds, extras.dropout_offset,
                extras.mod_aux)
    (q, k, v, masks, d_out, stats, delta, seeds,
     dropout_offset, mod_aux) = vma.like(operands, vma.axes_of(*operands))
    interpret = None
    if cfg.interpret:
        from jax.experimental.pallas import mosaic_gpu as plgpu
        interpret = plgpu.InterpretGPUParams()
    else:
        q = platform.requires_cuda(q, PLATFORM_ERROR)
    dq, dk, dv, dbias = backward_call(
        cfg, chosen, q, k, v, d_out, stats, delta,
        masks.q_len, masks.kv_len, masks.position_offset, masks.q_segment_ids,
        masks.kv_segment_ids, seeds, dropout_offset, bias, masks.mask,
        block_mask=masks.block_mask, mod_aux=mod_aux, num_sms=_num_sms(), interpret=interpret)
    # The mod_aux cotangents are not summed in the kernels (implementations.py takes them
    # from the xla backward, as for pallas_triton's).
    return dq, dk, dv, dbias, tuple(None for _ in mod_aux)
