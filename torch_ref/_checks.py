"""Input validation shared by manual_attention, allowed_mask and sdpa_attention.

Every error names the argument and the rule it breaks.
"""

from __future__ import annotations

import numbers

import torch

CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")


def check_qkv(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Checks Q [B, Hq, Lq, D], K [B, Hkv, Lk, D], V [B, Hkv, Lk, Dv]; returns (B, Hq, Hkv, Lq, Lk)."""
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape [B, H, L, D] (4 dims), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    if not (Q.dtype == K.dtype == V.dtype):
        raise TypeError(f"Q, K, V must share one dtype, got {Q.dtype=}, {K.dtype=}, {V.dtype=}")
    if not (Q.device == K.device == V.device):
        raise ValueError(f"Q, K, V must be on one device, got {Q.device=}, {K.device=}, {V.device=}")
    batch, num_q_heads, q_len, head_dim = Q.shape
    if K.shape[0] != batch or V.shape[0] != batch:
        raise ValueError(f"batch sizes differ: Q {batch}, K {K.shape[0]}, V {V.shape[0]}")
    num_kv_heads, kv_len = K.shape[1], K.shape[2]
    if V.shape[1] != num_kv_heads or V.shape[2] != kv_len:
        raise ValueError(f"K {tuple(K.shape)} and V {tuple(V.shape)} must agree on [B, Hkv, Lk]")
    if K.shape[3] != head_dim:
        raise ValueError(f"K head_dim {K.shape[3]} must equal Q head_dim {head_dim}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"{num_q_heads=} must be a multiple of {num_kv_heads=}")
    if q_len < 1 or kv_len < 1:
        raise ValueError(f"sequence lengths must be >= 1, got {q_len=}, {kv_len=}")
    return batch, num_q_heads, num_kv_heads, q_len, kv_len


def check_broadcastable(name: str, t: torch.Tensor, target: tuple[int, ...]) -> None:
    if t.dim() > len(target):
        raise ValueError(f"{name} has {t.dim()} dims, must be broadcastable to [B, Hq, Lq, Lk] = {list(target)}")
    try:
        out = torch.broadcast_shapes(tuple(t.shape), target)
    except RuntimeError as e:
        raise ValueError(f"{name} shape {tuple(t.shape)} is not broadcastable to [B, Hq, Lq, Lk] = {list(target)}") from e
    if tuple(out) != tuple(target):
        raise ValueError(f"{name} shape {tuple(t.shape)} is not broadcastable to [B, Hq, Lq, Lk] = {list(target)}")


def check_mask(mask, target: tuple[int, ...]) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor of dtype bool, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must have dtype bool (True = may attend), got {mask.dtype=}; pass additive scores as bias")
    check_broadcastable("mask", mask, target)


def check_bias(bias, target: tuple[int, ...]) -> None:
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a floating torch.Tensor, got {type(bias).__name__}")
    if not bias.is_floating_point():
        raise TypeError(f"bias must be a floating tensor, got {bias.dtype=}; pass a boolean mask as mask")
    check_broadcastable("bias", bias, target)


def check_alignment(causal_alignment) -> None:
    if causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {CAUSAL_ALIGNMENTS}, got {causal_alignment!r}")


def normalize_window(local_window_size) -> tuple[int | None, int | None] | None:
    """int w -> (w, w); (left, right) with None = unbounded on that side; None -> None."""
    if local_window_size is None:
        return None
    if isinstance(local_window_size, bool):
        raise TypeError(f"local_window_size must be an int or a (left, right) tuple, got {local_window_size!r}")
    if isinstance(local_window_size, numbers.Integral):
        left = right = local_window_size
    elif isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2:
        left, right = local_window_size
    else:
        raise TypeError(f"local_window_size must be an int or a (left, right) tuple, got {local_window_size!r}")
    for side, w in (("left", left), ("right", right)):
        if w is None:
            continue
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            raise TypeError(f"local_window_size {side} entry must be an int or None, got {w!r}")
        if w < 0:
            raise ValueError(f"local_window_size {side} entry must be >= 0, got {w}")
    return (None if left is None else int(left)), (None if right is None else int(right))


def check_lengths(name: str, lengths, batch: int, max_len: int) -> None:
    if lengths is None:
        return
    if not isinstance(lengths, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor of shape [B]={[batch]}, got {type(lengths).__name__}")
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype, got {lengths.dtype}")
    if tuple(lengths.shape) != (batch,):
        raise ValueError(f"{name} must have shape [B]={[batch]}, got {list(lengths.shape)}")
    if bool((lengths < 0).any()) or bool((lengths > max_len).any()):
        raise ValueError(f"{name} values must lie in [0, {max_len}], got {lengths.tolist()}")


def check_segments(q_segment_ids, kv_segment_ids, batch: int, q_len: int, kv_len: int) -> None:
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together (both or neither)")
    if q_segment_ids is None:
        return
    for name, t, length in (("q_segment_ids", q_segment_ids, q_len), ("kv_segment_ids", kv_segment_ids, kv_len)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be an integer torch.Tensor of shape [B, L], got {type(t).__name__}")
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"{name} must have an integer dtype, got {t.dtype}")
        if tuple(t.shape) != (batch, length):
            raise ValueError(f"{name} must have shape [B, L]={[batch, length]}, got {list(t.shape)}")


def check_soft_cap(logits_soft_cap) -> None:
    if logits_soft_cap is None:
        return
    if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, numbers.Real) or not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be a positive number or None, got {logits_soft_cap!r}")
