"""Manual attention (scores = Q K^T * scale, softmax, times V), generalised to every mask rule.

Runs in the inputs' dtype: in float64 it is the project's oracle; in fp16/bf16 it is the
"plain same-dtype implementation" whose error sets the conformance tolerance.
Layout [B, H, L, D]. Semantics: docs/semantics.md. Written from those rules alone: it shares
no code with jax_impl.
"""

from __future__ import annotations

import math

import torch

from . import _checks


def allowed_mask(
    batch: int,
    num_q_heads: int,
    q_len: int,
    kv_len: int,
    *,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    local_window_size=None,
    query_seq_lengths: torch.Tensor | None = None,
    key_value_seq_lengths: torch.Tensor | None = None,
    q_segment_ids: torch.Tensor | None = None,
    kv_segment_ids: torch.Tensor | None = None,
    device=None,
) -> torch.Tensor:
    """Bool [B, Hq|1, Lq, Lk]: True where query i of head h may attend key j.

    A pair is allowed when every rule holds: i < qlen[b] and j < klen[b]; with
    offset[b] = 0 (top_left) or klen[b] - qlen[b] (bottom_right), causal j <= i + offset[b];
    window i + offset[b] - left <= j <= i + offset[b] + right; equal segment ids; mask True.
    The head dim is Hq only when `mask` carries one.
    """
    target = (batch, num_q_heads, q_len, kv_len)
    _checks.check_alignment(causal_alignment)
    window = _checks.normalize_window(local_window_size)
    _checks.check_mask(mask, target)
    _checks.check_lengths("query_seq_lengths", query_seq_lengths, batch, q_len)
    _checks.check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch, kv_len)
    _checks.check_segments(q_segment_ids, kv_segment_ids, batch, q_len, kv_len)
    if device is None:
        device = mask.device if mask is not None else "cpu"

    i = torch.arange(q_len, device=device).view(1, q_len, 1)  # [1, Lq, 1]
    j = torch.arange(kv_len, device=device).view(1, 1, kv_len)  # [1, 1, Lk]
    if query_seq_lengths is None:
        qlen = torch.full((batch, 1, 1), q_len, device=device, dtype=torch.int64)
    else:
        qlen = query_seq_lengths.to(device=device, dtype=torch.int64).view(batch, 1, 1)
    if key_value_seq_lengths is None:
        klen = torch.full((batch, 1, 1), kv_len, device=device, dtype=torch.int64)
    else:
        klen = key_value_seq_lengths.to(device=device, dtype=torch.int64).view(batch, 1, 1)

    ok = (i < qlen) & (j < klen)  # [B, Lq, Lk]
    offset = klen - qlen if causal_alignment == "bottom_right" else torch.zeros_like(qlen)
    diag = i + offset  # [B, Lq, 1]: key index on the query's diagonal
    if is_causal:
        ok = ok & (j <= diag)
    if window is not None:
        left, right = window
        if left is not None:
            ok = ok & (j >= diag - left)
        if right is not None:
            ok = ok & (j <= diag + right)
    if q_segment_ids is not None:
        qs = q_segment_ids.to(device).unsqueeze(2)  # [B, Lq, 1]
        ks = kv_segment_ids.to(device).unsqueeze(1)  # [B, 1, Lk]
        ok = ok & (qs == ks)
    ok = ok.unsqueeze(1)  # [B, 1, Lq, Lk]
    if mask is not None:
        ok = ok & mask.to(device)
    return ok


class _ZeroNonFinite(torch.autograd.Function):
    """x with its NaN/inf entries as 0, and the gradient passed through unchanged: such an
    entry gets the gradient of its row (NaN where its row attends anything, as the arithmetic
    of a NaN row gives), not the 0 that a select would."""

    @staticmethod
    def forward(ctx, x):
        return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))

    @staticmethod
    def backward(ctx, grad):
        return grad


