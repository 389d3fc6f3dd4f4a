"""Which SDPA backends can run a case, in PyTorch's own words, and which one the automatic
call picks."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .sdpa import BACKEND_ENUM

_ENUM_TO_NAME = {v: k for k, v in BACKEND_ENUM.items()}

# fused aten ops each backend runs; the math backend decomposes into plain ops
_FUSED_OPS = {
    "_scaled_dot_product_flash_attention_for_cpu": "flash",
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
}

# order used only when neither _fused_sdp_choice nor the profiler answers
_PRIORITY = {"cpu": ("flash", "math"), "cuda": ("flash", "efficient", "cudnn", "math")}


def _try_backend(name: str, Q, K, V, kw: dict) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error = None
        try:
            with sdpa_kernel(BACKEND_ENUM[name]):
                out = F.scaled_dot_product_attention(Q, K, V, **kw)
            del out
        except (RuntimeError, NotImplementedError, ValueError, TypeError) as e:
            error = f"{type(e).__name__}: {e}"
    said = [str(w.message).strip() for w in caught]
    said = [s for s in said if s]
    if error is None:
        return {"eligible": True, "reason": " | ".join(said) if said else "ran"}
    parts = said + [error]
    if not said and Q.device.type == "cpu" and name in ("efficient", "cudnn"):
        parts.insert(0, f"no {name} kernel for device cpu in this build")
    return {"eligible": False, "reason": " | ".join(parts)}


def _fused_choice(Q, K, V, kw: dict) -> str | None:
    try:
        idx = torch._fused_sdp_choice(
            Q, K, V, kw["attn_mask"], kw["dropout_p"], kw["is_causal"], scale=kw["scale"], enable_gqa=kw["enable_gqa"]
        )
        return _ENUM_TO_NAME.get(SDPBackend(int(idx)))
    except Exception:  # private API: absent or changed in this torch
        return None


def _observed_choice(Q, K, V, kw: dict) -> tuple[str | None, str | None]:
    """Runs the automatic call under a dispatch mode that records the aten ops it reaches.
    Returns (backend or None, error text if the automatic call itself raised)."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:
        return None, None

    class _Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(getattr(getattr(func, "overloadpacket", func), "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    rec = _Recorder()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with rec:
                F.scaled_dot_product_attention(Q, K, V, **kw)
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as e:
        return None, f"{type(e).__name__}: {e}"
    except Exception:  # the recorder itself failed on this torch
        return None, None
    for op in rec.ops:
        if op in _FUSED_OPS:
            return _FUSED_OPS[op], None
    return ("math" if rec.ops else None), None


def probe_sdpa_backends(
    Q: torch.Tensor,  # [B, Hq, Lq, D]
    K: torch.Tensor,  # [B, Hkv, Lk, D]
    V: torch.Tensor,  # [B, Hkv, Lk, Dv]
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    enable_gqa: bool = False,
    scale: float | None = None,
) -> dict:
    """For each of math/flash/efficient/cudnn: {"eligible", "reason"} from forcing that backend
    (PyTorch's warnings and error text). "dispatched": the backend the automatic call picks,
    as seen by recording the aten ops the automatic call reaches (a fused op, or plain ops =
    math), checked against torch._fused_sdp_choice (the observation wins on disagreement),
    else by elimination; None when the automatic call itself raises. "dispatched_source"
    says which answered.
    The probe runs each eligible backend once (forward only, in the caller's grad mode)."""
    kw = {"attn_mask": attn_mask, "dropout_p": 0.0, "is_causal": is_causal, "scale": scale, "enable_gqa": enable_gqa}
    report: dict = {name: _try_backend(name, Q, K, V, kw) for name in BACKEND_ENUM}
    observed, auto_error = _observed_choice(Q, K, V, kw)
    chosen = _fused_choice(Q, K, V, kw)
    if auto_error is not None:
        report["dispatched"], report["dispatched_source"] = None, f"the automatic call raised {auto_error}"
    elif observed is not None:
        report["dispatched"], report["dispatched_source"] = observed, "aten ops observed"
        if chosen is not None and chosen != observed:
            report["dispatched_source"] += f" (torch._fused_sdp_choice said {chosen})"
    elif chosen is not None:
        report["dispatched"], report["dispatched_source"] = chosen, "torch._fused_sdp_choice"
    else:
        order = _PRIORITY.get(Q.device.type, ("math",))
        eligible = [n for n in order if report[n]["eligible"]]
        report["dispatched"] = eligible[0] if eligible else None
        report["dispatched_source"] = "elimination"
    return report
