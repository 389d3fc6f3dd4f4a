"""torch.nn.functional.scaled_dot_product_attention with explicit backends (the classic
two SDPA wrappers, generalised to the project's semantics).

Returns SDPA's raw output: rows with no allowed key are NOT repaired, so a harness sees
what SDPA itself does there.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import _checks
from .manual import allowed_mask

SDPA_BACKENDS = ("auto", "math", "flash", "efficient", "cudnn")

BACKEND_ENUM = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


def _causal_bias_runs(Q, K, V, backend: str, gqa: bool) -> bool:
    """Whether causal_lower_right may stand for bottom-right causal (Lq != Lk) under `backend`.

    CausalBias picks its own kernel (CUDA flash, then CUDA efficient, else a materialised
    mask through SDPA) without looking at sdpa_kernel, and its fused paths ignore
    enable_gqa. So it is used for "auto" without GQA, and for a forced CUDA backend only
    when it would run exactly that backend; otherwise the dense mask goes through
    sdpa_kernel and the forced backend runs or refuses for real.
    """
    if gqa:
        return False
    if backend == "auto":
        return True
    if Q.device.type != "cuda" or backend not in ("flash", "efficient"):
        return False
    try:
        from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

        params = SDPAParams(Q, K, V, None, 0.0, False, False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            flash_ok = bool(can_use_flash_attention(params))
            eff_ok = bool(can_use_efficient_attention(params))
    except Exception:  # API differs in this torch: stay on the dense mask
        return False
    return flash_ok if backend == "flash" else (eff_ok and not flash_ok)


def sdpa_arguments(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    *,
    backend: str = "auto",
    scale=None,
    mask=None,
    bias=None,
    is_causal=False,
    causal_alignment="top_left",
    local_window_size=None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    logits_soft_cap=None,
) -> dict:
    """Validates and converts the project's arguments into SDPA keyword arguments
    (attn_mask, is_causal, scale, enable_gqa, dropout_p=0.0) for `backend`."""
    batch, num_q_heads, num_kv_heads, q_len, kv_len = _checks.check_qkv(Q, K, V)
    target = (batch, num_q_heads, q_len, kv_len)
    _checks.check_alignment(causal_alignment)
    _checks.check_bias(bias, target)
    _checks.check_soft_cap(logits_soft_cap)
    if logits_soft_cap is not None:
        raise NotImplementedError("SDPA has no logits soft cap")
    restricted = any(
        x is not None
        for x in (mask, local_window_size, query_seq_lengths, key_value_seq_lengths, q_segment_ids, kv_segment_ids)
    )
    kw = {"dropout_p": 0.0, "scale": scale}
    if num_q_heads != num_kv_heads:
        kw["enable_gqa"] = True
    if not restricted and bias is None:
        if is_causal and (causal_alignment == "top_left" or q_len == kv_len):
            kw["is_causal"] = True  # bottom_right equals top_left when Lq == Lk and no lengths
            return kw
        if is_causal and _causal_bias_runs(Q, K, V, backend, num_q_heads != num_kv_heads):
            from torch.nn.attention.bias import causal_lower_right

            with warnings.catch_warnings():  # "will produce NaNs when seq_len_q > seq_len_kv": known, reported by the harness
                warnings.simplefilter("ignore")
                kw["attn_mask"] = causal_lower_right(q_len, kv_len)
            return kw
        if not is_causal:
            return kw
    allowed = allowed_mask(
        batch, num_q_heads, q_len, kv_len,
        mask=mask, is_causal=is_causal, causal_alignment=causal_alignment,
        local_window_size=local_window_size, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, device=Q.device,
    )  # [B, Hq|1, Lq, Lk]
    if bias is None:
        kw["attn_mask"] = allowed
    else:  # float mask: bias where allowed, -inf elsewhere
        neg_inf = torch.full((), float("-inf"), dtype=Q.dtype, device=Q.device)
        kw["attn_mask"] = torch.where(allowed, bias.to(device=Q.device, dtype=Q.dtype), neg_inf)
    return kw


def _call_sdpa(Q, K, V, backend: str, kw: dict) -> torch.Tensor:
    if backend == "auto":
        return F.scaled_dot_product_attention(Q, K, V, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(BACKEND_ENUM[backend]):
                out = F.scaled_dot_product_attention(Q, K, V, **kw)
        except RuntimeError as e:
            reasons = [str(w.message) for w in caught]
            detail = f"{e}" + (f" | PyTorch warnings: {' | '.join(reasons)}" if reasons else "")
            raise RuntimeError(f"SDPA backend {backend!r} cannot run this case on {Q.device.type}: {detail}") from e
    for w in caught:  # re-emit what PyTorch said on success
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return out


def sdpa_attention(
    Q: torch.Tensor,  # [B, Hq, Lq, D]
    K: torch.Tensor,  # [B, Hkv, Lk, D]
    V: torch.Tensor,  # [B, Hkv, Lk, Dv]
    *,
    backend: str = "auto",
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    local_window_size=None,
    query_seq_lengths: torch.Tensor | None = None,
    key_value_seq_lengths: torch.Tensor | None = None,
    q_segment_ids: torch.Tensor | None = None,
    kv_segment_ids: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:  # [B, Hq, Lq, Dv]
    """SDPA on the project's semantics. `backend` in SDPA_BACKENDS; a forced backend runs
    under sdpa_kernel and, when it cannot run, raises RuntimeError keeping PyTorch's reason.

    Plain top-left causal (or bottom-right with Lq == Lk) -> is_causal=True; plain
    bottom-right causal -> causal_lower_right where that object runs the requested backend
    (see _causal_bias_runs); anything else -> one dense mask from allowed_mask (bool, or a
    float mask = bias where allowed and -inf elsewhere when a bias is given).
    """
    if backend not in SDPA_BACKENDS:
        raise ValueError(f"backend must be one of {SDPA_BACKENDS}, got {backend!r}")
    kw = sdpa_arguments(
        Q, K, V, backend=backend, scale=scale, mask=mask, bias=bias, is_causal=is_causal,
        causal_alignment=causal_alignment, local_window_size=local_window_size,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, logits_soft_cap=logits_soft_cap,
    )
    return _call_sdpa(Q, K, V, backend, kw)


def sdpa_causal_attention(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, **kw) -> torch.Tensor:
    """The causal wrapper: sdpa_attention with is_causal=True."""
    return sdpa_attention(Q, K, V, is_causal=True, **kw)
