"""PyTorch implementations: torch_ref's manual attention, SDPA (automatic and each backend), flash_attn."""
from __future__ import annotations

import dataclasses

from conformance.adapters.base import Adapter
from conformance.runs import NotSupported, TorchPrepared


@dataclasses.dataclass(frozen=True)
class TorchManualAdapter(Adapter):
    """torch_ref.manual_attention in the case dtype."""

    def _prepare(self, inputs, *, backward):
        from torch_ref import manual_attention
        return TorchPrepared(manual_attention, inputs, backward=backward, device=self.device)


@dataclasses.dataclass(frozen=True)
class TorchSdpaAdapter(Adapter):
    backend: str = "auto"

    def _reason(self, case):
        if case.soft_cap is not None:
            return "SDPA has no logits soft cap"
        if self.device == "cpu" and self.backend in ("efficient", "cudnn"):
            return f"torch.sdpa.{self.backend}: no {self.backend} kernel for CPU"
        return None

    def _prepare(self, inputs, *, backward):
        import warnings
        from torch_ref import sdpa_attention
        backend = self.backend

        def attn(Q, K, V, **kw):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return sdpa_attention(Q, K, V, backend=backend, **kw)
        prepared = TorchPrepared(attn, inputs, backward=backward, device=self.device)
        try:
            prepared.trial()
        except RuntimeError as e:
            raise NotSupported(f"torch.sdpa.{backend}: {str(e)[:400]}") from e
        prepared.info["sdpa_backend"] = backend if backend != "auto" else _dispatched(prepared)
        return prepared


def _dispatched(prepared: TorchPrepared) -> str | None:
    """The backend SDPA's automatic choice runs for this call (torch_ref.probe_sdpa_backends)."""
    import torch
    from torch_ref import probe_sdpa_backends
    from torch_ref.sdpa import sdpa_arguments
    # in the run's grad mode: fused CPU kernels refuse some inputs that require grad
    with torch.set_grad_enabled(prepared._backward):
        q, k, v = prepared._q, prepared._k, prepared._v
        args = sdpa_arguments(q, k, v, backend="auto", **prepared.call_keywords())
        try:
            report = probe_sdpa_backends(q, k, v, attn_mask=args.get("attn_mask"),
                                         is_causal=args.get("is_causal", False),
                                         enable_gqa=args.get("enable_gqa", False), scale=args.get("scale"))
        except Exception as e:  # the probe must not take the run down
            return f"unknown ({type(e).__name__})"
    return report.get("dispatched")


@dataclasses.dataclass(frozen=True)
class FlashAttnAdapter(Adapter):
    """Dao-AILab flash_attn.flash_attn_func: CUDA, fp16/bf16, [B, L, H, D], causal bottom-right."""

    explicit_scale = "the adapter passes softmax_scale explicitly (flash_attn's default: 1/sqrt(D))"

    def _reason(self, case):
        if case.dtype == "float32":
            return "flash_attn takes fp16/bf16 only"
        if case.mask != "none" or case.bias or case.lengths or case.segments:
            return "flash_attn_func has no mask, bias, lengths or segment ids (varlen API not mapped)"
        if case.causal == "top_left" and case.q_len != case.kv_len and not case.native_causal:
            return "flash_attn's causal is bottom-right only"
        return None

    def _prepare(self, inputs, *, backward):
        from flash_attn import flash_attn_func
        c = inputs.case
        window = (-1, -1) if c.window is None else tuple(-1 if s is None else int(s) for s in c.window)

        def attn(Q, K, V, **_):  # torch_ref layout [B, H, L, D] -> flash_attn's [B, L, H, D]
            out = flash_attn_func(Q.transpose(1, 2), K.transpose(1, 2), V.transpose(1, 2),
                                  softmax_scale=c.effective_scale, causal=c.causal is not None,
                                  window_size=window, softcap=c.soft_cap or 0.0)
            return out.transpose(1, 2)
        prepared = TorchPrepared(attn, inputs, backward=backward, device=self.device, kwargs={})
        try:
            prepared.trial()
        except RuntimeError as e:
            raise NotSupported(f"flash_attn: {str(e)[:300]}") from e
        return prepared
