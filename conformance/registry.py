"""Attention implementations across frameworks, behind one interface (conformance and benchmarks).

    adapter = REGISTRY["jax_impl.xla"]            # or available_adapters("cpu"), load_plugin("m:f")
    reason = adapter.unsupported(case)            # str (why it cannot run this case) or None
    prepared = adapter.prepare(make_inputs(case), backward=True)   # may raise NotSupported
    prepared.run()                                # one call, device synchronised (time this)
    prepared.results()                            # {"out", "dq", "dk", "dv"[, "dbias"]}: float64
                                                  # numpy, JAX layout [B, L, H, D]; dbias in the
                                                  # bias's shape

- ``Adapter``: ``name`` (e.g. "jax_impl.xla", "torch.sdpa.flash"), ``framework`` ("jax" |
  "torch"), ``device`` ("cpu" | "cuda"), ``unsupported(case)`` (cheap, static reasons) and
  ``prepare(inputs, *, backward)``. ``prepare`` puts the inputs on the device, compiles (JAX:
  jit lower+compile; torch: one trial forward that turns PyTorch's refusal into the reason),
  and raises ``NotSupported(reason)`` for what only shows at that point (a plug-in raising
  NotImplementedError, an SDPA backend refusing). ``adapter.on(device)`` rebinds the device.
- ``Prepared.run()`` performs one forward (and with ``backward=True`` one vjp with the case's
  random cotangent, never ``.sum()``) and blocks until the device is done; the first run of a
  torch adapter may include lazy initialisation, JAX compilation happens in prepare.
  ``Prepared.info`` holds facts about the call (e.g. "sdpa_backend": the SDPA backend that ran).
- ``REGISTRY``: name -> Adapter for the default device; ``available_adapters(device)``: those
  installed and able to run on ``device`` at all; ``load_plugin("module:function")``: an
  Adapter for a function with ``jax_impl.flash_attention.flash_attention``'s signature (JAX
  layout, JAX arrays); raising NotImplementedError means "not supported".
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import math
from typing import Any, Callable

import numpy as np

from conformance.cases import Case, Inputs


class NotSupported(Exception):
    """The implementation cannot run this case; the message says why."""


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def cuda_available() -> bool:
    try:
        import jax
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def default_device() -> str:
    return "cuda" if cuda_available() else "cpu"


# --- Prepared calls --------------------------------------------------------------------------

class Prepared:
    """One ready-to-run call. ``run()`` once before ``results()``."""

    info: dict

    def run(self) -> None:
        raise NotImplementedError

    def results(self) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def memory_analysis(self) -> dict | None:
        """Sizes in bytes of the compiled program (JAX: XLA's ``memory_analysis()``: temp,
        argument, output, ...); None where nothing is compiled ahead (torch)."""
        return None


def _f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


class _JaxPrepared(Prepared):
    def __init__(self, attn: Callable, inputs: Inputs, *, backward: bool, device: str, info=None):
        import jax
        import jax.numpy as jnp

        self.info = dict(info or {})
        dev = jax.devices("gpu" if device == "cuda" else "cpu")[0]
        put = lambda x: None if x is None else jax.device_put(jnp.asarray(x), dev)
        kw = inputs.attention_kwargs()
        dynamic = {n: put(v) for n, v in kw.items() if isinstance(v, np.ndarray)}
        static = {n: v for n, v in kw.items() if not isinstance(v, np.ndarray)}
        call = lambda q, k, v, bias, mask, dyn: attn(q, k, v, bias, mask, **dyn, **static)
        self._has_bias = inputs.bias is not None
        self._backward = backward

        if backward:
            def fn(q, k, v, bias, mask, dyn, ct):
                out, vjp = jax.vjp(lambda q, k, v, bias: call(q, k, v, bias, mask, dyn), q, k, v, bias)
                return out, vjp(ct)
            args = (inputs.q, inputs.k, inputs.v, inputs.bias, inputs.mask)
            self._args = tuple(put(x) for x in args) + (dynamic, put(inputs.cotangent))
        else:
            fn = call
            args = (inputs.q, inputs.k, inputs.v, inputs.bias, inputs.mask)
            self._args = tuple(put(x) for x in args) + (dynamic,)
        try:
            self._compiled = jax.jit(fn).lower(*self._args).compile()
        except NotImplementedError as e:
            raise NotSupported(f"NotImplementedError: {e}") from e
        self._result = None

    def memory_analysis(self) -> dict | None:
        try:
            m = self._compiled.memory_analysis()
        except Exception:  # a backend that does not report it
            return None
        if m is None:
            return None
        names = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
                 "alias_size_in_bytes", "generated_code_size_in_bytes")
        return {n: int(getattr(m, n)) for n in names if hasattr(m, n)}

    def run(self) -> None:
        import jax
        self._result = jax.block_until_ready(self._compiled(*self._args))

    def results(self) -> dict[str, np.ndarray]:
        if self._result is None:
            raise RuntimeError("call run() before results()")
        if not self._backward:
            return {"out": _f64(self._result)}
        out, (dq, dk, dv, dbias) = self._result
        res = {"out": _f64(out), "dq": _f64(dq), "dk": _f64(dk), "dv": _f64(dv)}
        if self._has_bias:
            res["dbias"] = _f64(dbias)
        return res


class _TorchPrepared(Prepared):
    def __init__(self, attn: Callable, inputs: Inputs, *, backward: bool, device: str,
                 kwargs: dict | None = None, info=None):
        import torch
        from torch_ref import to_torch

        self.info = dict(info or {})
        self._torch = torch
        self._device = device
        bhld = lambda x: to_torch(x, device).transpose(1, 2).contiguous()  # [B,L,H,D] -> [B,H,L,D]
        self._q, self._k, self._v = (bhld(x) for x in (inputs.q, inputs.k, inputs.v))
        self._bias = None if inputs.bias is None else to_torch(inputs.bias, device)
        self._ct = bhld(inputs.cotangent)
        kw = kwargs if kwargs is not None else inputs.attention_kwargs()
        self._kw = {n: to_torch(v, device) if isinstance(v, np.ndarray) else v for n, v in kw.items()}
        if inputs.mask is not None:
            self._kw["mask"] = to_torch(inputs.mask, device)
        self._attn = attn
        self._backward = backward
        if backward:
            for t in (self._q, self._k, self._v) + ((self._bias,) if self._bias is not None else ()):
                t.requires_grad_(True)
        self._result = None

    def _call(self):
        kw = dict(self._kw)
        if self._bias is not None:
            kw["bias"] = self._bias
        return self._attn(self._q, self._k, self._v, **kw)

    def trial(self) -> None:
        """One forward (with grad when backward is asked): raises what the implementation
        raises for this case (a fused SDPA backend may refuse inputs that require grad)."""
        with self._torch.set_grad_enabled(self._backward):
            self._call()

    def run(self) -> None:
        torch = self._torch
        if not self._backward:
            with torch.no_grad():
                out = self._call()
            grads = ()
        else:
            out = self._call()
            inputs = (self._q, self._k, self._v) + ((self._bias,) if self._bias is not None else ())
            grads = torch.autograd.grad(out, inputs, grad_outputs=self._ct, allow_unused=True)
            grads = tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs))
        if self._device == "cuda":
            torch.cuda.synchronize()
        self._result = (out, grads)

    def results(self) -> dict[str, np.ndarray]:
        from torch_ref import to_numpy
        if self._result is None:
            raise RuntimeError("call run() before results()")
        out, grads = self._result
        blhd = lambda t: _f64(to_numpy(t.detach().transpose(1, 2)))
        res = {"out": blhd(out)}
        if self._backward:
            res.update(dq=blhd(grads[0]), dk=blhd(grads[1]), dv=blhd(grads[2]))
            if self._bias is not None:
                res["dbias"] = _f64(to_numpy(grads[3].detach()))
        return res


# --- Adapters --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Adapter:
    """An implementation of attention; subclasses fill in ``_reason`` and ``_prepare``."""

    name: str
    framework: str               # "jax" | "torch"
    device: str = "cpu"          # "cpu" | "cuda"
    requires: tuple = ()         # importable modules it needs
    devices: tuple = ("cpu", "cuda")  # where it can run at all
    description: str = ""
    explicit_scale = None  # str when the adapter itself supplies the scale (no default to probe)

    def on(self, device: str) -> "Adapter":
        return dataclasses.replace(self, device=device)

    def installed(self) -> bool:
        return all(has_module(m) for m in self.requires)

    def available(self, device: str | None = None) -> str | None:
        """None when it can run on ``device`` at all, else why not."""
        device = device or self.device
        missing = [m for m in self.requires if not has_module(m)]
        if missing:
            return f"not installed ({', '.join(missing)})"
        if device not in self.devices:
            return f"runs only on {'/'.join(self.devices)}, not {device}"
        return None

    def unsupported(self, case: Case) -> str | None:
        return self.available() or self._reason(case)

    def prepare(self, inputs: Inputs, *, backward: bool) -> Prepared:
        reason = self.unsupported(inputs.case)
        if reason:
            raise NotSupported(reason)
        try:
            return self._prepare(inputs, backward=backward)
        except NotImplementedError as e:
            raise NotSupported(f"NotImplementedError: {e}") from e

    def _reason(self, case: Case) -> str | None:
        return None

    def _prepare(self, inputs: Inputs, *, backward: bool) -> Prepared:
        raise NotImplementedError


def _call_filtered(fn: Callable, name: str):
    """Wrap ``fn`` so that keywords it does not declare raise NotSupported instead of TypeError."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn

    def wrapped(q, k, v, bias, mask, **kw):
        missing = [n for n in kw if n not in params]
        if bias is not None and "bias" not in params:
            missing.append("bias")
        if mask is not None and "mask" not in params:
            missing.append("mask")
        if missing:
            raise NotSupported(f"{name} has no argument {', '.join(missing)}")
        extra = {}
        if bias is not None:
            extra["bias"] = bias
        if mask is not None:
            extra["mask"] = mask
        return fn(q, k, v, **extra, **kw)
    return wrapped


