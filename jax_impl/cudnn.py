"""``implementation="cudnn"``: jax.nn.dot_product_attention's cuDNN kernel, reached by name.

It takes only the calls whose meaning is this library's (docs/semantics.md) as far as jax.nn
documents cuDNN's: float16/bfloat16, no mask or mask-like argument whose empty rows or
alignment cuDNN defines otherwise. Everything else is refused with the reason, never
reinterpreted. It is never chosen automatically: no conformance run on a GPU has passed it and
no committed table says it is faster (docs/limitations.md).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_impl.platform import CUDA_PLATFORMS

NAME = "cudnn"
DTYPES = (jnp.float16, jnp.bfloat16)


def unsupported(*, dtype, batch_dims: int, lq: int, lk: int, is_causal: bool, bottom_right: bool,
                has_window: bool, has_lengths: bool, has_mask: bool, has_segment_ids: bool,
                has_sinks: bool, soft_cap, dropout: bool, page_table: bool, block_sizes: bool,
                precision: bool, return_residual: bool, strategy: bool) -> str | None:
    """Why jax.nn's cuDNN path cannot run this call with this library's meaning, or None."""
    if jnp.dtype(dtype) not in DTYPES:
        return f"cuDNN attention takes float16/bfloat16 only; got {jnp.dtype(dtype).name}"
    if batch_dims > 1:
        return f"jax.nn takes one batch dim; got {batch_dims} (reshape to [B, L, H, D])"
    if is_causal and bottom_right and lq != lk:
        return "jax.nn's is_causal is top-left only (causal_alignment='bottom_right' with Lq != Lk)"
    refused = {
        # cuDNN's sliding window is left-only and its boundary is not documented as ours.
        "local_window_size": has_window,
        # Rows past a query length and rows with no valid key: cuDNN's output there is not
        # documented as this library's 0.
        "query_seq_lengths / key_value_seq_lengths": has_lengths,
        # jax.nn turns a mask into a large finite bias: a row with no allowed key averages V.
        "mask": has_mask,
        "q_segment_ids / kv_segment_ids": has_segment_ids,
        "attention_sinks": has_sinks,
        "logits_soft_cap": soft_cap is not None,
        "dropout": dropout,
        "page_table": page_table,
        "block_sizes": block_sizes,
        "precision": precision,
        "return_residual": return_residual,
        "context_parallel_strategy": strategy,
    }
    given = [name for name, present in refused.items() if present]
    if given:
        return f"jax.nn's cuDNN path takes none of: {', '.join(given)}"
    return None


def attention(q, k, v, bias, *, scale: float, is_causal: bool):
    """q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D], bias [Bb, Hb, Lq, Lk] or None -> [B, Lq, Hq, D].
    Differentiated by jax.nn's own cuDNN backward."""
    if jax.default_backend() not in CUDA_PLATFORMS:
        raise ValueError(f"implementation={NAME!r} runs jax.nn.dot_product_attention's cuDNN "
                         f"kernel, on a CUDA GPU only; JAX's default backend is "
                         f"{jax.default_backend()!r}")
    return jax.nn.dot_product_attention(q, k, v, bias, scale=scale, is_causal=is_causal,
                                        implementation="cudnn")
