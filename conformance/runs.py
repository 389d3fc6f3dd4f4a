"""Prepared calls: inputs on the device, compiled, ready to run and to hand back float64 results.

``Prepared.run()`` performs one forward (and with ``backward=True`` one vjp with the case's
random cotangent, never ``.sum()``) and blocks until the device is done; ``results()`` returns
``{"out", "dq", "dk", "dv"[, "dbias"][, "d<name>" per floating mod_aux entry]}`` as float64
numpy in the JAX layout ``[B, L, H, D]`` (dbias and the aux's in their own shapes). ``info``
holds facts about the call (e.g. "sdpa_backend"; "not_differentiated": why some gradients are
missing, when the implementation refuses them).
"""
from __future__ import annotations

import re
from typing import Callable

import numpy as np

from conformance.cases import Inputs


class NotSupported(Exception):
    """The implementation cannot run this case; the message says why."""


# What a platform cannot run (XLA refusing a dtype or precision on this device) is a limit of
# the platform, not a wrong answer: e.g. jax.nn's fp16 dot on CPU, "The precision
# 'F16_F16_F32' is not supported by dot_general on CPU".
_PLATFORM_LIMIT = re.compile(r"not supported (by \S+ )?on (CPU|GPU|TPU|cuda|rocm|this platform)|"
                             r"^UNIMPLEMENTED:|Unsupported .*\bon (CPU|GPU|TPU)\b", re.I | re.M)


_UNKNOWN_KEYWORD = re.compile(r"unexpected keyword argument '(\w+)'")


def platform_limitation(error: BaseException) -> str | None:
    """Why the call cannot run, when ``error`` says so: the platform refuses it (XLA: a dtype
    or precision this device has no kernel for), or the function takes no such keyword (a
    plug-in forwarding ``**kwargs`` to a function without it). None for any other error."""
    message = str(error).strip()
    first = message.splitlines()[0][:300] if message else ""
    if _PLATFORM_LIMIT.search(message):
        return f"the platform cannot run it: {type(error).__name__}: {first}"
    keyword = _UNKNOWN_KEYWORD.search(message)
    if isinstance(error, TypeError) and keyword:
        return f"no keyword argument {keyword.group(1)!r} ({first})"
    return None


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


class JaxPrepared(Prepared):
    """``attn(q, k, v, bias, mask, **keywords)`` jitted (with its vjp when ``backward``); a case
    with mods passes ``mod_aux=(...)`` too, differentiated in its floating entries."""

    def __init__(self, attn: Callable, inputs: Inputs, *, backward: bool, device: str, info=None):
        import jax
        import jax.numpy as jnp

        self.info = dict(info or {})
        dev = jax.devices("gpu" if device == "cuda" else "cpu")[0]
        put = lambda x: None if x is None else jax.device_put(jnp.asarray(x), dev)
        kw = inputs.attention_kwargs()
        dynamic = {n: put(v) for n, v in kw.items() if isinstance(v, np.ndarray)}
        static = {n: v for n, v in kw.items() if not isinstance(v, np.ndarray)}
        self._floats = [n for n, x in inputs.mod_aux.items() if np.issubdtype(x.dtype, np.floating)]

        def call(q, k, v, bias, mask, dyn, aux):
            mods = {"mod_aux": tuple(aux.values())} if aux else {}
            return attn(q, k, v, bias, mask, **dyn, **static, **mods)
        self._has_bias = inputs.bias is not None
        self._backward = backward
        args = tuple(put(x) for x in (inputs.q, inputs.k, inputs.v, inputs.bias, inputs.mask)) + (dynamic,)
        args += ({n: put(x) for n, x in inputs.mod_aux.items()},)

        if backward:
            def fn(q, k, v, bias, mask, dyn, aux, ct):
                differentiated = lambda q, k, v, bias, floats: call(q, k, v, bias, mask, dyn, {**aux, **floats})
                out, vjp = jax.vjp(differentiated, q, k, v, bias, {n: aux[n] for n in self._floats})
                return out, vjp(ct)
            args += (put(inputs.cotangent),)
        else:
            fn = call
        self._args = args
        try:
            self._compiled = jax.jit(fn).lower(*self._args).compile()
        except NotImplementedError as e:
            raise NotSupported(f"NotImplementedError: {e}") from e
        except Exception as e:
            reason = platform_limitation(e)
            if reason:
                raise NotSupported(reason) from e
            raise
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
        out, (dq, dk, dv, dbias, d_aux) = self._result
        res = {"out": _f64(out), "dq": _f64(dq), "dk": _f64(dk), "dv": _f64(dv)}
        if self._has_bias:
            res["dbias"] = _f64(dbias)
        res.update({f"d{n}": _f64(d_aux[n]) for n in self._floats})
        return res


class TorchPrepared(Prepared):
    """``attn(Q, K, V, **keywords)`` in torch_ref's layout ``[B, H, L, D]``; a case with mods
    passes ``mod_aux=(...)`` (tensors) too. ``grad_qkv=False``: the backward differentiates only
    the bias and the floating mod_aux entries (tensors a score_mod captures), not Q, K, V."""

    def __init__(self, attn: Callable, inputs: Inputs, *, backward: bool, device: str,
                 kwargs: dict | None = None, info=None, grad_qkv: bool = True):
        import torch
        from torch_ref import to_torch

        self.info = dict(info or {})
        self._torch = torch
        self._device = device
        bhld = lambda x: to_torch(x, device).transpose(1, 2).contiguous()  # [B,L,H,D] -> [B,H,L,D]
        self._q, self._k, self._v = (bhld(x) for x in (inputs.q, inputs.k, inputs.v))
        self._bias = None if inputs.bias is None else to_torch(inputs.bias, device)
        self._aux = {n: to_torch(x, device) for n, x in inputs.mod_aux.items()}
        self._grad_qkv = grad_qkv
        self._ct = bhld(inputs.cotangent)
        kw = kwargs if kwargs is not None else inputs.attention_kwargs()
        self._kw = {n: to_torch(v, device) if isinstance(v, np.ndarray) else v for n, v in kw.items()}
        if inputs.mask is not None:
            self._kw["mask"] = to_torch(inputs.mask, device)
        self._attn = attn
        self._backward = backward
        if backward:
            for t in self._differentiable().values():
                t.requires_grad_(True)
        self._result = None

    def _differentiable(self) -> dict:
        """The name of each gradient the backward computes -> the tensor it is of."""
        named = {"dq": self._q, "dk": self._k, "dv": self._v} if self._grad_qkv else {}
        if self._bias is not None:
            named["dbias"] = self._bias
        named.update({f"d{n}": t for n, t in self._aux.items() if t.is_floating_point()})
        return named

    def call_keywords(self) -> dict:
        """The keywords ``attn`` receives (the bias and the mod_aux among them when there are)."""
        kw = dict(self._kw)
        if self._bias is not None:
            kw["bias"] = self._bias
        if self._aux:
            kw["mod_aux"] = tuple(self._aux.values())
        return kw

    def _call(self):
        return self._attn(self._q, self._k, self._v, **self.call_keywords())

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
            grads = {}
        else:
            out = self._call()
            inputs = self._differentiable()
            grads = torch.autograd.grad(out, tuple(inputs.values()), grad_outputs=self._ct, allow_unused=True)
            grads = {n: torch.zeros_like(x) if g is None else g for g, (n, x) in zip(grads, inputs.items())}
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
            for name, g in grads.items():
                res[name] = blhd(g) if name in ("dq", "dk", "dv") else _f64(to_numpy(g.detach()))
        return res