@dataclasses.dataclass(frozen=True)
class JaxFunctionAdapter(Adapter):
    """A function with flash_attention's signature (JAX layout, JAX arrays)."""

    fn: Callable | None = None
    fixed_kwargs: tuple = ()     # ((name, value), ...) always passed
    reason_fn: Callable | None = None  # case -> str | None

    def _reason(self, case):
        return self.reason_fn(self, case) if self.reason_fn else None

    def _prepare(self, inputs, *, backward):
        fixed = dict(self.fixed_kwargs)
        base = _call_filtered(self.fn, self.name)
        attn = lambda q, k, v, bias, mask, **kw: base(q, k, v, bias, mask, **fixed, **kw)
        return _JaxPrepared(attn, inputs, backward=backward, device=self.device)


def _jax_impl_fn():
    from jax_impl.flash_attention import flash_attention
    return flash_attention


@dataclasses.dataclass(frozen=True)
class JaxImplAdapter(Adapter):
    """``jax_impl.flash_attention`` with one implementation forced."""

    implementation: str = "xla"

    def _reason(self, case):
        if self.implementation == "pallas_triton":
            from jax_impl.pallas_triton.heuristics import MAX_HEAD_DIM
            if case.head_dim > MAX_HEAD_DIM:
                return f"head_dim={case.head_dim} > the kernel's maximum {MAX_HEAD_DIM}"
            if self.device == "cpu" and not case.interpret_ok:
                return "too large for the Pallas interpreter on CPU (runs on a GPU)"
        return None

    def _prepare(self, inputs, *, backward):
        fa = _jax_impl_fn()
        extra = {"implementation": self.implementation}
        if self.implementation == "pallas_triton" and self.device == "cpu":
            extra["interpret"] = True

        def attn(q, k, v, bias, mask, **kw):
            return fa(q, k, v, bias, mask, **extra, **kw)
        info = {"interpret": extra.get("interpret", False)}
        return _JaxPrepared(attn, inputs, backward=backward, device=self.device, info=info)