def _resolve_scale(scale, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def manual_attention(
    Q: torch.Tensor,  # [B, Hq, Lq, D]
    K: torch.Tensor,  # [B, Hkv, Lk, D]
    V: torch.Tensor,  # [B, Hkv, Lk, Dv]
    *,
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
    attention_sinks: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    dropout_rate: float = 0.0,
    return_lse: bool = False,
):
    """Dense softmax attention in the inputs' dtype; returns out [B, Hq, Lq, Dv] (and lse [B, Hq, Lq]).

    attention_sinks: [Hq] or [B, Hq] logits, one more softmax column per row that carries no
    value (the lse includes it; a row with no allowed key then gives output 0).
    dropout_mask: bool keep mask broadcastable to [B, Hq, Lq, Lk]; the softmax probabilities
    are multiplied by it and scaled by 1 / (1 - dropout_rate) before they meet V.

    A query row with no allowed key, or whose allowed logits are all -inf (an additive -inf
    bias), gives output 0, lse -inf and zero gradients (no NaN). A non-finite value in Q, K or
    V reaches a row only through a pair that row may attend (then the row is NaN, and so are
    its dS and, through them, its dq and the dk, dv of the keys it attends); at any other
    position it has no effect. The lse is in the inputs' dtype.
    """
    batch, num_q_heads, num_kv_heads, q_len, kv_len = _checks.check_qkv(Q, K, V)
    target = (batch, num_q_heads, q_len, kv_len)
    _checks.check_bias(bias, target)
    _checks.check_soft_cap(logits_soft_cap)
    allowed = allowed_mask(
        batch, num_q_heads, q_len, kv_len,
        mask=mask, is_causal=is_causal, causal_alignment=causal_alignment,
        local_window_size=local_window_size, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, device=Q.device,
    )  # [B, Hq|1, Lq, Lk]

    group = num_q_heads // num_kv_heads
    if group > 1:  # query head h reads kv head h // group
        K = K.repeat_interleave(group, dim=1)
        V = V.repeat_interleave(group, dim=1)
    # Non-finite entries are computed with as 0 and marked: a pair touching a non-finite query,
    # key or value row gets a NaN added to its logit, which matters only where the pair is
    # allowed. Added, not substituted: the NaN reaches that pair's dS and so dq and dk, as the
    # arithmetic would (an allowed NaN pair makes its row's gradients NaN, not 0).
    finite = lambda x: torch.isfinite(x).all(dim=-1)  # [B, H, L]
    bad_pair = ~finite(Q)[..., :, None] | ~(finite(K) & finite(V))[..., None, :]
    Q, K, V = map(_ZeroNonFinite.apply, (Q, K, V))
    s = (Q @ K.transpose(-2, -1)) * _resolve_scale(scale, Q.shape[-1])  # [B, Hq, Lq, Lk]
    if logits_soft_cap is not None:
        cap = float(logits_soft_cap)
        s = cap * torch.tanh(s / cap)
    if bias is not None:
        s = s + bias.to(s.dtype)
    s = s + torch.where(bad_pair, float("nan"), 0.0).to(s.dtype)
    allowed = allowed & (s != float("-inf"))  # an additive -inf bias excludes the pair

    if attention_sinks is not None:
        # The sink is one more column of every row: no row is empty, unless the sink is -inf
        # (no sink) and the row has no allowed key; such a row computes on finite zeros, as below.
        sink = attention_sinks.to(s.dtype).expand(batch, num_q_heads)[:, :, None, None]
        row_ok = allowed.any(dim=-1, keepdim=True) | (sink > float("-inf"))  # [B, Hq, Lq, 1]
        fill = torch.where(row_ok, float("-inf"), 0.0).to(s.dtype)
        s_ext = torch.cat([torch.where(allowed, s, fill),
                           torch.where(row_ok, sink, 0.0).expand(batch, num_q_heads, q_len, 1)], dim=-1)
        p = torch.softmax(s_ext, dim=-1)[..., :-1]
        # Exactly 0 where not allowed, also in a NaN row (softmax would spread its NaN there).
        p = torch.where(allowed, p, torch.zeros((), dtype=p.dtype, device=p.device))
        lse = torch.logsumexp(s_ext, dim=-1)
    else:
        row_ok = allowed.any(dim=-1, keepdim=True)  # [B, Hq|1, Lq, 1]
        # Disallowed keys get -inf in rows that have an allowed key, and a finite 0 in empty
        # rows, so softmax and logsumexp stay finite there (forward and backward); the empty
        # rows are then set to exactly 0 / -inf by a where, which passes zero gradient.
        fill = torch.where(row_ok, float("-inf"), 0.0).to(s.dtype)
        s_safe = torch.where(allowed, s, fill)
        p = torch.softmax(s_safe, dim=-1)
        # 0 in empty rows, and exactly 0 at every pair not allowed, also in a NaN row (softmax
        # would spread its NaN to the whole row); the where passes them zero gradient.
        p = torch.where(allowed, p, torch.zeros((), dtype=p.dtype, device=p.device))
        lse = torch.logsumexp(s_safe, dim=-1)  # [B, Hq, Lq]
    if dropout_mask is not None:
        # A product, not a select: a dropped pair of a NaN row leaves the row NaN, as the
        # normalisation after the product (FlashAttention's) gives.
        keep = dropout_mask.to(device=p.device, dtype=torch.bool)
        p = p * (keep.to(p.dtype) / (1.0 - float(dropout_rate)))
    out = p @ V  # [B, Hq, Lq, Dv]
    if not return_lse:
        return out
    lse = torch.where(row_ok.squeeze(-1), lse, torch.full((), float("-inf"), dtype=lse.dtype, device=lse.device))
    return out, lse


def paged_attention(
    Q: torch.Tensor,           # [B, Hq, Lq, D]
    K_pages: torch.Tensor,     # [num_pages, page_size, Hkv, D]
    V_pages: torch.Tensor,     # [num_pages, page_size, Hkv, Dv]
    page_table: torch.Tensor,  # [B, pages_per_sequence] integer page ids
    **kwargs,
):
    """``manual_attention`` against a paged KV cache: row b's logical key j is slot
    ``j % page_size`` of page ``page_table[b, j // page_size]``. The pages are gathered into a
    dense [B, Hkv, pages_per_sequence * page_size, D] cache first (the oracle may copy)."""
    if K_pages.dim() != 4 or K_pages.shape[:3] != V_pages.shape[:3]:
        raise ValueError(f"K_pages/V_pages must be [num_pages, page_size, Hkv, D]; got "
                         f"{tuple(K_pages.shape)} {tuple(V_pages.shape)}")
    if page_table.dim() != 2 or page_table.shape[0] != Q.shape[0]:
        raise ValueError(f"page_table must be [B={Q.shape[0]}, pages_per_sequence]; got {tuple(page_table.shape)}")
    num_pages = K_pages.shape[0]
    ids = page_table.long().to(K_pages.device)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_pages):
        raise ValueError(f"page ids must lie in [0, {num_pages})")
    batch, per_sequence = ids.shape

    def dense(pages):  # [B, P, page_size, H, D] -> [B, H, P * page_size, D]
        gathered = pages.index_select(0, ids.reshape(-1)).reshape(batch, per_sequence * pages.shape[1],
                                                                  *pages.shape[2:])
        return gathered.permute(0, 2, 1, 3)

    return manual_attention(Q, dense(K_pages), dense(V_pages), **kwargs)
