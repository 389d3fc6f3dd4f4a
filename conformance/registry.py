"""Every attention implementation the harness and the benchmarks know, by name.

    adapter = get_adapter("jax_impl.xla", "cpu")  # or available_adapters("cpu"), load_plugin("m:f")
    reason = adapter.unsupported(case)            # str (why it cannot run this case) or None
    prepared = adapter.prepare(make_inputs(case), backward=True)   # may raise NotSupported
    prepared.run()                                # one call, device synchronised (time this)
    prepared.results()                            # {"out", "dq", "dk", "dv"[, "dbias"]}: float64

The table is built on first use (``adapters(device)``, cached), so importing this module
starts no framework.
"""
from __future__ import annotations

import functools

from conformance.adapters.base import Adapter, JaxFunctionAdapter
from conformance.devices import default_device
from conformance.adapters.jax_side import (JaxDenseAdapter, JaxImplAdapter, JaxNNAdapter, MosaicMhaAdapter, PallasMhaAdapter,
                                           jax_nn_attention, jax_nn_reason, tokamax_attention, tokamax_reason)
from conformance.adapters.torch_side import FlashAttnAdapter, TorchFlexAdapter, TorchManualAdapter, TorchSdpaAdapter
from conformance.plugins import PluginError, load_plugin
from conformance.runs import NotSupported, Prepared

__all__ = ["Adapter", "NotSupported", "Prepared", "PluginError", "UnknownImplementation", "adapters",
           "available_adapters", "unavailable_adapters", "default_device", "get_adapter", "load_plugin"]

SDPA_BACKENDS = ("auto", "math", "flash", "efficient", "cudnn")


class UnknownImplementation(ValueError):
    """An implementation name the registry does not have."""


@functools.cache
def adapters(device: str = "cpu") -> dict[str, Adapter]:
    """name -> Adapter bound to ``device``, in report order."""
    jax_impl = [JaxImplAdapter(f"jax_impl.{impl}", "jax", device, ("jax",), implementation=impl, devices=devices,
                               description=f"jax_impl.flash_attention(implementation={impl!r}){note}",
                               **(dict(on_request_only=("cpu",), on_request_why=(
                                   "the TPU interpreter takes ~15 s a case on a CPU"))
                                  if impl == "mosaic_tpu" else {}))
                for impl, note, devices in (
                    ("cpu", "", ("cpu", "cuda")), ("xla", "", ("cpu", "cuda")),
                    ("pallas_triton", ", interpret=True on CPU", ("cpu", "cuda")),
                    ("mosaic_gpu", ", interpret=True on CPU (jax >= 0.11)", ("cpu", "cuda")),
                    ("mosaic_tpu", ", interpret=True on CPU (the TPU interpreter)", ("cpu",)),
                    ("reference", "", ("cpu", "cuda")), ("cudnn", ": jax.nn's cuDNN kernel", ("cuda",)))]
    jax_nn = [JaxNNAdapter(f"jax.nn.{impl}", "jax", device, ("jax",), devices=devices, fn=jax_nn_attention,
                           fixed_kwargs=(("implementation", impl),), reason_fn=jax_nn_reason,
                           description=f"jax.nn.dot_product_attention(implementation={impl!r})")
              for impl, devices in (("xla", ("cpu", "cuda")), ("cudnn", ("cuda",)))]
    sdpa = [TorchSdpaAdapter(f"torch.sdpa.{b}", "torch", device, ("torch",), backend=b,
                             devices=("cuda",) if b in ("efficient", "cudnn") else ("cpu", "cuda"),
                             description=f"torch SDPA, backend={b}")
            for b in SDPA_BACKENDS]
    listed: list[Adapter] = [
        *jax_impl,
        JaxDenseAdapter("jax.dense", "jax", device, ("jax",), description="plain dense jnp attention"),
        *jax_nn,
        PallasMhaAdapter("jax.pallas.mha", "jax", device, ("jax",), devices=("cuda",),
                         description="jax.experimental.pallas.ops.gpu.attention.mha"),
        MosaicMhaAdapter("jax.pallas.mgpu", "jax", device, ("jax",), devices=("cuda",),
                         description="jax.experimental.pallas.ops.gpu.attention_mgpu.attention (Hopper)"),
        JaxFunctionAdapter("tokamax", "jax", device, ("tokamax",), fn=tokamax_attention, reason_fn=tokamax_reason,
                           description="tokamax.dot_product_attention"),
        TorchManualAdapter("torch.manual", "torch", device, ("torch",),
                           description="torch_ref.manual_attention in the case dtype"),
        *sdpa,
        TorchFlexAdapter("torch.flex.eager", "torch", device, ("torch",),
                         description="torch.nn.attention.flex_attention, eager (unfused)"),
        TorchFlexAdapter("torch.flex.compiled", "torch", device, ("torch",), compiled=True,
                         description="torch.compile(flex_attention)", on_request_only=("cpu",),
                         on_request_why="Inductor compiles each case for ~20 s on a CPU"),
        FlashAttnAdapter("flash_attn", "torch", device, ("flash_attn", "torch"), devices=("cuda",),
                         description="flash_attn.flash_attn_func (FlashAttention-2)"),
    ]
    return {a.name: a for a in listed}


def available_adapters(device: str | None = None) -> list[Adapter]:
    """Adapters installed and able to run on ``device`` (default: this machine's), those that
    run there only on request left out."""
    device = device or default_device()
    return [a for a in adapters(device).values() if a.available() is None and device not in a.on_request_only]


def unavailable_adapters(device: str | None = None) -> dict[str, str]:
    """name -> why it is not in a default run on ``device`` (not installed, wrong device, only
    on request)."""
    device = device or default_device()
    found = ((a.name, a.available() or (f"only on request (--impl {a.name}): {a.on_request_why}"
                                        if device in a.on_request_only else None))
             for a in adapters(device).values())
    return {name: why for name, why in found if why is not None}


def get_adapter(name: str, device: str | None = None) -> Adapter:
    """A registry name, or ``module:function`` for a plug-in (raises PluginError)."""
    device = device or default_device()
    if ":" in name:
        return load_plugin(name, device=device)
    table = adapters(device)
    if name not in table:
        raise UnknownImplementation(f"unknown implementation {name!r}; known: {', '.join(table)}, "
                                    "or module:function for a plug-in")
    return table[name]