@dataclasses.dataclass(frozen=True)
class JaxDenseAdapter(Adapter):
    """Plain dense JAX attention as anyone would write it: logits in fp32 (preferred element
    type), softmax over the allowed pattern, probabilities cast to the input dtype."""

    explicit_scale = "written here with 1/sqrt(D)"

    def _prepare(self, inputs, *, backward):
        import jax
        import jax.numpy as jnp
        c = inputs.case
        allowed = inputs.allowed()  # [B, 1|Hq, Lq, Lk]
        group = c.q_heads // c.kv_heads
        scale, cap = c.effective_scale, c.soft_cap

        def attn(q, k, v, bias, mask, **_):
            kk, vv = (jnp.repeat(x, group, axis=2) for x in (k, v))
            s = jnp.einsum("bqhd,bkhd->bhqk", q, kk, preferred_element_type=jnp.float32,
                           precision=jax.lax.Precision.HIGHEST) * scale
            if cap is not None:
                s = cap * jnp.tanh(s / cap)
            if bias is not None:
                s = s + bias.astype(jnp.float32)
            s = jnp.where(allowed, s, -jnp.inf)
            row_ok = allowed.any(-1, keepdims=True)
            p = jax.nn.softmax(jnp.where(row_ok, s, 0.0), axis=-1)
            p = jnp.where(row_ok, p, 0.0).astype(q.dtype)
            out = jnp.einsum("bhqk,bkhd->bqhd", p, vv, preferred_element_type=jnp.float32,
                             precision=jax.lax.Precision.HIGHEST)
            return out.astype(q.dtype)
        return _JaxPrepared(attn, inputs, backward=backward, device=self.device)


