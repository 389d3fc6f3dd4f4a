"""Independent numpy float64 attention (loops, the rules written out once more) and random cases.

Layout [B, H, L, D], like torch_ref.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from torch_ref import to_torch


def np_allowed(b, i, j, *, Lq, Lk, mask, is_causal, alignment, window, qlens, klens, qseg, kseg, h):
    qlen = Lq if qlens is None else int(qlens[b])
    klen = Lk if klens is None else int(klens[b])
    if not (i < qlen and j < klen):
        return False
    off = klen - qlen if alignment == "bottom_right" else 0
    if is_causal and not j <= i + off:
        return False
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        if left is not None and j < i + off - left:
            return False
        if right is not None and j > i + off + right:
            return False
    if qseg is not None and qseg[b, i] != kseg[b, j]:
        return False
    if mask is not None and not mask[b, h, i, j]:
        return False
    return True


def np_attention(q, k, v, *, scale=None, mask=None, bias=None, is_causal=False, causal_alignment="top_left",
                 local_window_size=None, query_seq_lengths=None, key_value_seq_lengths=None,
                 q_segment_ids=None, kv_segment_ids=None, logits_soft_cap=None):
    """Returns (out [B, Hq, Lq, Dv], lse [B, Hq, Lq]) in float64, row by row."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, Hq, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    full = (B, Hq, Lq, Lk)
    mask = None if mask is None else np.broadcast_to(mask, full)
    bias = None if bias is None else np.broadcast_to(np.asarray(bias, np.float64), full)
    out = np.zeros((B, Hq, Lq, Dv))
    lse = np.full((B, Hq, Lq), -np.inf)
    for b in range(B):
        for h in range(Hq):
            hk = h // (Hq // Hkv)
            for i in range(Lq):
                js = [j for j in range(Lk) if np_allowed(
                    b, i, j, Lq=Lq, Lk=Lk, mask=mask, is_causal=is_causal, alignment=causal_alignment,
                    window=local_window_size, qlens=query_seq_lengths, klens=key_value_seq_lengths,
                    qseg=q_segment_ids, kseg=kv_segment_ids, h=h)]
                if not js:
                    continue
                s = np.array([scale * float(np.dot(q[b, h, i], k[b, hk, j])) for j in js])
                if logits_soft_cap is not None:
                    s = logits_soft_cap * np.tanh(s / logits_soft_cap)
                if bias is not None:
                    s = s + bias[b, h, i, js]
                m = s.max()
                e = np.exp(s - m)
                out[b, h, i] = (e[:, None] * v[b, hk, js]).sum(0) / e.sum()
                lse[b, h, i] = m + math.log(e.sum())
    return out, lse


KINDS = ("none", "mask", "bias", "causal_tl", "causal_br", "window", "window_br", "lengths_br", "segments",
         "softcap", "everything")


def make_case(kind, B=2, Hq=4, Hkv=2, Lq=9, Lk=13, D=8, Dv=None, seed=0):
    """Random q, k, v (numpy float64, [B, H, L, D]) and numpy kwargs for one mask kind."""
    rng = np.random.default_rng(seed)
    Dv = D if Dv is None else Dv
    q = rng.standard_normal((B, Hq, Lq, D))
    k = rng.standard_normal((B, Hkv, Lk, D))
    v = rng.standard_normal((B, Hkv, Lk, Dv))
    kw = {}
    if kind in ("mask", "everything"):
        kw["mask"] = rng.random((B, 1 if kind == "everything" else Hq, Lq, Lk)) < 0.7
    if kind in ("bias", "everything"):
        kw["bias"] = rng.standard_normal((1, Hq, Lq, Lk))
    if kind in ("causal_tl",):
        kw["is_causal"] = True
    if kind in ("causal_br", "lengths_br", "everything"):
        kw["is_causal"] = True
        kw["causal_alignment"] = "bottom_right"
    if kind == "window":
        kw["local_window_size"] = 2
    if kind == "window_br":
        kw["local_window_size"] = (3, None)
        kw["causal_alignment"] = "bottom_right"
    if kind == "everything":
        kw["local_window_size"] = (4, 1)
    if kind in ("lengths_br", "everything"):
        kw["query_seq_lengths"] = rng.integers(1, Lq + 1, size=B)
        kw["key_value_seq_lengths"] = rng.integers(1, Lk + 1, size=B)
    if kind in ("segments", "everything"):
        kw["q_segment_ids"] = np.sort(rng.integers(0, 3, size=(B, Lq)), axis=1)
        kw["kv_segment_ids"] = np.sort(rng.integers(0, 3, size=(B, Lk)), axis=1)
    if kind in ("softcap", "everything"):
        kw["logits_soft_cap"] = 1.5
        q *= 3.0  # make the cap bite
    return q, k, v, kw


def torch_kwargs(kw, dtype=None, device="cpu"):
    """numpy kwargs -> torch; float arrays (bias) cast to dtype when given."""
    out = {}
    for name, x in kw.items():
        if isinstance(x, np.ndarray):
            t = to_torch(x, device)
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            out[name] = t
        else:
            out[name] = x
    return out


def row_ok(out_ref_lse):
    """Non-empty rows of a reference lse [B, Hq, Lq] (bool)."""
    return np.isfinite(out_ref_lse)
