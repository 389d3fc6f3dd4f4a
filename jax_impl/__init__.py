"""FlashAttention for JAX: exact attention, tile by tile, with a recomputing custom VJP.

``jax_impl.flash_attention(q, k, v, ...)`` is the function (also importable as
``from jax_impl.flash_attention import flash_attention``).
"""
__version__ = "0.2.0.dev0"

from jax_impl.block_mask import BlockMask, create_block_mask
from jax_impl.config import BlockSizes
from jax_impl.context_parallel import hybrid_attention, ring_attention, ulysses_attention
from jax_impl import kv_cache
from jax_impl import flash_attention  # the module, callable as the function (see there)
from jax_impl.dropout_sinks import dropout_mask
from jax_impl.flash_attention import IMPLEMENTATIONS, ImplementationChoice, explain_implementation

__all__ = ["BlockMask", "BlockSizes", "IMPLEMENTATIONS", "ImplementationChoice", "dropout_mask",
           "create_block_mask", "explain_implementation", "flash_attention", "hybrid_attention", "kv_cache",
           "ring_attention", "ulysses_attention"]