def _jax_nn_reason(adapter, case: Case) -> str | None:
    if case.segments:
        return "jax.nn has no segment ids"
    if case.soft_cap is not None:
        return "jax.nn has no logits soft cap"
    if case.causal == "bottom_right" and (case.q_len != case.kv_len or case.lengths):
        return "jax.nn's is_causal is top-left only (no bottom-right alignment)"
    if case.window is not None and case.causal == "bottom_right":
        return "jax.nn's window is measured from the top-left diagonal only"
    impl = dict(adapter.fixed_kwargs).get("implementation")
    if impl == "cudnn":
        if case.dtype == "float32":
            return "jax.nn cuDNN attention takes fp16/bf16 only"
        if case.mask != "none" and case.bias:
            pass
    return None


def _jax_nn_fn(q, k, v, bias=None, mask=None, *, local_window_size=None, **kw):
    import jax
    if local_window_size is not None:  # jax.nn takes ints; None = unbounded
        big = q.shape[-3] + k.shape[-3]
        local_window_size = tuple(big if s is None else int(s) for s in local_window_size)
        kw["local_window_size"] = local_window_size
    return jax.nn.dot_product_attention(q, k, v, bias, mask, **kw)


@dataclasses.dataclass(frozen=True)
class JaxNNAdapter(JaxFunctionAdapter):
    def _prepare(self, inputs, *, backward):
        try:
            return super()._prepare(inputs, backward=backward)
        except NotSupported:
            raise
        except Exception as e:  # cuDNN's own constraint checks
            if dict(self.fixed_kwargs).get("implementation") == "cudnn":
                raise NotSupported(f"jax.nn cuDNN: {type(e).__name__}: {str(e)[:300]}") from e
            raise


