"""Plug-ins: ``--impl module:function``, any JAX function with flash_attention's signature.

The contract (conformance/README.md, "Plug-ins"): the harness calls
``function(q, k, v, bias, mask, **keywords)`` with JAX arrays in the layout ``[B, L, H, D]``
and the keywords a case uses (``PLUGIN_KEYWORDS``); a keyword the function does not declare
(and it takes no ``**kwargs``) makes the case "not supported". So does raising
``NotImplementedError`` or ``conformance.NotSupported``, an XLA error saying the platform
cannot run the call, or ``function.unsupported(case)`` returning a reason.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from conformance.adapters.base import JaxFunctionAdapter
from conformance.devices import default_device

# What a case can pass, besides q, k, v, bias and mask; only those the case uses are passed.
PLUGIN_KEYWORDS = ("scale", "is_causal", "causal_alignment", "local_window_size", "query_seq_lengths",
                   "key_value_seq_lengths", "q_segment_ids", "kv_segment_ids", "logits_soft_cap")


class PluginError(ValueError):
    """A ``module:function`` that cannot be loaded; the message names the spec and the cause."""


@dataclasses.dataclass(frozen=True)
class PluginAdapter(JaxFunctionAdapter):
    """A plug-in; its optional ``unsupported(case) -> str | None`` attribute declares what it cannot run."""

    def _reason(self, case):
        declared = getattr(self.fn, "unsupported", None)
        return declared(case) if callable(declared) else None


def load_plugin(spec: str, *, device: str | None = None) -> PluginAdapter:
    """``"module:function"`` (``function`` may be dotted, e.g. ``module:Class.method``) -> adapter."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise PluginError(f"plug-in {spec!r} must be 'module:function'")
    try:
        fn: Any = importlib.import_module(module_name)
    except Exception as e:  # the plug-in's own import error, in one line
        raise PluginError(f"plug-in {spec!r}: cannot import {module_name!r}: "
                          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise PluginError(f"plug-in {spec!r}: {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise PluginError(f"plug-in {spec!r} is a {type(fn).__name__}, not a function")
    return PluginAdapter(spec, "jax", device or default_device(), ("jax",), fn=fn,
                         description=f"plug-in {spec}")
