"""Pallas Mosaic TPU FlashAttention: the forward kernel (forward.py) and, once backward.py is
there, its dK/dV and dQ kernels; until then the backward is ``xla.backward``, which recomputes
P from the same natural-log RowStats.

``forward`` and ``backward`` keep the contract of ``implementations.py`` (RowStats: an empty
row has max = +inf and log_sum = 0). ``unsupported`` names every feature of a call that the
kernels do not take (the automatic choice then runs xla); ``unavailable`` says why the kernels
cannot be offered in this installation.

The non-finite rule (online_softmax) costs one XLA pass over q, k and v before the kernel, as
for the Mosaic GPU kernel (``jax_impl.mosaic_gpu._nonfinite_rule``): q's rows that hold a
non-finite value become all NaN, k's rows take their key's poison, v's non-finite entries 0.

A score_mod or mask_mod that reads mod_aux arrays (gathers the kernel does not make) runs as
``xla.forward`` and ``xla.backward`` (the same contract and RowStats); mods that read only the
indices are traced into the kernel.
"""
from __future__ import annotations

import jax.numpy as jnp

from jax_impl import masking, online_softmax, xla
from jax_impl.config import AttentionConfig, BlockSizes
from jax_impl.dropout_sinks import SinksAndDropout
from jax_impl.mosaic_tpu import common

__all__ = ["forward", "backward", "unsupported", "unavailable", "DTYPES", "PLATFORM_ERROR"]

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
PLATFORM_ERROR = (
    "implementation='mosaic_tpu' runs only on a TPU (the call is being lowered for "
    "{platform!r}). Use implementation='xla' on any device, implementation=None to choose "
    "automatically, or interpret=True to run the kernel in the TPU interpreter.")


def _import_error() -> str | None:
    try:
        from jax.experimental.pallas import tpu as pltpu  # noqa: F401
        from jax_impl.mosaic_tpu import forward as _  # noqa: F401
    except Exception as e:  # ImportError, or an API that moved
        return f"jax.experimental.pallas.tpu cannot be used here: {type(e).__name__}: {e}"
    return None


_UNAVAILABLE = _import_error()


def unavailable() -> str | None:
    """Why the kernels cannot be offered in this installation, or None."""
    return _UNAVAILABLE


def unsupported(*, head_dim: int, cfg: AttentionConfig | None = None, has_bias: bool = False,
                has_mask: bool = False, has_sinks: bool = False, dtype=None,
                has_segment_ids: bool = False) -> str | None:
    """Why the Mosaic TPU forward cannot run such a call, or None; every feature it does not
    take is named. It takes causal (both alignments), windows, lengths, segment ids, GQA/MQA,
    the soft cap, block_mask, mask_mod and score_mod (without mod_aux), sinks, position
    offsets, a dense mask and a bias."""
    del head_dim, has_bias, has_mask, has_sinks, has_segment_ids  # any head_dim: a full block
    if _UNAVAILABLE:
        return _UNAVAILABLE
    if dtype is not None and jnp.dtype(dtype) not in DTYPES:
        return f"dtype {jnp.dtype(dtype)} is not bfloat16 or float32"
    if cfg is None:
        return None
    if cfg.dropout_rate:
        return "dropout is not in the Mosaic TPU kernel yet (xla runs it)"
    reason = common.precision_unsupported(cfg, dtype)
    if reason:
        return reason
    if cfg.block_sizes is not None:
        if not isinstance(cfg.block_sizes, BlockSizes):
            return (f"block_sizes is a {type(cfg.block_sizes).__name__}; the Mosaic TPU kernel "
                    "takes jax_impl.BlockSizes (its block_q and block_k)")
        for name in ("block_q", "block_k"):
            value = getattr(cfg.block_sizes, name)
            if value % common.NUM_LANES:
                return (f"BlockSizes.{name}={value} is not a multiple of {common.NUM_LANES} "
                        "(the TPU's lanes)")
    return None


def block_shape(cfg: AttentionConfig, lq: int, lk: int) -> tuple[int, int]:
    """The forward's (block_q, block_k) for sequences of Lq and Lk."""
    from jax_impl.mosaic_tpu.forward import block_shape as forward_block_shape
    return forward_block_shape(cfg, lq, lk)


def forward(cfg: AttentionConfig, q, k, v, bias, masks: masking.MaskInputs, extras=None):
    """q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D] -> (out [B, Lq, Hq, D], RowStats [B, Hq, Lq] f32)."""
    from jax.experimental.pallas import tpu as pltpu

    from jax_impl.mosaic_gpu import _nonfinite_rule
    from jax_impl.mosaic_tpu.forward import forward_call
    extras = extras or SinksAndDropout()
    reason = unsupported(head_dim=q.shape[-1], cfg=cfg, dtype=q.dtype)
    if reason:
        raise ValueError(f"implementation='mosaic_tpu' cannot run this call: {reason}")
    if extras.mod_aux:  # a mod's gathers from mod_aux are not in the kernel (module docstring)
        return xla.forward(cfg, q, k, v, bias, masks, extras)
    if bias is not None and jnp.dtype(bias.dtype).itemsize > 4:
        bias = bias.astype(jnp.float32)  # the logits are float32 (the reference's cast too)
    q, k, v = _nonfinite_rule(q, k, v)
    out, row_max, log_sum = forward_call(
        cfg, q, k, v, masks, bias, extras.sinks,
        interpret=pltpu.InterpretParams() if cfg.interpret else None)
    return out, online_softmax.RowStats(row_max, log_sum)


def _backward(extras: SinksAndDropout | None):
    """backward.py's ``backward`` where it exists, else (and for mods with mod_aux, whose
    forward is xla's) ``xla.backward``, which reads the same RowStats."""
    if extras is not None and extras.mod_aux:
        return xla.backward
    try:
        from jax_impl.mosaic_tpu.backward import backward as kernels
    except ImportError:
        return xla.backward
    return kernels


def backward(cfg: AttentionConfig, q, k, v, bias, masks, stats, d_out, delta, extras=None):
    """-> (dq, dk, dv, dbias or None, d_mod_aux): see ``_backward``."""
    return _backward(extras)(cfg, q, k, v, bias, masks, stats, d_out, delta, extras)

