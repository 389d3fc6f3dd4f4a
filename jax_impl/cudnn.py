"""``implementation="cudnn"``: jax.nn.dot_product_attention's cuDNN kernel, reached by name.

An entry of the implementation table like the others: ``unsupported`` takes only the calls
whose meaning is this library's (docs/semantics.md) as far as jax.nn documents cuDNN's:
float16/bfloat16, no mask or mask-like argument whose empty rows or alignment cuDNN defines
otherwise. Everything else is refused with the reason, never reinterpreted. It is never chosen
automatically: no conformance run on a GPU has passed it and no committed table says it is
faster (docs/limitations.md).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_impl.call_features import CallFeatures
from jax_impl.config import AttentionConfig
from jax_impl.platform import CUDA_PLATFORMS

NAME = "cudnn"
DTYPES = (jnp.float16, jnp.bfloat16)


def unsupported(features: CallFeatures) -> str | None:
    """Why jax.nn's cuDNN path cannot run this call with this library's meaning, or None."""
    cfg, spec = features.cfg, features.cfg.mask
    if features.dtype is not None and jnp.dtype(features.dtype) not in DTYPES:
        return f"cuDNN attention takes float16/bfloat16 only; got {jnp.dtype(features.dtype).name}"
    if features.batch_dims > 1:
        return f"jax.nn takes one batch dim; got {features.batch_dims} (reshape to [B, L, H, D])"
    if spec.is_causal and spec.bottom_right and features.lq != features.lk:
        return "jax.nn's is_causal is top-left only (causal_alignment='bottom_right' with Lq != Lk)"
    refused = {
        # cuDNN's sliding window is left-only and its boundary is not documented as ours.
        "local_window_size": spec.window_left is not None or spec.window_right is not None,
        # Rows past a query length and rows with no valid key: cuDNN's output there is not
        # documented as this library's 0.
        "query_seq_lengths / key_value_seq_lengths": spec.has_q_lengths or spec.has_kv_lengths,
        # jax.nn turns a mask into a large finite bias: a row with no allowed key averages V.
        "mask": features.has_mask,
        "q_segment_ids / kv_segment_ids": features.has_segment_ids,
        "attention_sinks": features.has_sinks,
        "logits_soft_cap": cfg.logits_soft_cap is not None,
        "dropout": bool(cfg.dropout_rate),
        "page_table": features.paged,
        "block_sizes": cfg.block_sizes is not None,
        "precision": cfg.precision != lax.Precision.HIGHEST,
        "return_residual": features.return_residual,
        "context_parallel_strategy": cfg.context_parallel_strategy is not None,
        "score_mod / mask_mod": cfg.has_mods,
        "block_mask": spec.has_block_mask,
    }
    given = [name for name, present in refused.items() if present]
    if given:
        return f"jax.nn's cuDNN path takes none of: {', '.join(given)}"
    return None


def attention(cfg: AttentionConfig, q, k, v, bias, masks, extras):
    """q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D], bias [Bb, Hb, Lq, Lk] or None -> (out
    [B, Lq, Hq, D], None: no logsumexp). Differentiated by jax.nn's own cuDNN backward."""
    del masks, extras  # none that cuDNN takes (unsupported refuses the rest)
    if jax.default_backend() not in CUDA_PLATFORMS:
        raise ValueError(f"implementation={NAME!r} runs jax.nn.dot_product_attention's cuDNN "
                         f"kernel, on a CUDA GPU only; JAX's default backend is "
                         f"{jax.default_backend()!r}")
    return jax.nn.dot_product_attention(q, k, v, bias, scale=cfg.scale, is_causal=cfg.mask.is_causal,
                                        implementation="cudnn"), None
