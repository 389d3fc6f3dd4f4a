"""``Adapter``: an implementation of attention behind one interface.

``name`` (e.g. "jax_impl.xla"), ``framework`` ("jax" | "torch"), ``device`` ("cpu" | "cuda"),
``unsupported(case)`` (cheap, static reasons) and ``prepare(inputs, *, backward)``, which puts
the inputs on the device, compiles (JAX: jit lower+compile; torch: one trial forward that turns
PyTorch's refusal into the reason) and raises ``NotSupported(reason)`` for what only shows at
that point. ``adapter.on(device)`` rebinds the device.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import inspect
from typing import Callable

from conformance.cases import Case, Inputs
from conformance.runs import JaxPrepared, NotSupported, Prepared


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@dataclasses.dataclass(frozen=True)
class Adapter:
    """An implementation of attention; subclasses fill in ``_reason`` and ``_prepare``."""

    name: str
    framework: str               # "jax" | "torch"
    device: str = "cpu"          # "cpu" | "cuda"
    requires: tuple = ()         # importable modules it needs
    devices: tuple = ("cpu", "cuda")  # where it can run at all
    description: str = ""
    # Where it runs only when named (--impl), and why: not in a default run there.
    on_request_only: tuple = ()
    on_request_why: str = ""
    explicit_scale = None  # str when the adapter itself supplies the scale (no default to probe)
    extras_ok = False  # takes attention sinks and jax_impl's hashed dropout pattern
    paged_ok = False   # takes a paged KV cache (Case.page_size)
    mods_ok = False    # takes score_mod / mask_mod / mod_aux (Case.mods) and a block mask

    def on(self, device: str) -> "Adapter":
        return dataclasses.replace(self, device=device)

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
        if (case.dropout or case.sinks) and not self.extras_ok:
            return "no attention sinks / no dropout with a given pattern"
        if case.page_size and not self.paged_ok:
            return "no paged KV cache"
        if case.mods and not self.mods_ok:
            return "no score_mod / mask_mod"
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


def keyword_filtered(fn: Callable, name: str) -> Callable:
    """``fn(q, k, v, bias, mask, **keywords)`` that raises NotSupported for a keyword (or a
    bias or mask) ``fn`` does not declare, instead of a TypeError."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn

    def wrapped(q, k, v, bias, mask, **kw):
        given = dict(kw, **{n: x for n, x in (("bias", bias), ("mask", mask)) if x is not None})
        missing = [n for n in given if n not in params]
        if missing:
            raise NotSupported(f"{name} has no argument {', '.join(missing)}")
        return fn(q, k, v, **given)
    return wrapped


@dataclasses.dataclass(frozen=True)
class JaxFunctionAdapter(Adapter):
    """A function with flash_attention's signature (JAX layout, JAX arrays)."""

    fn: Callable | None = None
    fixed_kwargs: tuple = ()     # ((name, value), ...) always passed
    reason_fn: Callable | None = None  # (adapter, case) -> str | None

    def _reason(self, case):
        return self.reason_fn(self, case) if self.reason_fn else None

    def _prepare(self, inputs, *, backward):
        fixed = dict(self.fixed_kwargs)
        base = keyword_filtered(self.fn, self.name)
        attn = lambda q, k, v, bias, mask, **kw: base(q, k, v, bias, mask, **fixed, **kw)
        return JaxPrepared(attn, inputs, backward=backward, device=self.device)
