"""numpy <-> torch (bit-exact bf16) and running a torch attention function on numpy inputs
in the JAX layout [B, L, H, D], with gradients for a given cotangent."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

_BF16 = np.dtype(ml_dtypes.bfloat16)


def to_torch(x, device="cpu") -> torch.Tensor:
    """numpy (or anything np.asarray takes, e.g. a jax array) -> torch tensor, a copy.
    ml_dtypes.bfloat16 travels as its uint16 bits, so the round trip is bit-exact."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    a = np.asarray(x)
    if a.dtype == _BF16:
        bits = np.ascontiguousarray(a).view(np.uint16).astype(np.int16, copy=True)  # same bits
        return torch.from_numpy(bits).view(torch.bfloat16).to(device)
    return torch.from_numpy(np.array(a, copy=True, order="C")).to(device)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """torch tensor -> numpy; bfloat16 comes back as ml_dtypes.bfloat16 with the same bits."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().copy().view(np.uint16).view(_BF16)
    return t.numpy().copy()


def _is_array(x) -> bool:
    return isinstance(x, np.ndarray) or (
        not isinstance(x, (torch.Tensor, tuple, list, str, bytes)) and hasattr(x, "__array__") and hasattr(x, "shape")
    )


def _convert(v, device):
    if isinstance(v, np.generic):  # numpy scalar (scale, soft cap) -> Python number
        return v.item()
    if isinstance(v, tuple):  # (left, right) window entries
        return tuple(x.item() if isinstance(x, np.generic) else x for x in v)
    return to_torch(v, device) if _is_array(v) else v


def _convert_kwargs(kw: dict, device) -> dict:
    return {k: _convert(v, device) for k, v in kw.items()}


def _bhld(x: np.ndarray, device) -> torch.Tensor:  # [B, L, H, D] -> [B, H, L, D]
    return to_torch(x, device).transpose(1, 2).contiguous()


def _blhd(t: torch.Tensor) -> np.ndarray:  # [B, H, L, D] -> [B, L, H, D]
    return to_numpy(t.transpose(1, 2))


def _check_layout(q, k, v) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if np.ndim(x) != 4:
            raise ValueError(f"{name} must have the JAX layout [B, L, H, D] (4 dims), got shape {np.shape(x)}")
    if not (np.asarray(q).dtype == np.asarray(k).dtype == np.asarray(v).dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def attention_with_grads(attn_fn, q, k, v, cotangent, *, bias=None, device="cpu", **attn_kwargs) -> dict:
    """Runs attn_fn(Q, K, V, bias=..., **attn_kwargs) on torch [B, H, L, D] copies of
    q, k, v ([B, L, H, D] numpy) and back-propagates `cotangent` ([B, Lq, Hq, Dv], same dtype).

    Returns numpy {"out", "dq", "dk", "dv"} in [B, L, H, D] and the inputs' dtype, plus
    "dbias" (the bias's own shape and dtype) when a bias is given, "dsinks" likewise when
    ``attention_sinks`` is given. If attn_fn returns
    (out, lse), "lse" [B, Hq, Lq] is added (not differentiated).
    """
    _check_layout(q, k, v)
    if np.asarray(cotangent).dtype != np.asarray(q).dtype:
        raise TypeError(f"cotangent dtype {np.asarray(cotangent).dtype} must equal q dtype {np.asarray(q).dtype}")
    Q, K, V = (_bhld(x, device).requires_grad_() for x in (q, k, v))
    kw = _convert_kwargs(attn_kwargs, device)
    B = None
    if bias is not None:
        B = to_torch(bias, device).requires_grad_()
        kw["bias"] = B
    S = None
    if kw.get("attention_sinks") is not None:
        S = kw["attention_sinks"] = kw["attention_sinks"].detach().clone().requires_grad_()
    result = attn_fn(Q, K, V, **kw)
    lse = None
    if isinstance(result, tuple):
        result, lse = result[0], result[1]
    ct = _bhld(cotangent, device)
    if tuple(ct.shape) != tuple(result.shape):
        raise ValueError(f"cotangent shape {np.shape(cotangent)} must be the output's [B, Lq, Hq, Dv]")
    inputs = (Q, K, V) + ((B,) if B is not None else ()) + ((S,) if S is not None else ())
    grads = torch.autograd.grad(result, inputs, grad_outputs=ct, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]
    res = {"out": _blhd(result), "dq": _blhd(grads[0]), "dk": _blhd(grads[1]), "dv": _blhd(grads[2])}
    if B is not None:
        res["dbias"] = to_numpy(grads[3])
    if S is not None:
        res["dsinks"] = to_numpy(grads[-1])
    if lse is not None:
        res["lse"] = to_numpy(lse)
    return res


def attention_forward(attn_fn, q, k, v, *, bias=None, device="cpu", **kw) -> np.ndarray:
    """Forward only, no grad: numpy [B, L, H, D] in, numpy [B, Lq, Hq, Dv] out (inputs' dtype)."""
    _check_layout(q, k, v)
    kw = _convert_kwargs(kw, device)
    if bias is not None:
        kw["bias"] = to_torch(bias, device)
    with torch.no_grad():
        result = attn_fn(_bhld(q, device), _bhld(k, device), _bhld(v, device), **kw)
    if isinstance(result, tuple):
        result = result[0]
    return _blhd(result)
