"""Pallas Mosaic TPU FlashAttention (placeholder until the forward lands)."""
