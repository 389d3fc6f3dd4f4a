"""Facts about the machine a call runs on, for every backend: the host's threads, which
platform names are CUDA, and a guard that refuses to lower a call for any other platform."""
from __future__ import annotations

import os

import jax
import jax.extend
from jax.interpreters import ad, batching, mlir

CUDA_PLATFORMS = ("cuda", "gpu")


def host_threads() -> int:
    """Threads XLA:CPU may use here (this process's CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# --- CUDA guard ---------------------------------------------------------------------------
# Decided where the call is lowered, so that `jax.export(..., platforms=["cuda"])` works on a
# CPU-only host and a CPU lowering fails with a message that says what to use instead.
_requires_cuda_p = jax.extend.core.Primitive("flash_attention_requires_cuda")
_requires_cuda_p.def_impl(lambda x, **params: x)
_requires_cuda_p.def_abstract_eval(lambda x, **params: x)


def _refuse_lowering(ctx, x, *, message):
    platform = getattr(ctx.module_context, "platforms", ["this platform"])
    raise NotImplementedError(message.format(platform=tuple(platform)[0]))


mlir.register_lowering(_requires_cuda_p, _refuse_lowering)
# An identity, so every transformation passes straight through (vmap, and the autodiff that
# reaches it when JAX differentiates the custom VJP's backward and reports the real error).
batching.primitive_batchers[_requires_cuda_p] = lambda args, dims, **params: (
    _requires_cuda_p.bind(*args, **params), dims[0])
ad.deflinear(_requires_cuda_p, lambda cotangent, **params: [cotangent])
mlir.register_lowering(_requires_cuda_p, lambda ctx, x, **params: [x], platform="cuda")


def requires_cuda(x, message: str):
    """Identity on CUDA; lowering it for any other platform raises ``message`` (its
    ``{platform}`` filled in with that platform's name)."""
    return _requires_cuda_p.bind(x, message=message)
