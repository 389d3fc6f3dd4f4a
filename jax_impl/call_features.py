"""What of a call the implementations' rules judge: one description that every entry of the
implementation table (``implementations.py``) reads to say whether it can run the call."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_impl.config import AttentionConfig


class CallFeatures(NamedTuple):
    """A call, as the eligibility rules see it (arrays only by shape and dtype).

    ``cfg`` holds the static rest: the mask spec (causal, alignment, window, lengths, a
    block_mask), the soft cap, dropout, tiles, precision, interpret, the strategy and the mods.
    """

    cfg: AttentionConfig
    head_dim: int
    dtype: object = None            # of q (None: not judged)
    batch_dims: int = 1             # the caller's batch dims (flattened into one)
    lq: int | None = None
    lk: int | None = None           # logical keys (a paged cache: pages x page size)
    has_bias: bool = False
    has_mask: bool = False
    has_sinks: bool = False
    has_segment_ids: bool = False
    mod_aux: tuple = ()             # ShapeDtypeStructs of the mods' arrays (extras.mod_aux)
    block_mask_tiles: tuple | None = None  # (block_q, block_kv) of the block_mask, if any
    paged: bool = False             # a paged KV cache (page_table)
    return_residual: bool = False   # the logsumexp is returned too

    @classmethod
    def of(cls, cfg: AttentionConfig, q, k, bias, masks, extras, *, lk: int | None = None,
           batch_dims: int = 1, paged: bool = False,
           return_residual: bool = False) -> "CallFeatures":
        """The features of a call with q ``[B, Lq, Hq, D]`` and k (arrays or
        ShapeDtypeStructs), its bias, ``masking.MaskInputs`` and ``SinksAndDropout``."""
        mod_aux = () if extras is None else extras.mod_aux
        tiles = masks.block_mask
        return cls(cfg, q.shape[-1], jnp.dtype(q.dtype), batch_dims, q.shape[1],
                   k.shape[1] if lk is None else lk, bias is not None, masks.mask is not None,
                   extras is not None and extras.sinks is not None,
                   masks.q_segment_ids is not None,
                   tuple(jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in mod_aux),
                   None if tiles is None else (tiles.block_q, tiles.block_kv), paged,
                   return_residual)
