"""PyTorch side of every comparison and the float64 oracle. Layout [B, H, L, D]."""

from .bridge import attention_forward, attention_with_grads, to_numpy, to_torch
from .manual import allowed_mask, manual_attention, paged_attention
from .probe import probe_sdpa_backends
from .sdpa import SDPA_BACKENDS, sdpa_attention, sdpa_causal_attention

__all__ = [
    "manual_attention",
    "paged_attention",
    "allowed_mask",
    "sdpa_attention",
    "sdpa_causal_attention",
    "probe_sdpa_backends",
    "attention_with_grads",
    "attention_forward",
    "to_torch",
    "to_numpy",
    "SDPA_BACKENDS",
]
