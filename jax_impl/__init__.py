"""FlashAttention for JAX: exact attention, tile by tile, with a recomputing custom VJP.

The function is ``jax_impl.flash_attention.flash_attention``.
"""
from jax_impl.config import BlockSizes
from jax_impl.context_parallel import ring_attention
from jax_impl.flash_attention import IMPLEMENTATIONS, ImplementationChoice, explain_implementation

__all__ = ["BlockSizes", "IMPLEMENTATIONS", "ImplementationChoice", "explain_implementation",
           "ring_attention"]