@dataclasses.dataclass(frozen=True)
class PallasMhaAdapter(Adapter):
    explicit_scale = "mha's own default sm_scale is 1.0; the adapter passes 1/sqrt(D)"
    """jax.experimental.pallas.ops.gpu.attention.mha: GPU only, [B, L, H, D], no GQA, no mask."""

    def _reason(self, case):
        if case.q_heads != case.kv_heads:
            return "Pallas mha has no GQA/MQA (kv heads must equal q heads)"
        if case.mask != "none" or case.bias or case.lengths or case.window or case.soft_cap:
            return "Pallas mha has no mask, bias, lengths, window or soft cap"
        if case.segments and case.q_len != case.kv_len:
            return "Pallas mha takes one segment_ids array (needs Lq == Lk)"
        if case.causal == "bottom_right" and case.q_len != case.kv_len:
            return "Pallas mha's causal is top-left only"
        for n in (case.q_len, case.kv_len):
            if n % 128 and (n > 128 or n & (n - 1) or n < 16):
                return f"Pallas mha needs lengths that are multiples of its block (128), got {n}"
        if case.head_dim > 256:
            return "Pallas mha head_dim > 256"
        return None

    def _prepare(self, inputs, *, backward):
        from jax.experimental.pallas.ops.gpu.attention import mha
        c = inputs.case

        def attn(q, k, v, bias, mask, *, q_segment_ids=None, **_):
            # sm_scale passed explicitly: mha's default is 1.0, not 1/sqrt(D)
            return mha(q, k, v, q_segment_ids, sm_scale=c.effective_scale, causal=c.causal is not None)
        try:
            return _JaxPrepared(attn, inputs, backward=backward, device=self.device)
        except NotSupported:
            raise
        except Exception as e:
            raise NotSupported(f"Pallas mha: {type(e).__name__}: {str(e)[:300]}") from e


def _tokamax_fn(q, k, v, bias=None, mask=None, **kw):
    import tokamax
    return tokamax.dot_product_attention(q, k, v, bias=bias, mask=mask, **kw)


def _tokamax_reason(adapter, case):
    if case.segments:
        return "tokamax adapter: segment ids not mapped"
    if case.causal == "bottom_right" and case.q_len != case.kv_len:
        return "tokamax's is_causal is top-left"
    return None


# torch ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TorchManualAdapter(Adapter):
    """torch_ref.manual_attention in the case dtype (the course's function)."""

    def _prepare(self, inputs, *, backward):
        from torch_ref import manual_attention
        return _TorchPrepared(manual_attention, inputs, backward=backward, device=self.device)


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
        prepared = _TorchPrepared(attn, inputs, backward=backward, device=self.device)
        try:
            prepared.trial()
        except RuntimeError as e:
            raise NotSupported(f"torch.sdpa.{backend}: {str(e)[:400]}") from e
        prepared.info["sdpa_backend"] = backend if backend != "auto" else _dispatched(prepared)
        return prepared


def _dispatched(prepared: _TorchPrepared) -> str | None:
    """The backend SDPA's automatic choice runs for this call (torch_ref.probe_sdpa_backends)."""
    import torch
    from torch_ref import probe_sdpa_backends
    from torch_ref.sdpa import sdpa_arguments
    kw = dict(prepared._kw)
    if prepared._bias is not None:
        kw["bias"] = prepared._bias
    # in the run's grad mode: fused CPU kernels refuse some inputs that require grad
    with torch.set_grad_enabled(prepared._backward):
        q, k, v = prepared._q, prepared._k, prepared._v
        args = sdpa_arguments(q, k, v, backend="auto", **kw)
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
        prepared = _TorchPrepared(attn, inputs, backward=backward, device=self.device, kwargs={})
        try:
            prepared.trial()
        except RuntimeError as e:
            raise NotSupported(f"flash_attn: {str(e)[:300]}") from e
        return prepared


