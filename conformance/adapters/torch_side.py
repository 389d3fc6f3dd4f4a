"""PyTorch implementations: torch_ref's manual attention, SDPA (automatic and each backend),
FlexAttention (eager and compiled), flash_attn."""
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


@dataclasses.dataclass(frozen=True)
class TorchFlexAdapter(Adapter):
    """PyTorch's ``torch.nn.attention.flex_attention``, eager (its unfused implementation, which
    materialises the scores) or ``torch.compile``d (its generated kernel). The case's mods run as
    FlexAttention's own (the definitions of conformance/mods.py with ``torch``, mod_aux captured);
    the case's other mask rules (causal, window, lengths, segments, bool mask) as a mask_mod that
    reads their dense pattern, its soft cap and bias in the score_mod before the case's.

    Where PyTorch refuses the q, k, v backward (on CPU: "FlexAttention does not support backward
    on CPU"), the gradients of the captured tensors (bias, float mod_aux) are still judged, as
    far as it computes them; ``info["not_differentiated"]`` says what is left out and why."""

    compiled: bool = False
    mods_ok = True

    def _reason(self, case):
        if case.native_causal:
            return "FlexAttention has no causal flag of its own (a mask_mod says which diagonal)"
        return None

    def _prepare(self, inputs, *, backward):
        attn = _flex(inputs, self.device, self.compiled)

        def prepared(**how):
            p = TorchPrepared(attn, inputs, device=self.device, kwargs={}, **how)
            p.trial()
            return p
        try:
            return _or_not_supported(self.name, lambda: prepared(backward=backward))
        except NotImplementedError as e:  # PyTorch refuses the q, k, v backward here
            if not backward:
                raise
            refused = f"{self.name}: {e}"
        captured = inputs.bias is not None or any(x.dtype.kind == "f" for x in inputs.mod_aux.values())
        if captured:
            try:
                p = prepared(backward=True, grad_qkv=False)
                p.info["not_differentiated"] = refused
                return p
            except RuntimeError as e:  # its refusal of them (compiled on CPU: an Inductor error)
                refused += f"; the captured tensors' gradients: {type(e).__name__}: {_first_line(e)}"
        p = _or_not_supported(self.name, lambda: prepared(backward=False))
        p.info["not_differentiated"] = refused
        return p


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:300] if lines else ""


def _or_not_supported(name: str, prepare):
    """``prepare()``; torch.compile's refusal (a dynamo or Inductor error) becomes NotSupported,
    except a NotImplementedError that flex_attention raised while dynamo traced it (e.g. no
    backward on CPU), which stays one, as the eager call raises it."""
    import torch._dynamo.exc
    try:
        return prepare()
    except torch._dynamo.exc.TorchDynamoException as e:
        if isinstance(e.__cause__, torch._dynamo.exc.ObservedNotImplementedError):
            raise NotImplementedError(str(e.__cause__)) from e
        raise NotSupported(f"{name}: {type(e).__name__}: {_first_line(e)}") from e


def _flex(inputs, device: str, compiled: bool):
    """``attn(Q, K, V, bias=None, mod_aux=(), **_)`` calling flex_attention for the case."""
    import warnings

    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from conformance.mods import bound
    from torch_ref import to_torch

    c, mods = inputs.case, inputs.mods
    full = (c.batch, c.q_heads, c.q_len, c.kv_len)
    rest = inputs.allowed(with_mods=False)  # [B, 1|Hq, Lq, Lk]: every rule but the mask_mod
    rest = None if rest.all() else to_torch(rest, device).expand(full)
    case_score = bound(mods.score_mod, torch) if mods and mods.score_mod else None
    case_mask = bound(mods.mask_mod, torch) if mods and mods.mask_mod else None
    cap = c.soft_cap
    if compiled:  # a fresh compilation per case: past dynamo's recompile limit it would run eager
        torch._dynamo.reset()
        run = torch.compile(flex_attention, fullgraph=True)
    else:
        run = flex_attention

    def attn(Q, K, V, bias=None, mod_aux=(), **_):
        bias_full = None if bias is None else bias.expand(full)

        def score_mod(score, b, h, q_idx, kv_idx):
            if cap is not None:
                score = cap * torch.tanh(score / cap)
            if bias_full is not None:
                score = score + bias_full[b, h, q_idx, kv_idx]
            if case_score is not None:
                score = case_score(score, b, h, q_idx, kv_idx, *mod_aux)
            return score

        def mask_mod(b, h, q_idx, kv_idx):
            if rest is None:
                return case_mask(b, h, q_idx, kv_idx, *mod_aux)
            if case_mask is None:
                return rest[b, h, q_idx, kv_idx]
            return rest[b, h, q_idx, kv_idx] & case_mask(b, h, q_idx, kv_idx, *mod_aux)

        block_mask = None
        if rest is not None or case_mask is not None:
            block_mask = create_block_mask(mask_mod, c.batch, c.q_heads, c.q_len, c.kv_len, device=device,
                                           BLOCK_SIZE=c.block_size or 128)
        scored = cap is not None or bias is not None or case_score is not None
        with warnings.catch_warnings():  # eager on purpose: not its "use torch.compile" advice
            warnings.simplefilter("ignore", UserWarning)
            return run(Q, K, V, score_mod=score_mod if scored else None, block_mask=block_mask,
                       scale=c.scale, enable_gqa=c.q_heads != c.kv_heads)
    return attn