# --- Registry ---------------------------------------------------------------------------------

def _build(device: str) -> dict[str, Adapter]:
    adapters: list[Adapter] = [
        JaxImplAdapter("jax_impl.xla", "jax", device, ("jax",), implementation="xla",
                       description="jax_impl.flash_attention, blocked XLA path"),
        JaxImplAdapter("jax_impl.pallas_triton", "jax", device, ("jax",), implementation="pallas_triton",
                       description="jax_impl.flash_attention, Pallas Triton kernel (interpret=True on CPU)"),
        JaxImplAdapter("jax_impl.reference", "jax", device, ("jax",), implementation="reference",
                       description="jax_impl.flash_attention, dense reference"),
        JaxDenseAdapter("jax.dense", "jax", device, ("jax",), description="plain dense jnp attention"),
        JaxNNAdapter("jax.nn.xla", "jax", device, ("jax",), fn=_jax_nn_fn,
                     fixed_kwargs=(("implementation", "xla"),), reason_fn=_jax_nn_reason,
                     description="jax.nn.dot_product_attention(implementation='xla')"),
        JaxNNAdapter("jax.nn.cudnn", "jax", device, ("jax",), devices=("cuda",), fn=_jax_nn_fn,
                     fixed_kwargs=(("implementation", "cudnn"),), reason_fn=_jax_nn_reason,
                     description="jax.nn.dot_product_attention(implementation='cudnn')"),
        PallasMhaAdapter("jax.pallas.mha", "jax", device, ("jax",), devices=("cuda",),
                         description="jax.experimental.pallas.ops.gpu.attention.mha"),
        JaxFunctionAdapter("tokamax", "jax", device, ("tokamax",), fn=_tokamax_fn, reason_fn=_tokamax_reason,
                           description="tokamax.dot_product_attention"),
        TorchManualAdapter("torch.manual", "torch", device, ("torch",),
                           description="torch_ref.manual_attention in the case dtype"),
        *[TorchSdpaAdapter(f"torch.sdpa.{b}", "torch", device, ("torch",),
                           devices=("cuda",) if b in ("efficient", "cudnn") else ("cpu", "cuda"), backend=b,
                           description=f"torch SDPA, backend={b}")
          for b in ("auto", "math", "flash", "efficient", "cudnn")],
        FlashAttnAdapter("flash_attn", "torch", device, ("flash_attn", "torch"), devices=("cuda",),
                         description="flash_attn.flash_attn_func (FlashAttention-2)"),
    ]
    return {a.name: a for a in adapters}


REGISTRY: dict[str, Adapter] = _build("cpu")
try:  # jax initialisation is deferred to here: REGISTRY's device is the machine's default
    REGISTRY = _build(default_device())
except Exception:  # no jax: keep CPU bindings
    pass


def available_adapters(device: str | None = None) -> list[Adapter]:
    """Adapters installed and able to run on ``device`` (default: this machine's)."""
    device = device or default_device()
    return [a.on(device) for a in REGISTRY.values() if a.on(device).available() is None]


def get_adapter(name: str, device: str | None = None) -> Adapter:
    """A registry name, or ``module:function`` for a plug-in."""
    device = device or default_device()
    if ":" in name:
        return load_plugin(name, device=device)
    if name not in REGISTRY:
        raise KeyError(f"unknown implementation {name!r}; known: {', '.join(REGISTRY)} or module:function")
    return REGISTRY[name].on(device)


def load_plugin(spec: str, *, device: str | None = None) -> Adapter:
    """``"module:function"`` -> Adapter. The function takes flash_attention's arguments (JAX
    layout [B, L, H, D], JAX arrays); NotImplementedError from it means "not supported"."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"plug-in {spec!r} must be 'module:function'")
    fn: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"plug-in {spec!r} is not callable")
    return JaxFunctionAdapter(spec, "jax", device or default_device(), ("jax",), fn=fn,
                              description=f"plug-in {spec}")
